"""sacplan.fit_to_budget (collect + solve + apply in one call) and sacplan.show_plan (print(model), marked)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sacplan
from sacplan.devices import CPU
from sacplan.errors import ConfigError, InfeasibleBudgetError


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Tiny(nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def baseline():
    torch.manual_seed(0)
    model = Tiny()
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    loss = lambda out, inputs: torch.nn.functional.mse_loss(out, y)  # noqa: E731
    free = sacplan.fit_to_budget(copy.deepcopy(model), (x,), budget="100%", device=CPU, loss_fn=loss)
    return model, x, y, loss, free


def test_fits_the_budget_applies_and_keeps_gradients(baseline):
    model, x, y, loss, free = baseline
    assert free.decisions == ()  # the whole CPU: no checkpointing needed
    budget = (free.baseline_peak_bytes + free.min_feasible_bytes) // 2 if free.min_feasible_bytes else None
    budget = budget or int(free.baseline_peak_bytes * 0.9)
    planned = copy.deepcopy(model)
    plan = sacplan.fit_to_budget(planned, (x,), budget=budget, device=CPU, loss_fn=loss)
    assert plan.decisions, "a budget below the no-checkpointing peak needs checkpointing"
    assert plan.predicted_peak_bytes <= budget == plan.budget_bytes
    assert sacplan.apply.applied_plan(planned) is plan
    assert all(torch.equal(a, b) for a, b in zip(_grads(planned, x, y), _grads(copy.deepcopy(model), x, y)))
    text = sacplan.show_plan(planned)
    marked = [line for line in text.splitlines() if "# <- " in line]
    assert marked and all("checkpoint" in line for line in marked)
    assert f"{len(plan.decisions)} module" in text.splitlines()[-1]
    assert text.splitlines()[0] == "Tiny("


def test_infeasible_budget_names_the_minimum(baseline):
    model, x, _, loss, _ = baseline
    m = copy.deepcopy(model)
    with pytest.raises(InfeasibleBudgetError) as e:
        sacplan.fit_to_budget(m, (x,), budget=2**20, device=CPU, loss_fn=loss)
    assert e.value.min_feasible_bytes > 2**20
    assert sacplan.apply.applied_plan(m) is None


def test_show_plan_marks_named_modules_and_collapses_repeats():
    model = Tiny(d=8, n=3)
    plan = sacplan.Plan(
        decisions=tuple(
            sacplan.ModuleDecision(fqn=f"blocks.{i}", discard_ratio=1.0, discard_bytes=3 * 2**20, recompute_ms=0.5, calls=1)
            for i in range(3)
        ),
        budget_bytes=2**30, predicted_peak_bytes=2**29, baseline_peak_bytes=2**30, recompute_ms=1.5,
        baseline_step_ms=10.0, status="optimal", objective_ms=1.5, bound_ms=1.5, gap=0.0, solver="highs",
        build_s=0.0, solve_s=0.0, world_size=1, device_name="H100", model_name="tiny", fingerprint="",
    )
    lines = sacplan.show_plan(model, plan).splitlines()
    assert "    (0-2): 3 x Block(  # <- checkpoint: frees 3.0 MiB, recompute 0.5 ms" in lines
    assert "      (up): Linear(in_features=8, out_features=32, bias=True)" in lines
    assert lines[-1].startswith("# 3 modules checkpointed: predicted peak 512.0 MiB of 1.00 GiB budget")
    with pytest.raises(ConfigError, match="no plan is applied"):
        sacplan.show_plan(model)


def test_refuses_a_non_module():
    with pytest.raises(ConfigError, match="nn.Module"):
        sacplan.fit_to_budget("llama-tiny", None, device="h100")  # type: ignore[arg-type]
