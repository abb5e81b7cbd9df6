"""Selective regions under autocast whose forward found a weight's bf16 copy in autocast's cache
(sacplan/apply/autocast.py).

``b`` shares ``a``'s weight. Under CPU bf16 autocast ``a`` casts the weight (and its bias); ``b``'s forward takes
the weight's copy from the cache and casts only its own bias: one ``_to_copy`` (occurrence 0), which the plan
saves. The recomputation of ``b`` runs under a fresh autocast context: without priming it casts the weight first,
and torch's selective mode, which numbers the recomputation's ops per overload, hands that cast the saved bias
(a (64,) tensor where a (64, 64) one is expected: an error).
"""

from __future__ import annotations

import torch
from torch import nn

from sacplan.alternatives import plan_from_choices
from sacplan.apply import apply_plan
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.tree import ModuleTree

D = 64


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def build() -> nn.Module:
    torch.manual_seed(0)
    return Tied()


def step(model: nn.Module, args: tuple, opt: object) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*args).float().square().mean()
    loss.backward()


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    step(model, (x,), None)
    return [p.grad.clone() for p in model.parameters()]


def test_region_taking_a_cached_cast_recomputes_the_forwards_ops():
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1))
    stats = collect(build, (x,), device=CPU, optimizer=False, train_step=step)
    b_ops = [o.name for o in stats.module("b").ops]
    assert b_ops.count("aten._to_copy.default") == 1  # the bias: the weight's copy came from the cache
    plan = plan_from_choices(ModuleTree(stats), {"b": frozenset({("aten._to_copy.default", 0)})}, "b saves its cast")
    assert plan.decisions[0].saved_ops is not None  # selective: the recomputation runs under the policy's mode
    planned = apply_plan(build(), plan)
    assert all(torch.equal(g, h) for g, h in zip(grads(build(), x), grads(planned, x)))
