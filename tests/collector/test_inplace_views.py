"""The backward of an in-place op on a view (sacplan/collector/inplaceviews.py).

``relu_`` on a ``Linear``'s 3-D output (a view of its 2-D ``addmm``) makes autograd rebase the view: on the real
tensors its node becomes an ``AsStridedBackward0``, whose backward allocates a zeroed gradient of the base's size
while the residual branch still holds the incoming one; the fake step replays the view (an alias) unless the
collector puts that allocation back. Expected peaks are checked against the CPU allocator (``torch.profiler``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from sacplan.collector import collect
from sacplan.collector.inplaceviews import InplaceViewBackwards
from sacplan.devices import CPU
from sacplan.measurement import measure_step

aten = torch.ops.aten
B, L, D = 4, 32, 128  # one (B, L, D) fp32 activation: 64 KiB


class Residual(nn.Module):
    """``x + relu_(fc(x))`` after an input ``Linear`` (so the residual branch's gradient is held)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        return x + F.relu(self.fc(x), inplace=True)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * out).sum()


def test_residual_inplace_backward_peak_matches_the_allocator() -> None:
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(0))
    stats = collect(Residual, (x,), device=CPU, loss_fn=_loss, optimizer=False)
    model = Residual()

    def step() -> None:
        _loss(model(x)).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up (the measured step is the second, as validate does)
    measured, tracked, _ = measure_step(model, (x,), step, None, torch.device("cpu"))
    assert stats.peak_bytes == tracked, (stats.peak_bytes, tracked)
    assert abs(measured - stats.peak_bytes) <= 0.01 * measured, (stats.peak_bytes, measured)


class BackwardOps(TorchDispatchMode):
    """Records ``(op, output shape)`` of each op the autograd engine runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() != -1 and isinstance(out, torch.Tensor):
            self.ops.append((func, tuple(out.shape)))
        return out


def _backward_ops(fake: bool) -> list[tuple[Any, tuple[int, ...]]]:
    views = InplaceViewBackwards()
    log = BackwardOps()
    with FakeTensorMode() if fake else contextlib.nullcontext():
        fc = nn.Linear(D, D)
        x = torch.randn(B, L, D, requires_grad=True)
        h = fc(x)
        views.note((h,), {})
        h.relu_()
        views.settle((h,), {})
        with log:
            (gx,) = torch.autograd.grad(x + h, x, torch.ones(B, L, D))
    assert gx.shape == (B, L, D)
    return [(f, s) for f, s in log.ops if f._overloadpacket is not aten.detach]


def test_fake_backward_runs_the_real_ops() -> None:
    """The real ``AsStridedBackward0`` runs ``new_zeros`` of the base's extent, ``as_strided``, ``copy_``; the fake
    step's hooked alias node runs the same (then its alias: a ``view`` where the real step takes an ``as_strided``
    of the base's geometry), and ``CopySlices`` / ``relu_``'s backward follow alike."""
    real, fake = _backward_ops(False), _backward_ops(True)
    assert real[:3] == [(aten.new_zeros.default, (B * L * D,)), (aten.as_strided.default, (B, L, D)),
                        (aten.copy_.default, (B, L, D))]
    assert fake[:3] == real[:3]
    allocating = {aten.new_zeros.default, aten.new_empty_strided.default, aten.clone.default, aten.mm.default,
                  aten.threshold_backward.default}
    assert [op for op in fake if op[0] in allocating] == [op for op in real if op[0] in allocating]


def test_real_views_are_left_alone() -> None:
    views = InplaceViewBackwards()
    fc = nn.Linear(D, D)
    h = fc(torch.randn(B, L, D))
    views.note((h,), {})
    h.relu_()
    views.settle((h,), {})
    assert type(h.grad_fn).__name__ == "AsStridedBackward0"
    assert not h.grad_fn.metadata
