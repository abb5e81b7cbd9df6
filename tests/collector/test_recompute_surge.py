"""A selective recomputation holds the tensors it saved from its start: it can peak above the forward.

``Linear(64, 64) -> ReLU -> Surge -> Linear(64, 64)`` on a (256, 64) fp32 batch, where ``Surge`` computes a scale
``s = relu(a(x)).mean(-1)`` without gradient (``a: 64 -> 1024``) and returns ``c(x * s)``. By hand (fp32, batch
256): ``a``'s and ``relu``'s outputs are 256·1024·4 = 1,048,576 B each (W), the product and the output
256·64·4 = 65,536 B each (N), the scale 1,024 B. The forward peaks at ``relu`` (2W above the call's start); the
call keeps the scale (saved by the product) and the product (saved by ``c``). A full recomputation re-runs
``a .. mul`` and peaks 2W - (N + 1,024) = 2,030,592 B above the restored saved tensors. Saving the product under
SAC holds it (N) through the whole recomputation, from before the peak it was made after: N more, at the rc
event, which is then the step's peak (the backward itself touches only narrow tensors). Surge's input is the
ReLU's output, which the ReLU saves: checkpointing Surge holds no extra input.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sacplan.alternatives import plan_from_choices
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.evaluate import event_peaks, module_outcome, predict
from sacplan.opnames import op_keys
from sacplan.solver.formulation import build_budget_model, columns_for
from sacplan.solver.problem import SacProblem
from sacplan.stats import OpStat
from sacplan.tradeoff import recompute_surge
from sacplan.tree import ModuleTree
from sacplan.validation import validate

BATCH = 256
WIDE, NARROW, SCALE = BATCH * 1024 * 4, BATCH * 64 * 4, BATCH * 4
SAVE_PRODUCT = frozenset({("aten.mul.Tensor", 0)})


class Surge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(64, 1024), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = torch.relu(self.a(x)).mean(-1, keepdim=True)
        return self.c(x * s)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), Surge(), nn.Linear(64, 64))


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(0)),)


@pytest.fixture(scope="module")
def tree() -> ModuleTree:
    return ModuleTree(collect(_model, _inputs(), device=CPU, optimizer=False))


def test_recompute_transient_and_surge_by_hand(tree: ModuleTree) -> None:
    ms = tree.node("2").stats
    (rc,) = [e for e in tree.stats.events if e.module == "2" and e.phase == "rc"]
    assert rc.extra_bytes == 2 * WIDE - (NARROW + SCALE)  # 2,030,592
    assert module_outcome(ms, None).surge_bytes == 0  # a full recomputation peaks where the forward did
    out = module_outcome(ms, SAVE_PRODUCT)
    assert out.discard_bytes == (SCALE,)
    assert out.surge_bytes == NARROW


def test_surge_formula_on_hand_made_ops() -> None:
    def op(i: int, cost: int, below: int | None) -> OpStat:
        return OpStat(index=i, name=f"aten.op{i}.default", occurrence=0, out_bytes=cost, runtime_ms=1.0, flops=0,
                      save_cost_bytes=cost, below_peak_bytes=below)

    ops = [op(0, 10, 50), op(1, 40, 0), op(2, 30, 20), op(3, 5, 40)]
    assert recompute_surge(ops, [], 4) == 0
    assert recompute_surge(ops, [2], 4) == 30  # held from the start, through the peak at op 1
    assert recompute_surge(ops, [0], 4) == 0  # made before the peak: the forward held it there too
    assert recompute_surge(ops, [2, 3], 4) == 35
    assert recompute_surge(ops, [3], 2) == 5  # past the early stop, but still held from the start
    assert recompute_surge(ops[:1] + [op(1, 40, None)], [1], 2) == 0  # no live figures: none claimed


def test_selective_plan_with_a_surge_is_predicted_exactly(tree: ModuleTree) -> None:
    plan = plan_from_choices(tree, {"2": SAVE_PRODUCT}, "save the product")
    pred = predict(tree, {"2": SAVE_PRODUCT})
    without = max(event_peaks(tree, {"2": pred.modules[0].discard_bytes}))
    assert pred.peak_bytes == without + NARROW  # the surge sits at the peak of this plan
    assert tree.stats.events[pred.peak_event].phase == "rc"
    torch.manual_seed(0)
    r = validate(_model, _inputs, plan, optimizer=False, device="cpu")
    assert abs(r.peak_error) < 0.002, r.summary()  # without the surge: 65,536 B (~2.4%) short


def test_solver_rows_and_peaks_count_the_surge(tree: ModuleTree) -> None:
    """For every option of Surge: the solver's exact peaks equal the evaluator's, and the budget MILP's rows
    (level columns set for that option) hold at a budget of exactly that peak and fail 2 bytes below it."""
    P = SacProblem(tree, exact=True, ac_units=["2"])
    (s,) = [c.slot for c in P.candidates if c.fqn == "2"]
    o, ms = P.options(s), tree.node("2").stats
    assert o is not None and max(P.surge(s)) == NARROW + SCALE  # saving scale and product: both made after the peak
    for k in range(len(o.ratio)):
        sel = o.selection[k]
        keys = None if sel is None else frozenset(op_keys(ms.ops)[i] for i in sel.saved)
        y, r = np.ones(1), np.array([o.ratio[k]])
        out = module_outcome(ms, keys)
        expect = event_peaks(tree, {"2": out.discard_bytes}, surges={"2": out.surge_bytes})
        assert P.peaks(y, r).tolist() == pytest.approx(expect, abs=1e-6), k
        for slack, holds in ((0.0, True), (-2.0, False)):
            model, idx, _ = build_budget_model(P, max(expect) + slack)
            worst = _worst(model, columns_for(P, model, idx, y, r))
            assert (worst < 1e-12) if holds else (worst > 1.0 / 2**30), (k, slack, worst)


def _worst(model, x) -> float:
    """The largest violation (GiB) of a memory row or column bound of ``model`` at columns ``x`` (<= 0: all hold).
    The ``rmin`` rows (a checkpointed call frees at least what it keeps) are left out: they forbid options, they
    do not measure memory."""
    worst = max(max(lb - v, v - ub) for v, lb, ub in zip(x, model.col_lb, model.col_ub))
    for i in range(model.num_rows):
        if model.row_names[i].startswith("rmin"):
            continue
        a, b = model.row_start[i], model.row_start[i + 1]
        act = sum(v * x[j] for j, v in zip(model.row_index[a:b], model.row_value[a:b]))
        worst = max(worst, model.row_lb[i] - act, act - model.row_ub[i])
    return worst
