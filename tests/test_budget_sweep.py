"""sacplan.budget_sweep (the function sacplan.sweep): budgets, monotone recompute, reference points, repeated blocks."""

from __future__ import annotations

import math

import pytest

from sacplan.collector import collect
from sacplan.budget_sweep import SweepResult, full_ac_point, repeated_blocks, sweep
from sacplan.tree import ModuleTree




@pytest.fixture(scope="module")
def llama():
    return ModuleTree(collect("llama-tiny", device="h100", dtype="bf16"))


@pytest.fixture(scope="module")
def cnn():
    return ModuleTree(collect("cnn-tiny", device="h100"))


def test_repeated_blocks(llama, cnn):
    assert repeated_blocks(llama) == ("layers.0", "layers.1")
    # the root's two Sequential children tie with the two ResidualBlocks; the non-container type wins
    assert repeated_blocks(cnn) == ("layers.0", "layers.1")


def test_default_budgets_monotone(llama):
    r = sweep(llama, points=5)
    assert isinstance(r, SweepResult) and len(r.rows) == 5
    budgets = [row.budget_bytes for row in r.rows]
    assert budgets[0] == r.min_feasible_bytes and budgets[-1] == r.baseline_peak_bytes
    assert budgets == sorted(budgets)
    ms = [row.recompute_ms for row in r.rows]
    assert all(b <= a + 1e-9 for a, b in zip(ms, ms[1:])), ms
    assert r.rows[-1].status == "not needed" and r.rows[-1].n_checkpointed == 0 and ms[-1] == 0.0
    for row in r.rows:
        assert row.feasible and row.predicted_peak_bytes <= row.budget_bytes
    # optimal SAC at the full-AC peak costs no more than full AC itself
    peak, full_ms = r.full_ac_point
    assert peak >= r.min_feasible_bytes
    assert full_ms >= ms[0] - 1e-9
    text = r.table()
    assert "no AC" in text and "full AC (2 blocks)" in text and "minimum feasible" in text


def test_explicit_budgets_with_infeasible(llama):
    r = sweep(llama, ["65MiB", "65.8MiB", 66 * 2**20])
    assert [row.status for row in r.rows][0] == "infeasible"
    assert math.isnan(r.rows[0].recompute_ms) and not r.rows[0].feasible
    assert all(row.feasible for row in r.rows[1:])
    assert "infeasible" in r.table()
    d = r.to_dict()
    assert d["rows"][0]["recompute_ms"] is None and d["full_ac_point"]["peak_bytes"] > 0


def test_full_ac_point_matches_predict(cnn):
    from sacplan.evaluate import full_choices, predict

    blocks = repeated_blocks(cnn)
    p = predict(cnn, full_choices(blocks))
    assert full_ac_point(cnn) == (p.peak_bytes, p.recompute_ms)
    assert full_ac_point(cnn, blocks=()) is None


def test_too_few_points(llama):
    from sacplan.errors import ConfigError

    with pytest.raises(ConfigError):
        sweep(llama, points=1)
