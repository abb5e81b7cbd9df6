"""The plan says where the no-checkpointing peak sits, and what lowers it when checkpointing cannot."""

from __future__ import annotations

import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.plan import Plan
from sacplan.solver import solve
from sacplan.tree import ModuleTree


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def test_optimizer_bound_peak_is_named_with_remedies() -> None:
    # 2 x 512x512 weights with AdamW state, a batch of 2: the optimizer step holds the peak.
    stats = collect(lambda: _mlp(512), (torch.randn(2, 512),), device=CPU)
    assert stats.peak_phase == "other"
    plan = solve(ModuleTree(stats), stats.peak_bytes)
    text = plan.summary()
    assert "no-checkpointing peak: optimizer step" in text and "8-bit optimizer" in text and "FSDP" in text
    again = Plan.from_dict(plan.to_dict())
    assert again.peak_advice() == plan.peak_advice()


def test_activation_bound_peak_names_its_module_only() -> None:
    # tiny weights, a large batch: the peak is in the step's forward/backward, which checkpointing can lower.
    stats = collect(lambda: _mlp(16), (torch.randn(4096, 16),), device=CPU, optimizer=False)
    assert stats.peak_phase in ("fw", "bw")
    advice = solve(ModuleTree(stats), stats.peak_bytes).peak_advice()
    assert len(advice) == 1 and advice[0].startswith("no-checkpointing peak: ")
