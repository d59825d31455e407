"""Capture of padded batches: an attention mask picks the real tokens.

NOTE [ Capture masks ]
Dynamic padding (what most fine-tuning uses) makes a third of a batch's positions
pads, and a new padded length every batch. ``capture(..., mask=...)`` keeps only the
real tokens:

1. ``mask`` is a tensor of shape ``(batch, seq)`` (bool, or numbers where nonzero is a
   real token), set at ``capture()`` or per batch with ``cap.mask = ...``; or the name
   of the model's keyword argument that carries it (``"attention_mask"``, as HF
   batches do: ``model(**batch)``; a dict passed as the first positional argument is
   looked in too), read at every forward of the model. A forward without it is a
   :class:`ConfigError` at the user's line.
2. A leaf whose first two axes are the mask's ``(batch, seq)`` is *masked*: its rows are
   its real tokens only, in (sample, position) order, each of shape ``t.shape[2:]``,
   so one array per module and kind holds every batch whatever its padded length.
   Other leaves (a pooled ``(batch, d)`` output, attention maps) are captured as
   without a mask. A ``(batch, k)`` leaf whose ``k`` happens to equal a batch's ``seq``
   is masked in that batch: its rows then go to an array of their own (rule 6 of NOTE
   [ Capture names ]), never mixed with its unmasked rows.
3. A masked array ``NAME`` has a companion ``NAME~tokens``: one int64 row
   ``[step, sample, position]`` per row of ``NAME``, in the same order (row ``i`` of
   both is one token), so rows join back to the text they came from. Its blocks are
   those of ``NAME``; ``attributes.masked`` of ``NAME`` names it.
4. ``grad_output`` uses the mask of the forward that made the output; ``grad_input``
   and ``input`` that of the latest forward. A mask on an accelerator is read back to
   the host once per forward (a synchronisation): pass the host copy (``cap.mask =
   batch["attention_mask"]`` before it is moved) to avoid it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tensorstore_hooks.errors import ConfigError

__all__ = ["TOKENS_SUFFIX", "Mask", "check_mask", "mask_from_call"]

TOKENS_SUFFIX = "~tokens"
"""The companion array of a masked array ``NAME`` is ``NAME~tokens`` (rule 3)."""


def check_mask(value: object, where: str) -> torch.Tensor:
    """``value`` as a mask tensor (rule 1), or a :class:`ConfigError` naming ``where``."""
    if not isinstance(value, torch.Tensor):
        raise ConfigError(
            f"capture: {where}: expected a (batch, seq) tensor such as a tokenizer's "
            f"attention_mask, got {type(value).__name__}"
        )
    if value.dim() != 2 or value.is_sparse or value.is_complex():
        raise ConfigError(
            f"capture: {where}: expected a (batch, seq) mask (1 or True for real tokens), "
            f"got a {'sparse ' if value.is_sparse else ''}tensor of shape "
            f"{tuple(value.shape)} and dtype {value.dtype}"
        )
    return value


def mask_from_call(
    key: str, args: tuple[object, ...], kwargs: Mapping[str, object]
) -> torch.Tensor:
    """The mask a forward was called with: ``kwargs[key]``, or ``args[0][key]`` for a
    dict batch (rule 1)."""
    if key in kwargs:
        value = kwargs[key]
    elif args and isinstance(args[0], Mapping) and key in args[0]:
        value = args[0][key]
    else:
        batch = args[0] if args and isinstance(args[0], Mapping) else {}
        given = sorted(kwargs) or sorted(map(str, batch))
        raise ConfigError(
            f"capture: mask={key!r}, but the model was called without {key}= (its keyword "
            f"arguments: {', '.join(given) or 'none'}). Pass {key}=... to the model (HF: "
            "model(**batch)), name the key the batch uses, or set cap.mask = tensor"
        )
    if value is None:
        raise ConfigError(
            f"capture: mask={key!r}, but the model was called with {key}=None: pass the "
            "attention mask (the collator's), or capture without mask="
        )
    return check_mask(value, f"mask={key!r}")


class Mask:
    """The mask of one forward: which rows of a masked leaf are real (rule 2), and
    their ``[step, sample, position]`` (rule 3), computed once and shared by every hook."""

    __slots__ = ("_flat", "_mask", "_on", "_where", "shape")

    def __init__(self, mask: torch.Tensor) -> None:
        self._mask = mask.detach()
        self.shape: tuple[int, int] = (int(mask.shape[0]), int(mask.shape[1]))
        self._flat: torch.Tensor | None = None
        self._on: dict[torch.device, torch.Tensor] = {}
        self._where: dict[int, torch.Tensor] = {}

    def matches(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is masked: its first two axes are ``(batch, seq)`` (rule 2)."""
        return t.dim() >= 2 and (int(t.shape[0]), int(t.shape[1])) == self.shape

    def _positions(self) -> torch.Tensor:
        """``(n, 2)`` int64 ``[sample, position]`` of the real tokens, on the host."""
        if self._flat is None:
            keep = self._mask if self._mask.dtype == torch.bool else self._mask != 0
            self._flat = keep.cpu().nonzero()  # rule 4: one read-back per forward
        return self._flat

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The real tokens of ``t`` (masked): shape ``(n, *t.shape[2:])``, a new tensor."""
        index = self._on.get(t.device)
        if index is None:
            pos = self._positions()
            index = (pos[:, 0] * self.shape[1] + pos[:, 1]).to(t.device)
            self._on[t.device] = index
        return t.detach().flatten(0, 1).index_select(0, index)

    def where(self, step: int) -> torch.Tensor:
        """``(n, 3)`` int64 rows ``[step, sample, position]`` (rule 3)."""
        rows = self._where.get(step)
        if rows is None:
            pos = self._positions()
            rows = torch.cat([torch.full((len(pos), 1), step, dtype=torch.int64), pos], dim=1)
            self._where[step] = rows
        return rows
