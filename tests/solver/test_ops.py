"""Op-level selection: constraints (views, in-place groups, random ops) and knapsack optimality."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sacplan.errors import ConfigError, InfeasibleBudgetError
from sacplan.solver import knapsack as knapsack_mod
from sacplan.solver import ops as ops_mod
from sacplan.solver import limits, select_ops
from sacplan.solver.ops import max_saved_bytes_for
from sacplan.stats import OpStat


def op(i, nbytes, ms, *, view=False, rand=False, inplace=None, flops=0, name=None):
    return OpStat(
        index=i,
        name=name or f"aten.op{i}.default",
        occurrence=0,
        out_bytes=0 if view else nbytes,
        runtime_ms=ms,
        flops=flops,
        is_view=view,
        is_random=rand,
        inplace_of=inplace,
        saved_by_autograd=not view,
        save_cost_bytes=0 if view else nbytes,
    )


def brute_force(ops, cap, stop, force_store_random=False):
    """Best recompute ms over all 0/1 save vectors meeting every rule (independent of the module)."""
    n = len(ops)
    pos = {o.index: p for p, o in enumerate(ops)}
    best = None
    for x in itertools.product((0, 1), repeat=n):
        ok = True
        for p, o in enumerate(ops):
            if o.is_view and x[p]:
                ok = False
            if o.inplace_of is not None:
                q = pos.get(o.inplace_of)
                if q is None or q == p:
                    if not x[p] and not any(ops[r].is_view for r in range(n) if r == p):
                        ok = False
                elif x[p] != x[q]:
                    ok = False
        rand = [p for p, o in enumerate(ops) if o.is_random]
        if force_store_random and any(not x[p] for p in rand):
            ok = False
        if not force_store_random and len({x[p] for p in rand}) > 1:
            ok = False
        if not ok or sum(o.save_cost_bytes for p, o in enumerate(ops) if x[p]) > cap:
            continue
        ms = sum(o.runtime_ms for p, o in enumerate(ops) if not x[p] and o.index < stop)
        best = ms if best is None else min(best, ms)
    return best


@pytest.fixture(autouse=True)
def _fresh_cache():
    ops_mod.clear_cache()
    yield
    ops_mod.clear_cache()


def test_views_are_never_saved():
    ops = [op(0, 100, 1.0), op(1, 0, 5.0, view=True), op(2, 100, 1.0)]
    sel = select_ops(ops, 1000)
    assert 1 not in sel.saved
    assert sel.saved == (0, 2) and sel.saved_bytes == 200
    assert sel.recompute_ms == pytest.approx(5.0)


def test_inplace_ops_follow_their_head():
    # op1 modifies op0's output in place: both saved or both recomputed
    ops = [op(0, 100, 1.0), op(1, 0, 3.0, inplace=0), op(2, 60, 1.0)]
    sel = select_ops(ops, 100)
    assert sel.saved == (0, 1)  # 4 ms saved for 100 bytes beats op2
    sel = select_ops(ops, 90)
    assert sel.saved == (2,)
    assert sel.recompute_ms == pytest.approx(4.0)


def test_inplace_head_without_producer_is_saved():
    ops = [op(0, 50, 1.0, inplace=7), op(1, 100, 2.0)]  # op 7 is not in this module
    sel = select_ops(ops, 60)
    assert 0 in sel.saved and 1 not in sel.saved
    with pytest.raises(InfeasibleBudgetError):
        select_ops(ops, 10)


def test_random_ops_all_or_nothing():
    ops = [op(0, 100, 1.0, rand=True), op(1, 10, 1.0), op(2, 100, 1.0, rand=True)]
    sel = select_ops(ops, 150)
    assert not ({0, 2} & set(sel.saved)) and sel.saved == (1,)
    sel = select_ops(ops, 200)
    assert {0, 2} <= set(sel.saved)
    sel = select_ops(ops, 200, force_store_random=True)
    assert {0, 2} <= set(sel.saved)
    with pytest.raises(InfeasibleBudgetError):
        select_ops(ops, 150, force_store_random=True)


def test_recompute_stop_and_flops():
    ops = [op(0, 100, 1.0, flops=10), op(1, 100, 2.0, flops=20), op(2, 100, 4.0, flops=40)]
    sel = select_ops(ops, 0, recompute_stop=2)
    assert sel.saved == () and sel.recompute_ms == pytest.approx(3.0) and sel.recompute_flops == 30
    # saving op 2 gains nothing: it is never recomputed
    sel = select_ops(ops, 100, recompute_stop=2)
    assert sel.saved == (1,) and sel.recompute_ms == pytest.approx(1.0)


def test_bad_budget():
    with pytest.raises(ConfigError):
        select_ops([op(0, 1, 1.0)], -1)


def test_max_saved_bytes_for():
    assert max_saved_bytes_for(0.25, 1000) == 750
    assert max_saved_bytes_for(1.0, 1000) == 0
    assert max_saved_bytes_for(-1, 1000) == 1000
    assert max_saved_bytes_for(1 / 3, 10) == 6


@pytest.mark.parametrize("seed", range(40))
def test_knapsack_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    ops = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.15:
            ops.append(op(i, 0, rng.uniform(0, 0.1), view=True))
        elif kind < 0.3 and i > 0:
            ops.append(op(i, 0 if rng.random() < 0.5 else rng.randint(1, 50), rng.uniform(0, 2), inplace=rng.randrange(i)))
        elif kind < 0.4:
            ops.append(op(i, rng.randint(1, 200), rng.uniform(0, 3), rand=True))
        else:
            ops.append(op(i, rng.randint(0, 200), rng.uniform(0, 3), flops=rng.randint(0, 100)))
    total = sum(o.save_cost_bytes for o in ops)
    cap = rng.randint(0, total + 10)
    stop = rng.choice([n, rng.randint(0, n)])
    force = rng.random() < 0.2
    best = brute_force(ops, cap, stop, force)
    solver = "cbc" if seed % 2 else "highs"
    if best is None:
        with pytest.raises(InfeasibleBudgetError):
            select_ops(ops, cap, recompute_stop=stop, force_store_random=force, solver=solver)
        return
    sel = select_ops(ops, cap, recompute_stop=stop, force_store_random=force, solver=solver)
    assert sel.saved_bytes <= cap
    assert sel.recompute_ms == pytest.approx(best, abs=1e-9)
    saved = set(sel.saved)
    assert not any(ops[i].is_view for i in saved)
    assert sel.recompute_flops == sum(o.flops for o in ops if o.index not in saved and o.index < stop)


def test_memoised():
    ops = tuple(op(i, 10 * (i + 1), 1.0 + (i % 3)) for i in range(10))
    a = select_ops(ops, 123)
    n = len(ops_mod._CACHE)
    b = select_ops(list(ops), 123)  # same ops, same budget: one entry
    assert a is b and len(ops_mod._CACHE) == n
    select_ops(ops, 124)
    assert len(ops_mod._CACHE) == n + 1


MiB = 2**20


def _stage():
    """A module with more free op groups than the DP takes (``DP_MAX_GROUPS``): 150 ops of 1 MiB / 3 ms saved
    first (3 ms per MiB), then 150 of 2 MiB / 2 ms. A = 450 MiB, R = 750 ms."""
    ops = [op(i, 1 * MiB, 3.0) for i in range(150)] + [op(150 + i, 2 * MiB, 2.0) for i in range(150)]
    assert len(ops) > ops_mod.DP_MAX_GROUPS
    return ops, 450 * MiB, 750.0


def _count_milps(monkeypatch):
    calls = []
    real = knapsack_mod.solve_model

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(knapsack_mod, "solve_model", counting)
    return calls


def test_sampled_options_at_exact_fills_need_no_milp(monkeypatch):
    ops, A, R = _stage()
    calls = _count_milps(monkeypatch)
    # cap 100 MiB: the 100 first small ops fill it exactly -> optimal without a solver (issue 14: each of a
    # 7B decoder stack's ~1000 sampled ratios used to cost a MILP)
    opts = ops_mod.module_options(ops, A, R, [350 / 450], max_options=None)
    assert calls == []
    assert opts.ratio == pytest.approx((350 / 450, 1.0)) and opts.frac == pytest.approx((450 / 750, 1.0))
    assert opts.slack_frac == 0.0 and not opts.complete


def test_sampled_options_past_the_deadline_keep_the_greedy_fill_with_its_slack(monkeypatch):
    ops, A, R = _stage()
    calls = _count_milps(monkeypatch)
    r = (450 - 151) / 450  # cap 151 MiB: 150 small ops (150 MiB) leave 1 MiB, too little for a 2 MiB op
    exact = ops_mod.module_options(ops, A, R, [r], max_options=None)
    assert len(calls) == 1 and exact.slack_frac == 0.0  # fractional fill: the exact knapsack
    # by hand: saving every small op (450 ms of 750) is optimal: 149 small + 1 big saves 449 ms
    assert exact.ratio == pytest.approx((300 / 450, 1.0)) and exact.frac == pytest.approx((300 / 750, 1.0))
    calls.clear()
    with limits.deadline(1e-9):  # spent: no MILP, the greedy fill, and what an LP could still save stated
        hurried = ops_mod.module_options(ops, A, R, [r], max_options=None)
    assert calls == []
    assert hurried.ratio == exact.ratio and hurried.frac == exact.frac
    # LP relaxation: the 1 MiB left holds half a big op, 1 ms: slack 1 ms of R = 750 ms
    assert hurried.slack_frac == pytest.approx(1 / 750)


def _list_front(free, cap):
    """The list-of-tuples DP that front.front_of_groups replaced (same merge, filter and thinning), as an oracle."""
    front = [(0, 0.0, 0)]
    complete = True
    for i, g in enumerate(free):
        bit = 1 << i
        merged = sorted(front + [(b + g.bytes, m + g.ms, k | bit) for b, m, k in front], key=lambda p: (p[0], -p[1]))
        front = []
        for p in merged:
            if not front or p[1] > front[-1][1] + 1e-12 * max(1.0, abs(front[-1][1])):
                front.append(p)
        if len(front) > cap:
            complete = False
            width = front[-1][0] / cap
            thin = {}
            for p in front:
                key = int(p[0] // width)
                if key not in thin or p[1] > thin[key][1]:
                    thin[key] = p
            front = sorted(thin.values())
    return front, complete


@pytest.mark.parametrize("step", [6e-13, 4e-13])
def test_array_front_near_ties_in_chains(step):
    """Groups saving ms that climb by steps under the 1e-12 tolerance (1, 1 + s, 1 + 2s, ...; more bytes each):
    a point dropped as a near-tie lifts the running maximum above the last one kept, so the vectorised filter's
    first guess drops points the plain scan keeps (1 + 2s at s = 6e-13); its answer is still the scan's (the
    list DP's), and the front keeps every point 1e-12 above the one kept before it."""
    from sacplan.solver.front import pareto_front

    ops = [OpStat(index=i, name="aten.mm.default", occurrence=i, out_bytes=10 + i, runtime_ms=1.0 + i * step, flops=0,
                  save_cost_bytes=10 + i) for i in range(8)]
    front, free, _, complete = pareto_front(ops, cap=20000)
    assert (front, complete) == _list_front(free, 20000)
    singles = [m for b, m, _ in front if 10 <= b < 20]  # one group saved: bytes 10-17
    kept = [1.0]  # by hand: each one more than 1e-12 above the last kept
    for k in range(1, 8):
        if 1.0 + k * step > kept[-1] + 1e-12 * kept[-1]:
            kept.append(1.0 + k * step)
    assert singles == kept and len(kept) == {6e-13: 4, 4e-13: 3}[step]  # 0, 2, 4, 6 steps / 0, 3, 6 steps


