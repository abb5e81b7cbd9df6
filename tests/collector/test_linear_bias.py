"""``F.linear``'s bias add on an input it cannot flatten: in place on the real step, out of place under any dispatch
mode (sacplan/collector/linearbias.py).

A ``Linear`` on a transposed 3-D input runs ``clone`` + ``mm`` and adds the bias. With no dispatch mode active
ATen adds in place (``output.add_(bias)``): the input and one output live at the add (the weight is frozen, so
``mm`` saves no clone and the backward is small: the step peaks at the add). Under the recorder (a
dispatch mode, fake or real tensors) it runs ``add`` out of place, so before the fix the prediction held the
matmul's output beside the sum: one activation over the allocator (-6.3% on the fuzz model of
tests/fuzz/test_regressions.py). The contrast: ``matmul(x, w.t()) + b`` written out is out of place on the real
step too, and must stay counted so. Peaks are checked against the CPU allocator (``torch.profiler`` events).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.measurement import measure_step

B, S, D = 4, 64, 64
ACT = B * S * D * 4  # one (B, S, D) fp32 activation: 64 KiB


class TransposedLinear(nn.Module):
    """``fc(x.transpose(1, 2))``: ``x`` is ``(B, D, S)``, so the Linear's input is not contiguous."""

    def __init__(self, written_out: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.fc.weight.requires_grad_(False)
        self.written_out = written_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        if self.written_out:  # the same ops, the add as user code: out of place on the real step
            return torch.matmul(h, self.fc.weight.t()) + self.fc.bias
        return self.fc(h)


def _x() -> torch.Tensor:
    return torch.randn(B, D, S, generator=torch.Generator().manual_seed(0)) * 2


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _measured(model: nn.Module) -> tuple[int, int | None]:
    x = _x()

    def step() -> None:
        _loss(model(x)).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up, as validate does
    peak, tracker, _ = measure_step(model, (x,), step, None, torch.device("cpu"))
    return peak, tracker


@pytest.mark.parametrize("written_out", [False, True])
def test_bias_add_peak_matches_the_allocator(written_out: bool) -> None:
    torch.manual_seed(0)
    stats = collect(lambda: TransposedLinear(written_out), _x(), device=CPU, loss_fn=_loss, optimizer=False)
    measured, tracker = _measured(TransposedLinear(written_out))
    assert tracker == measured  # sacplan's tracker on the real tensors, op for op as the allocator
    assert abs(measured - stats.peak_bytes) <= 0.01 * measured, (stats.peak_bytes, measured)
    # at the add: the parameters, x, the matmul's output and, written out, the sum beside it; in place the peak
    # is one step later, x and the output beside the loss (4 B)
    assert stats.peak_bytes == (D * D + D) * 4 + (3 * ACT if written_out else 2 * ACT + 4)
