"""``F.linear``'s bias add, which ATen runs in place on real tensors and out of place under a dispatch mode.

``at::linear`` (aten/src/ATen/native/Linear.cpp) with a bias and an input it cannot flatten into one ``addmm``
(a non-contiguous 3-D input: a transposed BatchNorm1d output) runs ``matmul(input, weight.t())`` and then adds
the bias: ``output.add_(bias)`` on plain tensors, but ``output = at::add(output, bias)`` "for composite
compliance" when ``isTensorSubclassLike(bias)``, which is true for every tensor while a Python dispatch mode is
active. So the collector (fake tensors, and its own dispatch mode on real ones) sees ``aten.add.Tensor``: the
matmul's output and the sum live at once, one output-sized buffer more than the real unplanned step holds
(measured: tests/fuzz/test_regressions.py ``test_linear_after_transposed_batchnorm_forward_peak_over_predicted``,
the predicted forward peak 31,224 B over the allocator's).

:class:`LinearBiasMode` marks the bias of the ``linear`` call running; the recorder treats the ``add`` of that
bias like the engine's gradient accumulation (``StorageAccounting.defer_accumulation_peak``): the out-of-place
peak counts only if the matmul's output outlives the add, which it never does inside ``linear``. The op itself
stays ``add.Tensor`` (what a selective-checkpoint region, itself under a dispatch mode, runs and keys), and the
op record's ``live`` keeps the out-of-place bytes (a recomputation under the policy's mode holds them).

Not modelled: the forward of a region checkpointed *selectively* runs under the policy's dispatch mode too, so
there the real add is out of place and the forward events (now the plain step's) can be one matmul output low at
such an add. No fuzz plan has peaked there (the forward of a selective region frees what it does not save).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["LinearBiasMode", "is_linear_bias_add"]

_LINEAR = frozenset({torch._C._nn.linear, torch.nn.functional.linear})


class LinearBiasMode(TorchFunctionMode):
    """Holds, while a ``linear`` call with a bias runs, that bias (``self.bias``; ``None`` outside such calls).

    A bias that is itself a tensor subclass (a DTensor) takes the out-of-place path on real tensors too and is
    not marked, nor is any bias while forward-mode AD is on (a bias with a tangent adds out of place).
    """

    def __init__(self) -> None:
        super().__init__()
        self.bias: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _LINEAR:
            return func(*args, **kwargs)
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if (not isinstance(bias, torch.Tensor) or (is_traceable_wrapper_subclass(bias) and not _is_fake(bias))
                or forward_ad._current_level >= 0):
            return func(*args, **kwargs)
        outer, self.bias = self.bias, bias
        try:
            return func(*args, **kwargs)
        finally:
            self.bias = outer


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def is_linear_bias_add(func: Any, args: tuple, kwargs: dict, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The matmul output ``linear`` adds ``bias`` to if this op is that add (``aten.add.Tensor(output, bias)``,
    alpha 1), else ``None``."""
    if bias is None or func is not torch.ops.aten.add.Tensor or len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return None
    out, b = args
    if b is not bias or not isinstance(out, torch.Tensor):
        return None
    return out
