"""The selective mode's dispatch in the objective (sacplan.sacmode): a save list must beat a plain full checkpoint by
more than the host time its region's selective mode costs, and the plan reports that time apart."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from sacplan.devices import CPU, SAC_DISPATCH_CPU_MS, SAC_DISPATCH_GPU_MS, DeviceSpec, get_device
from sacplan.errors import ConfigError
from sacplan.plan import ModuleDecision
from sacplan.sacmode import dispatch_ms, full_runs_selective
from sacplan import baseline_peak
from sacplan.solver import min_feasible_budget, solve
from sacplan.solver.ops import module_options
from sacplan.testing.synthetic import H100, MiB, Spec, build_tree, ops_from_rows
from tests.solver.oracles import brute_over_options, oracle, pareto_points, random_option_spec, subsets

D = 0.05  # ms per op and pass, large against the synthetic ops (0.05-3 ms) so that it changes plans


def _module(rows, **kw):
    ops = ops_from_rows(rows)
    spec = Spec("m", params=0, fw_ms=0.1)
    blk = Spec("blk", act=sum(o.save_cost_bytes for o in ops), fw_ms=sum(o.runtime_ms for o in ops), ops=ops, **kw)
    spec.children.append(blk)
    spec.children.append(Spec("after", fw_ms=0.1, tmp=16 * MiB, no_tradeoff=True))  # the peak, blk's activations held
    return spec


def test_dispatch_ms_counts_forward_and_recomputed_ops():
    tree = build_tree(_module([("aten.mm.default", 16 * MiB, 1.0, 0), ("aten.silu.default", 16 * MiB, 0.1, 0),
                               ("aten.mul.Tensor", 16 * MiB, 0.1, 0)]), device=H100.replace(sac_dispatch_ms=D))
    st = tree.nodes[1].stats
    assert dispatch_ms(st, tree.stats.device) == pytest.approx(D * (3 + 3))  # no early stop: all 3 recomputed
    stopped = dataclasses.replace(st, recompute_stop=2)
    assert dispatch_ms(stopped, tree.stats.device) == pytest.approx(D * (3 + 2))
    assert dispatch_ms(st, H100) == 0.0
    assert not full_runs_selective(st)
    assert full_runs_selective(dataclasses.replace(st, buffer_bytes=8))  # BatchNorm statistics: the policy stays


def test_a_save_list_that_saves_less_than_its_dispatch_is_dominated():
    ops = ops_from_rows([("aten.mm.default", 16 * MiB, 1.0, 0), ("aten.silu.default", 16 * MiB, 0.2, 0)])
    A, R = 32 * MiB, 1.2
    free = module_options(ops, A, R, max_options=None)
    assert free.ratio == (0.0, 0.5, 1.0)  # save both (discards nothing), save mm (silu recomputed), full
    # a dispatch of 0.5 ms per call: saving mm still spares 1.0 - 0.5 ms against the plain full checkpoint
    o = module_options(ops, A, R, max_options=None, selective_frac=0.5 / R)
    assert o.ratio == (0.0, 0.5, 1.0) and o.selection[-1] is None and o.frac[-1] == pytest.approx(1.0)
    assert o.frac[1] * R == pytest.approx(0.2 + 0.5)  # silu recomputed + the dispatch
    # 1.1 ms: saving mm (0.2 + 1.1 ms) costs more than recomputing everything plainly (1.2 ms): dominated
    o = module_options(ops, A, R, max_options=None, selective_frac=1.1 / R)
    assert o.ratio == (0.0, 1.0) and o.frac[0] * R == pytest.approx(1.1)
    # a full checkpoint that runs selective too pays it as well
    f = module_options(ops, A, R, max_options=None, selective_frac=0.5 / R, full_selective=True)
    assert f.frac[-1] * R == pytest.approx(1.2 + 0.5)


def test_the_plan_reports_the_dispatch_apart_and_it_sums_to_the_objective():
    """One block (mm 16 MiB 1.0 ms, silu 16 MiB 0.2 ms) at a budget that needs half its bytes discarded: saving mm
    costs silu's 0.2 ms plus the dispatch of 2 ops × 2 passes × 0.05 ms = 0.2 ms, below the full 1.2 ms."""
    tree = build_tree(_module([("aten.mm.default", 16 * MiB, 1.0, 0), ("aten.silu.default", 16 * MiB, 0.2, 0)]),
                      device=H100.replace(sac_dispatch_ms=D))
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    assert hi - lo == 16 * MiB  # the peak is at ``after`` (blk's 32 MiB + 16 MiB); blk's own forward holds 32 MiB
    plan = solve(tree, f"{lo}B", gap_rel=1e-9)
    (d,) = plan.decisions
    assert d.saved_ops == ((0, "aten.mm.default", 0),)
    assert d.recompute_ms == pytest.approx(0.2) and d.dispatch_ms == pytest.approx(0.2)
    assert plan.extra_ms == pytest.approx(0.4) and plan.objective_ms == pytest.approx(0.4, rel=1e-9)
    assert "0.2 ms selective mode" in plan.summary()
    # with a dispatch of 0.3 ms per op and pass (1.2 ms per call) the plain full checkpoint is cheaper
    costly = build_tree(_module([("aten.mm.default", 16 * MiB, 1.0, 0), ("aten.silu.default", 16 * MiB, 0.2, 0)]),
                        device=H100.replace(sac_dispatch_ms=0.3))
    (f,) = solve(costly, f"{lo}B", gap_rel=1e-9).decisions
    assert f.full_checkpoint and f.dispatch_ms == 0.0 and f.recompute_ms == pytest.approx(1.2)


