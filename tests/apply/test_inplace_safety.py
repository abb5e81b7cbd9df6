"""Every save list the solver can choose gives the unplanned step's gradients, bit for bit, on models that
overwrite tensors in place (issue 24.1; the rule: :mod:`sacplan.collector.mutations`, :mod:`sacplan.opgroups`).

For each module of each model, every combination of its free op groups (with the always-saved ones) is applied
alone as a selective checkpoint and one real CPU step's gradients are compared with the unplanned step's. Before
the rule, ``ConvBnAct`` with ``SiLU(inplace=True)`` / ``Hardswish(inplace=True)`` changed gradients by up to
3.6e-2 and the reader-before-overwrite models by more.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from sacplan.apply import apply_plan, remove_plan
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.opgroups import forced_saves, split_groups
from sacplan.plan import ModuleDecision, Plan
from sacplan.solver import baseline_peak, min_feasible_budget, solve
from sacplan.tree import ModuleTree
from sacplan.units import Bytes
from sacplan.validation import validate


class ConvBnAct(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class ReadThenOverwrite(nn.Module):
    """``h`` is read (``h * 2``, which saves nothing of ``h``) and then overwritten in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = h * 2.0
        h.add_(1.0)
        return torch.nn.functional.gelu(y) * h.tanh()


class ScaleGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x * 3.0)


class InputOverwrittenAfter(nn.Module):
    """``sub`` reads ``x`` (through a multiply that saves nothing of it); the parent then overwrites ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.sub = ScaleGelu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        y = self.sub(x)
        x.mul_(0.5)
        return y * x.sigmoid()


class ResidualInplace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        h += x
        return h


@dataclass(frozen=True)
class Case:
    build: object
    shape: tuple[int, ...]


CASES = {
    "convbn-silu_": Case(lambda: nn.Sequential(ConvBnAct(nn.SiLU(inplace=True)), ConvBnAct(nn.SiLU(inplace=True))), (4, 4, 6, 6)),
    "convbn-hardswish_": Case(lambda: nn.Sequential(ConvBnAct(nn.Hardswish(inplace=True)), ConvBnAct(nn.ReLU(inplace=True))), (4, 4, 6, 6)),
    "read-then-overwrite": Case(lambda: nn.Sequential(ReadThenOverwrite(), ReadThenOverwrite(), nn.Linear(16, 16)), (8, 16)),
    "input-overwritten-after": Case(lambda: nn.Sequential(InputOverwrittenAfter(), InputOverwrittenAfter(), nn.Linear(16, 16)), (8, 16)),
    "residual-inplace": Case(lambda: nn.Sequential(nn.Linear(16, 16), ResidualInplace(), ResidualInplace()), (8, 16)),
}


def _grads(case: Case, decision: ModuleDecision | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = case.build()
    if decision is not None:
        apply_plan(model, _one_plan(decision), check_fingerprint=False)
    torch.manual_seed(1)
    x = torch.randn(case.shape)
    model(x).pow(2).mean().backward()
    if decision is not None:
        remove_plan(model)
    return [p.grad.clone() for p in model.parameters()]


def _one_plan(decision: ModuleDecision) -> Plan:
    return Plan(
        decisions=(decision,), budget_bytes=0, predicted_peak_bytes=0, baseline_peak_bytes=0, recompute_ms=0.0,
        baseline_step_ms=0.0, status="optimal", objective_ms=0.0, bound_ms=0.0, gap=0.0, solver="", build_s=0.0,
        solve_s=0.0, world_size=1, device_name="cpu", model_name="", fingerprint="",
    )


def _save_lists(ops, stop):
    """Every save list made of whole op groups (the always-saved ones plus any subset of the free ones), and
    the full checkpoint as the solver writes it (``None`` unless some op must be named)."""
    full = forced_saves(ops, stop)
    yield None if full is None else [ops.index(next(o for o in ops if o.index == k[0])) for k in full]
    always, free, _ = split_groups(ops, False, stop)
    base = [p for g in always for p in g.members]
    for k in range(len(free) + 1):
        for chosen in itertools.combinations(free, k):
            yield sorted(base + [p for g in chosen for p in g.members])


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_group_save_list_keeps_gradients(name: str) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    tree = ModuleTree(collect(case.build, torch.randn(case.shape), device=CPU, optimizer=False))
    reference = _grads(case, None)
    tried = 0
    for node in tree.nodes:
        ops = node.stats.ops
        if node.parent is None or not ops or node.stats.tradeoff is None:
            continue  # not a unit the solver may choose (tested below for in-place activations alone)
        for saved in itertools.islice(_save_lists(ops, node.stats.recompute_stop), 64):
            keys = None if saved is None else tuple((ops[p].index, ops[p].name, ops[p].occurrence) for p in saved)
            grads = _grads(case, ModuleDecision(fqn=node.fqn, saved_ops=keys))
            tried += 1
            bad = [i for i, (a, b) in enumerate(zip(reference, grads)) if not torch.equal(a, b)]
            what = "full checkpoint" if saved is None else f"saving {[ops[p].name for p in saved]}"
            assert not bad, f"{node.fqn!r} {what}: gradients {bad} differ"
    assert tried > 0


def test_inplace_activation_alone_cannot_be_a_unit() -> None:
    """``SiLU(inplace=True)`` as its own region overwrites the region's input: nothing can be discarded."""
    case = CASES["convbn-silu_"]
    tree = ModuleTree(collect(case.build, torch.randn(case.shape), device=CPU, optimizer=False))
    assert tree.node("0.act").stats.tradeoff is None
    assert tree.node("0").stats.tradeoff is not None


