"""Pictures: the memory timeline of a step, one module's trade-off curve, the budget/recompute Pareto front.

matplotlib is optional (``pip install sacplan[plot]``); it is imported inside each function. Every function
returns a ``matplotlib.figure.Figure`` and saves it to ``path`` when given. Figures are created with
``matplotlib.figure.Figure`` directly (no pyplot state), so they work under any backend, including Agg.

Axes: bytes are shown in GiB (MiB for a module's trade-off when small), times in ms.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from sacplan.stats import Phase
from sacplan.units import GiB, MiB

__all__ = ["plot_memory_timeline", "plot_tradeoff", "plot_pareto"]


def _figure(size: tuple[float, float] = (8.0, 4.5)) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "sacplan's plots need matplotlib: pip install sacplan[plot]  (or: pip install matplotlib)"
        ) from e
    return Figure(figsize=size, layout="constrained")


def _finish(fig: Any, path: Any) -> Any:
    if path is not None:
        fig.savefig(str(path), dpi=120)
    return fig


def _phase_spans(phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """Maximal runs of forward (``fw``) and backward (``bw``/``rc``) events: (kind, first, last+1)."""
    spans: list[tuple[str, int, int]] = []
    for i, ph in enumerate(phases):
        kind = "forward" if ph == Phase.FW else "backward" if ph in (Phase.BW, Phase.RC) else "other"
        if spans and spans[-1][0] == kind and spans[-1][2] == i:
            spans[-1] = (kind, spans[-1][1], i + 1)
        else:
            spans.append((kind, i, i + 1))
    return spans


def plot_memory_timeline(tree: Any, plan: Any = None, budget: Any = None, *, path: Any = None) -> Any:
    """Predicted live bytes at each event of the collected step, without and (if ``plan``) with the plan.

    Forward and backward stretches are shaded; ``budget`` (any :func:`~sacplan.units.parse_budget` form,
    default the plan's budget) is drawn as a horizontal line.
    """
    from sacplan.evaluate import event_peaks
    from sacplan.tradeoff import recompute_surge
    from sacplan.units import parse_budget

    stats = tree.stats
    ws = getattr(plan, "world_size", None) if plan is not None else None
    base = event_peaks(tree, {}, ws)
    fig = _figure()
    ax = fig.add_subplot()
    x = list(range(len(base)))
    spans = _phase_spans([e.phase for e in stats.events])
    colors = {"forward": "tab:blue", "backward": "tab:orange"}
    labelled: set[str] = set()
    for kind, a, b in spans:
        if kind in colors:
            ax.axvspan(a - 0.5, b - 0.5, color=colors[kind], alpha=0.08, lw=0,
                       label=None if kind in labelled else kind)
            labelled.add(kind)
    ax.plot(x, [v / GiB for v in base], color="0.3", lw=1.2, label=f"no AC (peak {max(base, default=0) / GiB:.2f} GiB)")
    if plan is not None:
        discards = {d.fqn: [int(d.discard_bytes)] * int(d.calls) for d in plan.decisions}
        surges = {}
        for d in plan.decisions:
            if d.saved_ops is not None and d.fqn in tree:
                ms = tree.node(d.fqn).stats
                surges[d.fqn] = recompute_surge(ms.ops, [i for i, _, _ in d.saved_ops], ms.recompute_stop)
        with_plan = event_peaks(tree, discards, ws, surges)
        ax.plot(x, [v / GiB for v in with_plan], color="tab:green", lw=1.5,
                label=f"with plan (peak {max(with_plan, default=0) / GiB:.2f} GiB)")
    if budget is None and plan is not None:
        budget = plan.budget_bytes
    if budget is not None:
        b = parse_budget(budget, capacity_bytes=stats.device.memory_bytes)
        ax.axhline(b / GiB, color="tab:red", ls="--", lw=1, label=f"budget {b / GiB:.2f} GiB")
    ax.set_xlabel("event of the training step")
    ax.set_ylabel("live memory (GiB)")
    ax.set_title(f"memory timeline: {stats.model_name} on {stats.device.name}")
    ax.set_xlim(-0.5, max(0.5, len(x) - 0.5))
    ax.legend(loc="best", fontsize="small")
    return _finish(fig, path)


def plot_tradeoff(module_stats: Any, *, path: Any = None) -> Any:
    """One module's recompute-versus-discard trade-off (one call).

    Draws the greedy vertices (op groups in decreasing bytes-per-ms order), the achievable staircase
    (discarding ``x`` bytes costs the first vertex at or beyond ``x``), the convex upper-bound lines of
    ``stats.tradeoff`` and their maximum (what the MILP uses).
    """
    t = module_stats.tradeoff
    fig = _figure((6.5, 4.5))
    ax = fig.add_subplot()
    name = module_stats.fqn or "<root>"
    if t is None or t.max_discard_bytes <= 0 or not t.points:
        ax.text(0.5, 0.5, f"{name}: nothing to discard", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _finish(fig, path)
    big = t.max_discard_bytes >= GiB
    unit, scale = ("GiB", GiB) if big else ("MiB", MiB)
    A, R = t.max_discard_bytes / scale, t.full_recompute_ms
    pts = sorted(t.points)
    xs = [r * A for r, _ in pts]
    ys = [q * R for _, q in pts]
    # achievable staircase: a target discard between two vertices costs the next vertex
    sx, sy = [xs[0]], [ys[0]]
    for i in range(1, len(pts)):
        sx += [xs[i - 1], xs[i]]
        sy += [ys[i], ys[i]]
    ax.plot(sx, sy, color="tab:blue", lw=1.2, drawstyle="default", label="achievable (staircase)")
    ax.scatter(xs, ys, color="tab:blue", s=18, zorder=3, label="greedy vertices")
    grid = [k / 200 for k in range(201)]
    for i, (s, b) in enumerate(zip(t.slopes, t.intercepts)):
        ax.plot([r * A for r in grid], [(s * r + b) * R for r in grid], color="0.6", lw=0.7, ls=":",
                label="upper-bound lines" if i == 0 else None)
    env = [t.recompute_fraction(r) * R for r in grid]
    ax.plot([r * A for r in grid], env, color="tab:red", lw=1.5, label="convex upper bound (MILP)")
    lo = min(min(ys), 0.0)
    hi = max(max(ys), max(env)) if env else max(ys)
    ax.set_ylim(lo - 0.02 * (hi - lo + 1e-12), hi * 1.05 + 1e-12)
    ax.set_xlabel(f"discarded activations per call ({unit})")
    ax.set_ylabel("recompute per call (ms)")
    ax.set_title(f"trade-off of {name} ({module_stats.module_type})")
    ax.legend(loc="upper left", fontsize="small")
    return _finish(fig, path)


def _extra(points: Any) -> list[tuple[str, float, float]]:
    if points is None:
        return []
    items: Iterable[Any] = points.items() if isinstance(points, Mapping) else points
    out = []
    for item in items:
        if isinstance(points, Mapping):
            label, (peak, ms) = item
        else:
            label, peak, ms = item
        out.append((str(label), float(peak), float(ms)))
    return out


def plot_pareto(sweep_result: Any, extra_points: Any = None, *, path: Any = None) -> Any:
    """Recompute ms versus budget from a :class:`~sacplan.budget_sweep.SweepResult`.

    Shows the optimal plans (budget → recompute), their predicted peaks, the no-AC point, the full-AC-per-block
    point and the minimum feasible budget. ``extra_points``: ``{label: (peak_bytes, recompute_ms)}`` or a
    list of ``(label, peak_bytes, recompute_ms)`` (e.g. PyTorch's plan, a hand-written save list).
    """
    r = sweep_result
    fig = _figure()
    ax = fig.add_subplot()
    rows = [row for row in r.rows if row.feasible]
    if rows:
        ax.plot([row.budget_bytes / GiB for row in rows], [row.recompute_ms for row in rows], "-o", color="tab:blue",
                ms=4, label="optimal SAC plan (budget)")
        ax.scatter([row.predicted_peak_bytes / GiB for row in rows], [row.recompute_ms for row in rows],
                   marker="x", color="tab:blue", alpha=0.6, label="its predicted peak")
    ax.scatter([r.baseline_peak_bytes / GiB], [0.0], marker="s", color="0.2", zorder=3, label="no AC")
    if r.full_ac_point is not None:
        peak, ms = r.full_ac_point
        ax.scatter([peak / GiB], [ms], marker="^", color="tab:red", zorder=3,
                   label=f"full AC of {len(r.blocks)} blocks")
    markers = iter("DPv<>*hp")
    for label, peak, ms in _extra(extra_points):
        ax.scatter([peak / GiB], [ms], marker=next(markers, "o"), zorder=3, label=label)
    ax.axvline(r.min_feasible_bytes / GiB, color="tab:red", ls="--", lw=0.8,
               label=f"minimum feasible {r.min_feasible_bytes / GiB:.2f} GiB")
    ax.set_xlabel("memory budget / peak per GPU (GiB)")
    ax.set_ylabel("recompute per step (ms)")
    ax.set_title(f"SAC Pareto front: {r.model_name} on {r.device_name} (world size {r.world_size})")
    ax.legend(loc="best", fontsize="small")
    return _finish(fig, path)
