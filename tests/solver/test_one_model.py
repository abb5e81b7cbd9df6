"""One memory model: on random trees the solver's peaks, the evaluator's and the budget MILP's rows agree.

For a random non-nested choice of checkpointed modules and discard ratios: ``SacProblem.peaks`` (the solver's
exact evaluation) equals ``evaluate.event_peaks`` (what validate, the alternatives and the plots use) at every
event, both computed by :class:`sacplan.timeline.Timeline`, and so does its linear form ``linear_terms``; and
the budget MILP's rows, at the columns
``columns_for`` sets for that choice, hold at a budget of exactly that peak and fail one byte below it. The
independent brute-force oracle that re-derives every event from the stats is tests/solver/oracles.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sacplan.evaluate import event_peaks
from sacplan.solver.formulation import build_budget_model, columns_for
from sacplan.solver.problem import SacProblem
from sacplan.testing.synthetic import build_tree, random_spec
from sacplan.units import GiB


def _choice(P: SacProblem, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
    y, r = np.zeros(P.num_candidates), np.zeros(P.num_candidates)
    for c in P.candidates:  # pre-order: an ancestor is decided first
        p, nested = c.parent_slot, False
        while p >= 0:
            nested |= y[p] > 0.5
            p = P.candidates[p].parent_slot
        if not nested and rng.random() < 0.5:
            y[c.slot] = 1.0
            r[c.slot] = rng.choice((c.min_ratio, 1.0, rng.uniform(c.min_ratio, 1.0)))
    return y, r


@given(seed=st.integers(0, 2**31), world_size=st.sampled_from([None, 1, 4]))
@settings(max_examples=60, deadline=None)
def test_solver_evaluator_and_rows_agree(seed: int, world_size: int | None) -> None:
    rng = random.Random(seed)
    tree = build_tree(random_spec(rng), world_size=rng.choice((1, 2)))
    P = SacProblem(tree, world_size)
    y, r = _choice(P, rng)
    peaks = P.peaks(y, r)
    discards = {
        c.fqn: [a * r[c.slot] for a in c.act_bytes] for c in P.candidates if y[c.slot] > 0.5
    }
    assert np.asarray(event_peaks(tree, discards, world_size)) == pytest.approx(np.ceil(peaks - 1e-6), abs=1.0)
    C, Y = P.linear_terms()  # the linear form the local descent and repair move along
    if not np.any(P.ev_surge >= 0):
        assert peaks == pytest.approx(P.ev_base - C @ (r * y) + Y @ y, rel=1e-12, abs=1e-3)
    peak = float(peaks.max())
    model, idx, trivially_infeasible = build_budget_model(P, peak)
    assert not trivially_infeasible
    assert model.max_violation(columns_for(P, model, idx, y, r)) <= 1e-9
    if peak > P.baseline_peak() - 1 or peak <= 1:
        return  # nothing checkpointing can move below it: the row may be pruned as unchangeable
    model, idx, trivially_infeasible = build_budget_model(P, peak - 1.0)
    assert trivially_infeasible or model.max_violation(columns_for(P, model, idx, y, r)) > 0.5 / GiB