def test_reader_of_overwritten_storage_is_tied() -> None:
    """The hand-derived ties: the clone autograd takes for ``silu_`` reads the norm's output before it is
    overwritten, so it shares the norm's decision; ``h * 2`` shares ``addmm``'s."""
    case = CASES["convbn-silu_"]
    ops = ModuleTree(collect(case.build, torch.randn(case.shape), device=CPU, optimizer=False)).node("0").stats.ops
    names = [o.name for o in ops]
    clone, silu = names.index("aten.clone.default"), names.index("aten.silu_.default")
    assert ops[clone].tied_to == (silu,)
    assert ops[silu].inplace_of == names.index("aten.native_batch_norm.default")
    case = CASES["read-then-overwrite"]
    ops = ModuleTree(collect(case.build, torch.randn(case.shape), device=CPU, optimizer=False)).node("0").stats.ops
    names = [o.name for o in ops]
    mul, add_ = names.index("aten.mul.Tensor"), names.index("aten.add_.Tensor")
    assert ops[mul].tied_to == (add_,)


def test_full_checkpoint_names_the_readers_of_an_overwritten_input() -> None:
    """``sub`` reads its input through ``x * 3``; the parent overwrites ``x`` afterwards. A plain checkpoint
    would recompute the multiply from the overwritten ``x``: the full checkpoint must save it."""
    case = CASES["input-overwritten-after"]
    sub = ModuleTree(collect(case.build, torch.randn(case.shape), device=CPU, optimizer=False)).node("0.sub").stats
    mul = next(o for o in sub.ops if o.name == "aten.mul.Tensor")
    assert mul.tied_to == (-1,)
    assert forced_saves(sub.ops, sub.recompute_stop) == ((mul.index, mul.name, mul.occurrence),)


@pytest.mark.parametrize("name", ["convbn-silu_", "read-then-overwrite", "input-overwritten-after"])
def test_solved_plans_validate(name: str) -> None:
    """collect → solve (a tight and a midway budget) → validate on a real CPU step: bitwise, peak within 1%."""
    case = CASES[name]
    inputs = torch.randn((case.shape[0] * 64,) + case.shape[1:])  # activations dominate the peak
    tree = ModuleTree(collect(case.build, inputs, device=CPU, optimizer=False))
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    for frac in (0.0, 0.5):
        plan = solve(tree, Bytes(int(lo + frac * (hi - lo))), time_limit_s=30)
        assert plan.decisions, "the budget must need a plan"
        rep = validate(case.build, inputs, plan, device="cpu", optimizer=False, timed_steps=0)
        assert rep.grads_bitwise_equal, (frac, plan.decisions)
        assert abs(rep.peak_error) <= 0.01, (frac, rep.summary())
        assert rep.measured_recompute_flops == rep.predicted_recompute_flops