def test_array_front_near_ties_by_the_plain_scan(monkeypatch):
    """With no vectorised rounds left (SCAN_ROUNDS 0) the near-ties of the chain above fall to the plain scan: the
    same front as the list DP."""
    from sacplan.solver import front as front_mod

    monkeypatch.setattr(front_mod, "SCAN_ROUNDS", 0)
    ops = [OpStat(index=i, name="aten.mm.default", occurrence=i, out_bytes=10 + i, runtime_ms=1.0 + i * 6e-13, flops=0,
                  save_cost_bytes=10 + i) for i in range(8)]
    front, free, _, complete = front_mod.pareto_front(ops, cap=20000)
    assert (front, complete) == _list_front(free, 20000)
    assert [m for b, m, _ in front if 10 <= b < 20] == [1.0 + k * 6e-13 for k in (0, 2, 4, 6)]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([0.25, 0.5, 1.0, 1e-13, 3e-11, 0.1, 0.3, 0.7])), max_size=12),
    cap=st.sampled_from([3, 8, 20000]),
)
def test_array_front_equals_the_list_dp(groups, cap):
    """pareto_front's array DP: the same points, sums, masks and completeness as the plain list DP, ties (equal
    and 1e-13- or 3e-11-apart ms, each side of the 1e-12 tolerance) included."""
    from sacplan.solver.front import pareto_front

    ops = [OpStat(index=i, name="aten.mm.default", occurrence=i, out_bytes=b, runtime_ms=m, flops=0, save_cost_bytes=b)
           for i, (b, m) in enumerate(groups)]
    front, free, _, complete = pareto_front(ops, cap=cap)
    assert (front, complete) == _list_front(free, cap)
