"""Shared models and collected stats for the collection tests (collected once per session)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU

#: The hand-checked MLP: Linear(64, 128) -> ReLU -> Linear(128, 32) on a (16, 64) fp32 batch.
BATCH, D_IN, D_HID, D_OUT = 16, 64, 128, 32


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))


def mlp_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, D_IN),)


@pytest.fixture(scope="session")
def mlp_dims() -> tuple[int, int, int, int]:
    return BATCH, D_IN, D_HID, D_OUT


@pytest.fixture(scope="session")
def mlp_cpu():
    """MLP + AdamW (foreach), exact host sizes."""
    return collect(make_mlp(), mlp_inputs(), device=CPU)


@pytest.fixture(scope="session")
def mlp_h100():
    """MLP + AdamW (foreach), H100 allocator (512-byte blocks)."""
    return collect(make_mlp(), mlp_inputs(), device="h100")


@pytest.fixture(scope="session")
def mlp_cpu_no_opt():
    """MLP without an optimizer step, exact host sizes."""
    return collect(make_mlp(), mlp_inputs(), device=CPU, optimizer=False)


@pytest.fixture(scope="session")
def mlp_h100_no_opt():
    return collect(make_mlp(), mlp_inputs(), device="h100", optimizer=False)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Nested(nn.Module):
    """pre -> blk(a, b) -> shared -> shared (same Linear twice) -> ReLU(inplace) -> Dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.blk = Inner()
        self.shared = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        h = self.blk(h)
        h = self.shared(h)
        h = self.shared(h)
        h = self.act(h)
        return self.drop(h)


@pytest.fixture(scope="session")
def nested_model_cls():
    return Nested


@pytest.fixture(scope="session")
def nested_cpu():
    return collect(Nested(), (torch.randn(4, 8),), device=CPU)
