"""Trade-off curves: greedy vertices, convexity, max-of-lines upper bounds, simplification to few lines, op groups."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sacplan.opgroups import op_groups, split_groups
from sacplan.stats import OpStat, TradeOff
from sacplan.tradeoff import (
    DEFAULT_MAX_LINES,
    build_tradeoff,
    greedy_vertices,
    staircase,
    staircase_corners,
)

TOL = 1e-9


def op(i: int, nbytes: int, ms: float, **kw) -> OpStat:
    return OpStat(index=i, name=kw.pop("name", "aten.mm.default"), occurrence=i, out_bytes=nbytes, runtime_ms=ms,
                  flops=kw.pop("flops", 0), save_cost_bytes=nbytes, **kw)


def lines_at(t: TradeOff, r: float) -> float:
    return max(s * r + b for s, b in zip(t.slopes, t.intercepts))


def check_curve(t: TradeOff, max_lines: int = DEFAULT_MAX_LINES) -> None:
    """The properties every trade-off curve must have."""
    pts = t.points
    assert pts[0][0] == 0.0
    assert pts[-1][0] == pytest.approx(1.0) and pts[-1][1] == pytest.approx(1.0)
    rs = [p[0] for p in pts]
    qs = [p[1] for p in pts]
    assert rs == sorted(rs) and all(0.0 <= r <= 1.0 + TOL for r in rs)
    assert qs == sorted(qs) and all(0.0 <= q <= 1.0 + TOL for q in qs)
    # convex: slopes of the greedy segments never decrease
    slopes = [(q1 - q0) / (r1 - r0) for (r0, q0), (r1, q1) in zip(pts, pts[1:]) if r1 - r0 > 1e-12]
    assert all(b >= a - 1e-7 * max(1.0, abs(a)) for a, b in zip(slopes, slopes[1:])), slopes
    # the lines bound the achievable staircase at every corner (and so everywhere), and the last vertex
    assert len(t.slopes) == len(t.intercepts) <= max_lines
    for r, q in staircase_corners(pts) + [pts[-1]]:
        assert lines_at(t, r) >= q - TOL, (r, q)
    # at r = 1 (full checkpointing) the bound is at least the true cost
    assert lines_at(t, 1.0) >= 1.0 - TOL
    assert t.recompute_fraction(1.0) == pytest.approx(lines_at(t, 1.0))
    assert t.recompute_ms(t.max_discard_bytes) == pytest.approx(t.full_recompute_ms * lines_at(t, 1.0))


# ----------------------------------------------------------------------------------- by hand
def test_three_ops_by_hand():
    """A: 100 B / 1 ms, B: 300 B / 1 ms, C: 50 B / 2 ms, plus a free view; A = 450 kept bytes.

    Greedy order (bytes per ms, descending): B (300), A (100), C (25).
    Vertices (discarded, ms): (0, 0), (300, 1), (400, 2), (450, 4) -> normalised
    r = 0, 2/3, 8/9, 1 and q = 0, 1/4, 1/2, 1.
    Lines: the flat start q = 0, then each segment's slope through the staircase corner (r_{k-1}, q_k):
      seg 1: s = (1/4) / (2/3) = 3/8,  b = 1/4
      seg 2: s = (1/4) / (2/9) = 9/8,  b = 1/2 - 9/8 · 2/3 = -1/4
      seg 3: s = (1/2) / (1/9) = 9/2,  b = 1 - 9/2 · 8/9 = -3
    """
    ops = [op(0, 100, 1.0), op(1, 300, 1.0), op(2, 0, 0.0, name="aten.view.default", is_view=True), op(3, 50, 2.0)]
    vertices, mandatory = greedy_vertices(ops, 450, recompute_stop=len(ops))
    assert mandatory == 0
    assert vertices == [(0, 0.0, 0), (300, 1.0, 0), (400, 2.0, 0), (450, 4.0, 0)]
    t = build_tradeoff(ops, 450, len(ops))
    assert t.max_discard_bytes == 450 and t.full_recompute_ms == 4.0
    assert [c for p in t.points for c in p] == pytest.approx([0.0, 0.0, 2 / 3, 0.25, 8 / 9, 0.5, 1.0, 1.0])
    assert t.slopes == pytest.approx((0.0, 3 / 8, 9 / 8, 9 / 2))
    assert t.intercepts == pytest.approx((0.0, 0.25, -0.25, -3.0))
    check_curve(t)
    # The bound is loose at r = 1: the last line passes through (r_{n-1}, 1) with the last segment's slope,
    # so q(1) = 2 - q_{n-1}. A convex function >= the staircase cannot be exact at r = 1 unless it is flat
    # (the staircase is 1 on (r_{n-1}, 1]).
    assert t.recompute_fraction(1.0) == pytest.approx(2 - 0.5)
    # between vertices the cost is the next vertex's (staircase), and the lines are above it
    assert staircase(t.points, 0.5) == 0.25 and t.recompute_fraction(0.5) >= 0.25
    assert staircase(t.points, 0.7) == 0.5 and t.recompute_fraction(0.7) >= 0.5


def test_ops_past_the_recompute_stop_cost_nothing():
    ops = [op(0, 100, 1.0), op(1, 300, 1.0), op(2, 50, 2.0)]
    vertices, _ = greedy_vertices(ops, 450, recompute_stop=2)
    # op 2 costs no time to recompute (early stop ends before it): it is never saved, so even the first
    # plan discards its 50 bytes
    assert vertices == [(50, 0.0, 0), (350, 1.0, 0), (450, 2.0, 0)]
    t = build_tradeoff(ops, 450, 2)
    assert t.full_recompute_ms == 2.0
    assert [c for p in t.points for c in p] == pytest.approx([0.0, 0.0, 1 / 9, 0.0, 7 / 9, 0.5, 1.0, 1.0])
    check_curve(t)


def test_mandatory_groups_reduce_max_discard():
    # op 1 modifies a tensor made outside the module (inplace_of == itself): always saved
    ops = [op(0, 100, 1.0), op(1, 60, 1.0, name="aten.relu_.default", inplace_of=1), op(2, 40, 1.0)]
    vertices, mandatory = greedy_vertices(ops, 200, len(ops))
    assert mandatory == 60
    t = build_tradeoff(ops, 200, len(ops))
    assert t.max_discard_bytes == 140
    check_curve(t)


def test_nothing_to_discard_gives_none():
    assert build_tradeoff([], 100, 0) is None
    assert build_tradeoff([op(0, 100, 1.0)], 0, 1) is None
    # everything that is kept is mandatory (modifies a tensor from outside the module)
    assert build_tradeoff([op(0, 100, 1.0, name="aten.relu_.default", inplace_of=0)], 100, 1) is None


def test_inplace_and_random_groups_are_never_split():
    ops = [
        op(0, 200, 1.0),
        op(1, 100, 0.5, name="aten.bernoulli_.float", is_random=True),
        op(2, 300, 1.0),
        op(3, 0, 0.2, name="aten.relu_.default", inplace_of=2),
        op(4, 80, 0.1, name="aten.native_dropout.default", is_random=True),
        op(5, 0, 0.0, name="aten.view.default", is_view=True),
        op(6, 50, 2.0),
    ]
    groups = [g.members for g in op_groups(ops, False, len(ops)) if g.fixed != 0]
    assert sorted(groups) == [(0,), (1, 4), (2, 3), (6,)]  # the view is always recomputed
    vertices, _ = greedy_vertices(ops, 730, len(ops))
    assert len(vertices) == len(groups) + 1
    steps = {b - a for (a, *_), (b, *_) in zip(vertices, vertices[1:])}
    # every step discards one whole group: {0}: 200, {1, 4}: 180, {2, 3}: 300, {6}: 50
    assert steps == {200, 180, 300, 50}
    check_curve(build_tradeoff(ops, 730, len(ops)))


def test_round_trip_through_json():
    ops = [op(0, 100, 1.0), op(1, 300, 1.0), op(2, 50, 2.0)]
    t = build_tradeoff(ops, 450, 3)
    d = json.loads(json.dumps(t.to_dict()))
    assert TradeOff.from_dict(d) == t


# ------------------------------------------------------------------- simplification to few lines (chords)
def many_ops(n: int, seed: int = 0) -> list[OpStat]:
    import random

    rng = random.Random(seed)
    return [op(i, rng.randint(1, 10_000), rng.uniform(0.01, 5.0)) for i in range(n)]


@pytest.mark.parametrize("n, max_lines", [(40, 8), (100, 4), (25, 1)])
def test_simplified_curve_keeps_few_lines_and_still_bounds(n, max_lines):
    ops = many_ops(n, seed=n)
    act = sum(o.out_bytes for o in ops)
    t = build_tradeoff(ops, act, len(ops), max_lines=max_lines)
    assert len(t.points) == n + 1
    assert len(t.slopes) <= max_lines
    check_curve(t, max_lines)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 10**6), st.floats(0.001, 100.0)), min_size=1, max_size=30),
    st.integers(1, 10),
)
def test_random_op_lists(sizes, max_lines):
    ops = [op(i, b, ms) for i, (b, ms) in enumerate(sizes)]
    act = sum(b for b, _ in sizes)
    t = build_tradeoff(ops, act, len(ops), max_lines=max_lines)
    assert t is not None and t.max_discard_bytes == act
    check_curve(t, max_lines)


# ----------------------------------------------------------------------------------- real modules
@pytest.fixture(scope="module")
def llama_tiny():
    from sacplan.collector import collect

    return collect("llama-tiny", device="h100")


def test_llama_tiny_modules(llama_tiny):
    curves = {m.fqn: m.tradeoff for m in llama_tiny.modules if m.tradeoff is not None}
    for fqn in ("", "layers.0", "layers.0.attention", "layers.0.feed_forward", "layers.1.attention_norm"):
        assert fqn in curves, fqn
    for fqn, t in curves.items():
        m = llama_tiny.module(fqn)
        check_curve(t)
        assert 0 < t.max_discard_bytes <= m.act_bytes[0]
        assert t.full_recompute_ms <= m.fw_ms[0] + TOL
        assert t.full_recompute_flops <= m.fw_flops[0]
    # a block has more greedy vertices than lines allowed: the chord simplification ran
    assert len(curves["layers.0"].points) - 1 > DEFAULT_MAX_LINES


def test_llama_tiny_ops_rebuild_the_same_curve(llama_tiny):
    m = llama_tiny.module("layers.0.feed_forward")
    again = build_tradeoff(m.ops, m.act_bytes[0], m.recompute_stop)
    assert again == m.tradeoff


def test_a_view_tied_to_real_ops_is_recomputed_by_the_curve_the_evaluator_and_the_solver_alike():
    """An in-place op on a view (op 2 modifies op 1, a view of op 0's output): the group {1, 2} holds a view, so
    every plan recomputes it (as PyTorch's reference MILP does). The trade-off curve once offered it as a
    choosable item and the evaluator saved it when named, while the solver never would: one rule now."""
    from sacplan.evaluate import module_outcome
    from sacplan.opnames import op_keys

    ops = [
        op(0, 400, 1.0),
        op(1, 0, 0.0, name="aten.view.default", is_view=True),
        op(2, 100, 0.5, name="aten.add_.Tensor", inplace_of=1),
        op(3, 200, 2.0),
    ]
    always, free, never = split_groups(ops, False, len(ops))
    assert [g.members for g in free] == [(0,), (3,)] and [g.members for g in never] == [(1, 2)] and not always
    vertices, mandatory = greedy_vertices(ops, 700, len(ops))
    assert mandatory == 0 and len(vertices) == 3  # two choosable groups: 0 and 3
    assert vertices[0][0] == 100 and vertices[0][1] == 0.5  # the tied group is discarded and recomputed in every plan
    keys = op_keys(ops)
    stats = SimpleNamespace(ops=tuple(ops), recompute_stop=len(ops), fqn="m", calls=1, act_bytes=(700,),
                            tradeoff=build_tradeoff(ops, 700, len(ops)))  # the ModuleStats fields it reads
    out = module_outcome(stats, frozenset({keys[2], keys[3]}))  # naming the in-place op does not save it
    assert out.saved_keys == frozenset({keys[3]}) and out.discard_bytes == (500,)
