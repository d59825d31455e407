"""Parameter casts: recognised at pack, recomputed at unpack, never moved.

NOTE [ Parameter casts ]
Under ``torch.autocast`` autograd saves the low-precision casts of the weights (a
linear layer saves ``weight.to(bfloat16).t()``), and so does any ``.to(dtype)`` of
a parameter in user code. Such a tensor is a pure function of a leaf that lives
anyway: storing it would move bytes nobody needs to move (85% of what an autocast
MLP offloads). Rules, numbered so code can cite them:

1. Recognised: a saved tensor whose base (the tensor itself, or the root of the
   view it is) was made by one ``ToCopyBackward0`` straight from a leaf (an
   ``nn.Parameter`` or any tensor autograd accumulates a gradient into), on the
   leaf's device, with the leaf's shape and strides, at storage offset 0. Anything
   else (a chain of casts, a cast across devices, a frozen weight whose cast has
   no autograd history) is not recognised and goes through the rules as usual.
2. Only a tensor the rules would move (``store`` or ``host``) is recomputed: a rule
   that keeps it (``keep``, or below ``min_bytes``) keeps it. ``policy.recompute_casts:
   false`` turns recognition off, so the casts go through the rules like any tensor
   (a rule can then keep them).
3. Unpack returns the cast itself while it is still alive (autocast's cache holds it
   until the autocast block exits: a backward run inside the block reads no byte
   twice), else ``leaf.to(dtype)`` made again with the strides the cast had, under
   ``no_grad``: the same rounding, so gradients are bit-identical.
4. Version-checked: a leaf changed in place since pack (an optimiser step between
   forward and backward), or the cast itself changed in place, raises torch's
   in-place error at unpack, never returns other values. (A change torch does not
   version, ``param.data.copy_(...)``, is not seen: as torch, which would use the
   old cast, we then differ; the rule is torch's own: do not change what backward
   reads.)
5. Counted at pack: ``stats.recomputed`` / ``stats.bytes_recomputed``, the action
   ``recompute`` in ``stats.per_action`` and the label ``parameter cast`` in
   ``stats.per_rule``. Recomputed tensors cost no budget (``device_budget`` plans what
   moves; these move nothing).
"""

from __future__ import annotations

import weakref

import torch

from tensorstore_hooks.pipeline._records import inplace_error

__all__ = ["CAST_LABEL", "TO_COPY", "Recomputed", "recomputable"]

CAST_LABEL = "parameter cast"
"""The stats label (``stats.per_rule``) of recomputed parameter casts."""

TO_COPY = "ToCopyBackward0"
"""The ``grad_fn`` name of a cast (``.to(dtype)``): a tensor whose own or whose base's
``grad_fn`` has another name is no parameter cast (rule 1)."""


class Recomputed:
    """A parameter cast's stand-in in the autograd graph: the leaf and how to remake it.

    ``leaf``: the parameter (held strongly: autograd's ``AccumulateGrad`` holds it
    anyway); ``view``: ``(shape, stride, offset)`` of the saved tensor over its base.
    """

    __slots__ = (
        "base_ref",
        "base_shape",
        "base_stride",
        "base_version",
        "dtype",
        "leaf",
        "leaf_version",
        "view",
    )

    def __init__(self, t: torch.Tensor, base: torch.Tensor, leaf: torch.Tensor) -> None:
        self.leaf = leaf
        self.leaf_version = leaf._version
        self.dtype = base.dtype
        self.base_shape = tuple(base.shape)
        self.base_stride = tuple(base.stride())
        # Rule 3: the cast itself while something else keeps it alive (autocast's cache).
        self.base_ref: weakref.ref[torch.Tensor] = weakref.ref(base)
        self.base_version = base._version
        self.view = (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    @property
    def device(self) -> torch.device:
        """Where the tensor comes back: the leaf's device."""
        return self.leaf.device

    def unpack(self) -> torch.Tensor:
        """The saved tensor again (rule 3); torch's in-place error when changed (rule 4)."""
        if self.leaf._version != self.leaf_version:
            raise inplace_error(
                f"the parameter of shape {self.base_shape} whose {self.dtype} cast"
            )
        base = self.base_ref()
        if base is not None and base._version != self.base_version:
            raise inplace_error(f"a {self.dtype} cast of shape {self.base_shape}")
        if base is None:
            base = self._remake()
        shape, stride, offset = self.view
        return base.detach().as_strided(shape, stride, offset)

    def _remake(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.leaf.detach().to(self.dtype)
            if tuple(out.stride()) != self.base_stride:
                # ``to`` keeps a dense leaf's strides; anything else is laid out as the
                # cast was (``_to_copy`` is this very empty + copy_).
                out = torch.empty_strided(
                    self.base_shape, self.base_stride, dtype=self.dtype, device=self.device
                )
                out.copy_(self.leaf.detach())
        return out


def recomputable(t: torch.Tensor) -> Recomputed | None:
    """``t``'s stand-in if it is a parameter cast (rule 1), else ``None``. Cheap: a few
    attribute reads for a tensor that is not one."""
    base = t._base
    if base is None:
        base = t
    fn = base.grad_fn
    if fn is None or fn.name() != TO_COPY:
        return None
    nexts = fn.next_functions
    if len(nexts) != 1 or nexts[0][0] is None:
        return None
    leaf = getattr(nexts[0][0], "variable", None)  # AccumulateGrad's leaf
    if not isinstance(leaf, torch.Tensor) or not _same_layout(base, leaf):
        return None
    return Recomputed(t, base, leaf)


def _same_layout(base: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether remaking ``base`` from ``leaf`` lays it out as it was (rule 1)."""
    return (
        base.device == leaf.device
        and base.shape == leaf.shape
        and base.stride() == leaf.stride()
        and base.storage_offset() == 0
        and base.layout == torch.strided
        and leaf.layout == torch.strided
    )
