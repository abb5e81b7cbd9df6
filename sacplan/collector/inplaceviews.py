"""The backward of an in-place op on a view, as the real step runs it (the fake step replays it otherwise).

An in-place op on a view that autograd records (``Linear``'s 3-D output is a view of its 2-D ``addmm``; ``h.relu_()``)
rebases the history: the base's ``grad_fn`` becomes a ``CopySlices`` and the view's is regenerated. On strided
device tensors (CPU, CUDA) the regenerated node is an ``AsStridedBackward0``, whose backward allocates a zeroed
gradient of the base's storage extent, copies the incoming gradient into it and hands the base-shaped result on
(``as_strided_backward`` in torch/csrc/autograd/FunctionsManual.cpp: ``new_zeros``, ``as_strided``, ``copy_``). A
``FakeTensor`` is a Python-dispatch tensor, for which autograd replays the view ops instead (the generated
``ADInplaceOrView`` kernels keep a view function when ``is_python_dispatch()``), so the fake step's node is, say, a
``ViewBackward0``: an alias of the incoming gradient, no bytes. That fake backward is one base-sized gradient low
wherever the incoming gradient is still held elsewhere (a residual branch): +8.3% on
tests/fuzz/test_regressions.py ``test_inplace_activation_in_a_residual_branch``.

:class:`InplaceViewBackwards` puts the real allocation back into the fake step: after each recorded in-place op on
a fake view whose regenerated node replays pure aliases (view, transpose, permute, (un)squeeze...), a pre-hook on
that node runs the ``as_strided_backward`` ops on the incoming gradient, so the recorder sees the same ``new_zeros``
(bytes), ``as_strided`` and ``copy_`` as on the real tensors, with the same lifetime (the zeroed storage is what the
alias chain hands to ``CopySlices``). A replayed chain with a node that allocates (``SliceBackward0``,
``SelectBackward0``: a zeroed base-sized gradient of its own, as the real ``as_strided_backward``) is left as it is.
Real tensors (the tracker run on them, DTensors) are never touched.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_leaves

from sacplan.collector.materialise import is_fake

#: backward nodes of view ops whose backward only aliases its incoming gradient (no allocation)
ALIAS_BACKWARDS = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "AliasBackward0",
})
_MARK = "sacplan_as_strided_backward"


def min_storage_size(sizes: Sequence[int], strides: Sequence[int], offset: int) -> int:
    """Elements a storage needs to hold a strided geometry (``_min_storage_size`` of FunctionsManual.cpp)."""
    if any(s == 0 for s in sizes):
        return 0
    return offset + 1 + sum((s - 1) * st for s, st in zip(sizes, strides))


class InplaceViewBackwards:
    """Hooks the fake step's replayed view nodes (see module docstring).

    :meth:`note` each forward in-place op's arguments at its dispatch; autograd rebases the view only after the
    dispatch returns, and regenerates its node by replaying the views through the dispatcher, where reading the
    view's ``grad_fn`` would regenerate it early (from the base's old node: a wrong graph). So the node is read
    at the first later op that takes the view as an argument (:meth:`settle`, called at every dispatch): autograd
    has then read it itself, and it is the node that op's backward reaches. A view nothing reads again has no
    gradient through it.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[weakref.ref, int]] = []

    def note(self, args: tuple, kwargs: dict) -> None:
        """``args``/``kwargs`` of an in-place op dispatched in forward with grad mode on."""
        target = args[0] if args else None
        if not (isinstance(target, torch.Tensor) and is_fake(target) and target._is_view()):
            return
        if target.requires_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in tree_leaves((args, kwargs))):
            self._pending.append((weakref.ref(target), target._version))

    def settle(self, args: tuple, kwargs: dict) -> None:
        """Hook the node of every pending view among the arguments of the op being dispatched (in forward; a
        backward op drops what is pending: the views' nodes are in the graph already, or never)."""
        if not self._pending:
            return
        if torch._C._current_graph_task_id() != -1:
            self._pending = []
            return
        leaves = {id(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        keep = []
        for ref, version in self._pending:
            t = ref()
            if t is None:
                continue
            if id(t) in leaves and t._version != version:
                _hook_view_node(t)
            else:
                keep.append((ref, version))
        self._pending = keep


def _hook_view_node(t: torch.Tensor) -> None:
    base = t._base
    node = t.grad_fn
    if base is None or node is None or base.grad_fn is None or _MARK in node.metadata:
        return
    if not _replays_aliases(node, base.grad_fn):
        return
    node.metadata[_MARK] = True
    sizes, strides = tuple(t.shape), tuple(t.stride())
    shared = min(base.storage_offset(), t.storage_offset())
    out_offset = t.storage_offset() - shared
    extent = max(min_storage_size(base.shape, base.stride(), base.storage_offset() - shared),
                 min_storage_size(sizes, strides, out_offset))

    def as_strided_backward(grad_outputs: tuple) -> tuple | None:
        grad = grad_outputs[0]
        if grad is None:
            return None
        storage = grad.new_zeros(extent)
        storage.as_strided(sizes, strides, out_offset).copy_(grad)
        return (storage.as_strided(sizes, strides, out_offset),) + tuple(grad_outputs[1:])

    node.register_prehook(as_strided_backward)


def _replays_aliases(node: Any, base_node: Any) -> bool:
    """Whether the chain of nodes from ``node`` to the base's node is alias-only view backwards."""
    while node is not base_node:
        if node is None or type(node).__name__ not in ALIAS_BACKWARDS:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return True