def test_solve_equals_brute_force_with_dispatch():
    """Random trees with op lists (tests/solver/oracles.py), every save list priced with the dispatch of its
    module's ops (forward + recomputation, no early stop), full checkpoints without: on each, the proven plan at
    the midway budget costs what the brute force over every antichain and every save list finds."""
    device = H100.replace(sac_dispatch_ms=D)
    checked = 0
    for seed in range(40):
        tree = build_tree(random_option_spec(random.Random(seed)), device=device)
        cands, base, C, X = oracle(tree, None)
        baseline = float(np.max(base))
        if not cands:
            continue
        _, min_peak = brute_over_options(tree, cands, base, C, X, math.inf, [[(1.0, 1.0)] for _ in cands])
        if min_peak >= baseline - 2:
            continue  # nothing to plan
        fronts = [pareto_points(subsets(n.stats.ops, n.stats.tradeoff.max_discard_bytes,
                                        n.stats.tradeoff.full_recompute_ms, dispatch_ms=D * 2 * len(n.stats.ops)))
                  for n in cands]
        budget = int(baseline - 1 - 0.5 * (baseline - 1 - min_peak))
        plan = solve(tree, f"{budget}B", gap_rel=1e-9, max_options=None)
        assert plan.status == "optimal"
        best, _ = brute_over_options(tree, cands, base, C, X, budget, fronts)
        assert plan.objective_ms == pytest.approx(best, rel=1e-7, abs=1e-9)
        assert plan.extra_ms == pytest.approx(plan.objective_ms, rel=1e-9, abs=1e-9)
        for dec in plan.decisions:
            n = next(c for c in cands if c.fqn == dec.fqn)
            want = 0.0 if dec.full_checkpoint else dec.calls * D * 2 * len(n.stats.ops)
            assert dec.dispatch_ms == pytest.approx(want)
        checked += 1
    assert checked >= 20


def test_device_defaults_and_bad_values():
    assert get_device("H100").sac_dispatch_ms == SAC_DISPATCH_GPU_MS
    assert CPU.sac_dispatch_ms == SAC_DISPATCH_CPU_MS
    d = get_device("a100-80gb").to_dict()
    d.pop("sac_dispatch_ms")  # a spec saved before the field reads the default
    assert DeviceSpec.from_dict(d).sac_dispatch_ms == SAC_DISPATCH_GPU_MS
    with pytest.raises(ConfigError, match="sac_dispatch_ms"):
        H100.replace(sac_dispatch_ms=-1.0)
    with pytest.raises(ConfigError, match="sac_dispatch_ms"):
        H100.replace(sac_dispatch_ms=float("nan"))


def test_decision_field_round_trips_and_old_plans_read_zero():
    d = ModuleDecision(fqn="a", discard_ratio=0.5, discard_bytes=4, recompute_ms=1.0, saved_ops=((0, "aten.mm.default", 0),),
                       dispatch_ms=0.25)
    assert ModuleDecision.from_dict(d.to_dict()) == d
    old = d.to_dict()
    old.pop("dispatch_ms")
    assert ModuleDecision.from_dict(old).dispatch_ms == 0.0
