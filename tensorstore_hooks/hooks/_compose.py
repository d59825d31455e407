"""When offloading stands aside for activation checkpointing.

NOTE [ Checkpoint composition ]
A checkpointed region keeps (almost) nothing for backward and recomputes its
activations there; offloading exists to avoid keeping them too. Both act through
the saved-tensor hooks stack, where the innermost pair wins, so whichever is
pushed last decides. What each combination does, measured with torch 2.13:

1. Offloading outside, checkpoint inside (``with offload(): checkpoint(block, x)``,
   ``tsh.wrap(model)`` around ``checkpoint_wrapper`` blocks, HF layers, which
   checkpoint their ``forward`` inside the module hooks): the checkpoint's hooks
   are pushed last and take the region; offloading gets the rest, including the
   checkpoint's boundary inputs. Correct as it is.
2. Offloading inside a non-reentrant checkpoint (``with offload()`` in the
   checkpointed function, ``checkpoint_wrapper(block)`` of a ``tsh.wrap``-ped
   block, a ``wrap`` glob naming a module inside a checkpointed layer): our hooks
   would be pushed on top of the checkpoint's, store every activation of the
   region (448 MiB where 40 MiB were needed on a measured run), and leave the
   checkpoint nothing to recompute. Rule 1: a block entered while a checkpoint's
   hooks (``_checkpoint_hook``/``_recomputation_hook`` from
   ``torch.utils.checkpoint``) are on top pushes nothing.
3. Offloading inside a reentrant checkpoint: the first forward runs under
   ``no_grad`` (nothing is saved), and the recompute runs in backward, where the
   region's tensors are needed at once: storing them only costs a write and a read.
   Rule 2: a block entered while backward runs (an autograd graph task is
   executing on this thread) pushes nothing.
4. The same recompute under hooks entered *before* backward (``with hooks:
   loss = model(x); loss.backward()``): the block is already pushed. Rule 3: a
   tensor packed while backward runs is kept in place (``Router.pack``, stats label
   ``"saved during backward"``); the same holds for a ``create_graph`` backward.

A block that pushed nothing pops nothing; the functions below keep a per-thread
stack of what each entry did (``block_enter``/``block_exit``), so nesting stays balanced.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["block_abort", "block_enter", "block_exit", "checkpoint_decides"]

_CHECKPOINT_MODULE = "torch.utils.checkpoint"


def checkpoint_decides() -> bool:
    """Whether a checkpoint owns what is saved here (see NOTE [ Checkpoint composition ])."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None and getattr(top[0], "__module__", None) == _CHECKPOINT_MODULE:
        return True  # Rule 1
    return bool(torch._C._current_graph_task_id() != -1)  # Rule 2


class _Entered(threading.local):
    def __init__(self) -> None:
        self.pushed: list[bool] = []


_ENTERED = _Entered()


def block_enter() -> bool:
    """Call at the start of a hooks block's ``__enter__``: False means push nothing.

    Every ``block_enter()`` must be matched by one :func:`block_exit` on the same thread
    (or by :func:`block_abort` when ``__enter__`` fails after it).
    """
    push = not checkpoint_decides()
    _ENTERED.pushed.append(push)
    return push


def block_exit() -> bool:
    """Call at the start of ``__exit__``: whether the matching :func:`block_enter` pushed."""
    pushed = _ENTERED.pushed
    return pushed.pop() if pushed else True


def block_abort() -> None:
    """Undo the last :func:`block_enter` of this thread (its ``__enter__`` raised)."""
    if _ENTERED.pushed:
        _ENTERED.pushed.pop()
