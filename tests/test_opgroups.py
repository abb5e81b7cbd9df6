"""Op groups' one encoding of the recompute stop (sacplan.opgroups.stop_index): ``None`` is "no early stop" (every op
may be re-run), an int is the literal stop, ``0`` included (the forward packed nothing: nothing is ever re-run).

``0`` once meant both: the solver and the selective mode's dispatch read it as "no stop" (``stop or None``) while
the trade-off curve, the evaluator and the recompute surge read it as a stop before the first op."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sacplan.evaluate import module_outcome
from sacplan.opgroups import fill_order, op_groups, split_groups, stop_index
from sacplan.sacmode import dispatch_ms
from sacplan.solver import baseline_peak, solve
from sacplan.stats import ModuleStats
from sacplan.testing.synthetic import H100, MiB, Spec, build_tree, ops_from_rows
from sacplan.tradeoff import recompute_surge
from sacplan.units import Bytes

D = 0.05  # ms of selective-mode dispatch per op and pass

ROWS = [("aten.mm.default", 16 * MiB, 1.0, 10), ("aten.silu.default", 16 * MiB, 0.25, 2),
        ("aten.mul.Tensor", 16 * MiB, 0.5, 3)]


def _tree(**blk):
    ops = ops_from_rows(ROWS)
    spec = Spec("m", params=0, fw_ms=0.1)
    spec.children.append(Spec("blk", act=48 * MiB, fw_ms=1.75, ops=ops, **blk))
    spec.children.append(Spec("after", fw_ms=0.1, tmp=64 * MiB, no_tradeoff=True))  # the peak, blk's activations held
    return build_tree(spec, device=H100.replace(sac_dispatch_ms=D))


def test_stop_index_reads_none_as_no_stop_and_an_int_literally():
    ops = ops_from_rows(ROWS)
    assert stop_index(ops, None) == 3 and stop_index(ops, 0) == 0 and stop_index(ops, 2) == 2
    assert [g.ms for g in op_groups(ops, False, None)] == [1.0, 0.25, 0.5]
    assert [g.ms for g in op_groups(ops, False, 0)] == [0.0, 0.0, 0.0]  # nothing re-run: no group costs time
    assert [g.flops for g in op_groups(ops, False, 2)] == [10, 2, 0]
    always, free, never = split_groups(ops, False, 0)
    assert not always and not free and len(never) == 3  # no group saves time: never worth saving


def test_a_stop_at_zero_re_runs_nothing_everywhere_it_is_read():
    st = _tree().nodes[1].stats
    assert st.fqn == "blk" and st.recompute_stop == 3  # the synthetic tree's explicit stop: past the last op
    none, zero = dataclasses.replace(st, recompute_stop=None), dataclasses.replace(st, recompute_stop=0)
    device = H100.replace(sac_dispatch_ms=D)
    # the selective mode's dispatch: 3 forward ops, plus the ops a recomputation re-runs (all 3, or none)
    assert dispatch_ms(none, device) == pytest.approx(D * (3 + 3))
    assert dispatch_ms(zero, device) == pytest.approx(D * 3)  # read as "no stop" once: D * 6
    # the evaluator: a full checkpoint recomputes every op before the stop
    assert module_outcome(none, None).recompute_ms == pytest.approx(1.75)
    assert module_outcome(zero, None).recompute_ms == 0.0
    # nothing re-run: no surge above a full recomputation, whatever is saved
    assert recompute_surge(zero.ops, [0], 0) == 0


def test_a_plan_prices_a_stop_at_zero_as_nothing_re_run():
    """The solver realises a checkpoint of a module whose recomputation re-runs nothing: 0 ms (it was priced as
    every op re-run, while the module's trade-off and the evaluator priced it at 0)."""
    tree = _tree(recompute_stop=0)
    st = tree.nodes[1].stats
    assert st.recompute_stop == 0
    plan = solve(tree, Bytes(baseline_peak(tree) - 32 * MiB))  # blk's 48 MiB held at the peak: it must discard
    (d,) = [d for d in plan.decisions if d.fqn == "blk"]
    assert d.recompute_ms == 0.0 and plan.recompute_ms == 0.0


def test_the_stop_round_trips_through_json_none_and_zero_apart():
    st = _tree().nodes[1].stats
    for stop in (None, 0, 2):
        s = dataclasses.replace(st, recompute_stop=stop)
        back = ModuleStats.from_dict(json.loads(json.dumps(s.to_dict())))
        assert back.recompute_stop == stop
    d = st.to_dict()
    del d["recompute_stop"]  # stats that do not say: no early stop
    assert ModuleStats.from_dict(d).recompute_stop is None


def test_fill_order_is_most_ms_per_byte_first_ties_later_first():
    ops = ops_from_rows([("aten.mm.default", 200, 2.0, 0), ("aten.mm.default", 100, 1.0, 0),
                         ("aten.mm.default", 100, 1.0, 0), ("aten.silu.default", 100, 3.0, 0)])
    free = split_groups(ops, False, None)[1]
    assert fill_order(free) == [3, 2, 1, 0]  # 0.03 ms/B, then three at 0.01 ms/B: the later group first
