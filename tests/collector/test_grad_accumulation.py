"""Autograd's gradient accumulation: in place on the real step, out of place under any dispatch mode.

A tensor read by many ops (a state-space scan reads one slice of ``dA`` per time step) gets one gradient per
read; the engine sums them into one buffer. With no dispatch mode active it adds in place when it holds the
last reference to the buffer (``can_accumulate_inplace``): two tensors live, not three. Under the recorder
(a dispatch mode, fake tensors) it adds out of place, so before the fix the fake step predicted one buffer
more than the real step held: transformers' Mamba at its pure-PyTorch scan path was 8-12% over. Expected peaks
here are derived by hand in bytes and checked against the CPU allocator (``torch.profiler`` events).
"""

from __future__ import annotations

import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.measurement import measure_step

B, D, L, N = 2, 32, 16, 64  # dA: B*D*L*N fp32 = 256 KiB; one slice B*D*N = 16 KiB
BIG = B * D * L * N * 4


class Scan(nn.Module):
    """A linear recurrence over ``L`` steps reading one slice of a ``(B, D, L, N)`` tensor per step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        da = x * self.w  # (B, D, L, N); its backward: grad * x, then a sum over (B, D, L)
        state = torch.zeros(B, D, N)
        outs = []
        for i in range(L):
            state = da[:, :, i] * state + 1.0
            outs.append(state.sum(-1))
        return torch.stack(outs, -1)


def _dt() -> torch.Tensor:
    return torch.rand(B, D, L, N, generator=torch.Generator().manual_seed(0))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _measured(model: nn.Module, dt: torch.Tensor | None = None) -> int:
    dt = _dt() if dt is None else dt

    def step() -> None:
        _loss(model(dt)).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up (the measured step is the second, as validate does)
    peak, _, _ = measure_step(model, (dt,), step, None, torch.device("cpu"), track=False)
    return peak


def test_in_place_accumulation_is_not_counted_as_a_third_buffer() -> None:
    torch.manual_seed(0)
    stats = collect(Scan, _dt(), device=CPU, loss_fn=_loss, optimizer=False)
    measured = _measured(Scan())
    assert abs(measured - stats.peak_bytes) <= 0.01 * measured, (stats.peak_bytes, measured)
    # The input x and dA (saved by every step's mul) are live throughout the scan's backward; each
    # select_backward allocates a zero-filled dA-sized gradient summed in place into the buffer; then the mul's
    # backward makes grad * x beside them: 5 x 256 KiB plus the small per-step tensors (6 out of place).
    assert 5 * BIG <= stats.peak_bytes < 5 * BIG + BIG // 4


class Twice(nn.Module):
    """``(z + z) * x`` with ``z`` a broadcast parameter: AddBackward hands the same gradient tensor to both of its
    inputs, so the engine holds it twice and sums out of place (``g + g`` beside ``g``) on the real step too.
    The product is taken in place, so the forward holds one ``(B, D, L, N)`` tensor and the backward two."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.w.expand(B, D, L, N)
        return (z + z).mul_(x)


def test_out_of_place_when_the_engine_holds_the_old_gradient_twice() -> None:
    torch.manual_seed(0)
    x = torch.rand(N, generator=torch.Generator().manual_seed(0))
    stats = collect(Twice, x, device=CPU, loss_fn=_loss, optimizer=False)
    measured = _measured(Twice(), x)
    assert abs(measured - stats.peak_bytes) <= 0.01 * measured, (stats.peak_bytes, measured)
    # the mul's gradient g and the out-of-place g + g: two (B, D, L, N) tensors at once, besides a few floats
    # (counted as one, the in-place rule's mistake without its same-storage check, it was half the measure)
    assert 2 * BIG <= stats.peak_bytes < 2 * BIG + 4096


class Tied(nn.Module):
    """One weight used by two ``Linear`` calls: each ``AddmmBackward`` returns its weight gradient as
    ``mm(...).t()``, a view, whose storage its base shares (use count 2): the engine sums the two out of place
    (``old + new`` beside both), as the fuzzer's tied feature model showed (+32 KiB over before the fix)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 128)
        self.b = nn.Linear(128, 128)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_view_gradient_accumulates_out_of_place() -> None:
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    stats = collect(Tied, (x,), device=CPU, loss_fn=_loss, optimizer=False)
    model = Tied()

    def step() -> None:
        _loss(model(x)).backward()
        model.zero_grad(set_to_none=True)

    step()
    measured, _, _ = measure_step(model, (x,), step, None, torch.device("cpu"), track=False)
    assert stats.peak_bytes == measured, (stats.peak_bytes, measured)
