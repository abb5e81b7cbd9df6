"""sacplan.plot: figures are created and saved (Agg backend)."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from sacplan.collector import collect  # noqa: E402
from sacplan.plot import plot_memory_timeline, plot_pareto, plot_tradeoff  # noqa: E402
from sacplan.tree import ModuleTree  # noqa: E402




@pytest.fixture(scope="module")
def tree():
    return ModuleTree(collect("llama-tiny", device="h100", dtype="bf16"))


def _saved(fig, path):
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure)
    assert path.exists() and path.stat().st_size > 1000


def test_memory_timeline(tree, tmp_path):
    from sacplan.solver import solve

    plan = solve(tree, "65.75MiB")
    p = tmp_path / "timeline.png"
    fig = plot_memory_timeline(tree, plan, path=p)
    _saved(fig, p)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("with plan" in s for s in labels) and any("budget" in s for s in labels)
    assert "forward" in labels and "backward" in labels
    fig2 = plot_memory_timeline(tree, budget="65.5MiB")
    assert len(fig2.axes[0].lines) == 2  # no-AC curve + budget line


def test_tradeoff(tree, tmp_path):
    p = tmp_path / "tradeoff.png"
    stats = tree.node("layers.0").stats
    fig = plot_tradeoff(stats, path=p)
    _saved(fig, p)
    # the convex upper bound lies on or above every greedy vertex
    t = stats.tradeoff
    for r, q in t.points:
        assert t.recompute_fraction(r) >= q - 1e-9
    p2 = tmp_path / "leaf.png"
    empty = next(n.stats for n in tree if n.stats.tradeoff is None)
    _saved(plot_tradeoff(empty, path=p2), p2)


def test_pareto(tree, tmp_path):
    from sacplan.budget_sweep import sweep

    r = sweep(tree, points=4)
    p = tmp_path / "pareto.png"
    fig = plot_pareto(r, {"hand-written": (r.baseline_peak_bytes * 0.9, 0.1)}, path=p)
    _saved(fig, p)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "no AC" in labels and "hand-written" in labels and any("full AC" in s for s in labels)
    plot_pareto(r, [("a", 2 * 2**20, 0.2)])
