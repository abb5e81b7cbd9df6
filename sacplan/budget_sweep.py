"""Recompute time versus memory budget: the Pareto front of selective activation checkpointing.

    tree = ModuleTree(collect("llama-1b", device="h100", dtype="bf16"))
    result = sweep(tree, points=8)          # budgets from the minimum feasible to the no-AC peak
    print(result.table())

Every row is one :func:`sacplan.solver.solve` call. Two reference points are evaluated with the same memory
model (:func:`sacplan.evaluate.predict`): no checkpointing at all (``baseline_peak_bytes``, 0 ms) and full
checkpointing of every repeated block (``full_ac_point``), the usual hand-written alternative.

Units: bytes (int) and milliseconds (float); GiB only in :meth:`SweepResult.table`.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from sacplan.errors import BudgetWarning, InfeasibleBudgetError
from sacplan.blocks import repeated_blocks as find_repeated
from sacplan.tree import ModuleTree, as_tree
from sacplan.units import GiB, MiB, parse_budget

if TYPE_CHECKING:
    from sacplan.solver.options import SolverOptions

__all__ = ["SweepRow", "SweepResult", "sweep", "repeated_blocks", "full_ac_point", "flat_notes"]


@dataclass(frozen=True)
class SweepRow:
    """One budget of a sweep.

    Attributes:
        budget_bytes: the budget solved for.
        recompute_ms: recompute time per step of the plan (``nan`` when infeasible).
        predicted_peak_bytes: predicted per-rank peak with the plan (``-1`` when infeasible).
        status: the plan's status (``"optimal"``, ``"time_limit"``, ``"not needed"``) or ``"infeasible"``.
        n_checkpointed: modules the plan checkpoints.
        gap: solver's relative gap (0 when proven optimal).
        dispatch_ms: host ms per step the plan's selective regions add (:mod:`sacplan.sacmode`); the overhead
            column counts it with the recomputation.
    """

    budget_bytes: int
    recompute_ms: float
    predicted_peak_bytes: int
    status: str
    n_checkpointed: int
    gap: float = 0.0
    dispatch_ms: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.status != "infeasible"

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "recompute_ms": None if math.isnan(self.recompute_ms) else self.recompute_ms,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "status": self.status,
            "n_checkpointed": self.n_checkpointed,
            "gap": self.gap,
            "dispatch_ms": self.dispatch_ms,
        }


@dataclass(frozen=True)
class SweepResult:
    """Rows of a budget sweep plus the two reference points.

    Attributes:
        rows: one per budget, budgets ascending.
        min_feasible_bytes: smallest budget any plan meets.
        baseline_peak_bytes: predicted peak without checkpointing (recompute 0 ms).
        full_ac_point: ``(peak_bytes, recompute_ms)`` of full checkpointing of every block in ``blocks``
            (``None`` when the model has no repeated blocks).
        blocks: the repeated blocks used for ``full_ac_point``.
        baseline_step_ms: estimated step time without checkpointing.
        model_name, device_name, world_size: provenance.
        notes: why the sweep is flat, when no plan can lower the peak (printed under the table).
    """

    rows: tuple[SweepRow, ...]
    min_feasible_bytes: int
    baseline_peak_bytes: int
    full_ac_point: tuple[int, float] | None
    blocks: tuple[str, ...] = ()
    baseline_step_ms: float = 0.0
    model_name: str = ""
    device_name: str = ""
    world_size: int = 1
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    notes: tuple[str, ...] = ()

    def table(self) -> str:
        """A readable table (GiB, or MiB when the no-AC peak is under 1 GiB; ms)."""
        un, u = ("GiB", GiB) if self.baseline_peak_bytes >= GiB else ("MiB", MiB)
        lines = [
            f"budget sweep for {self.model_name or '<model>'} on {self.device_name or '<device>'} "
            f"(world size {self.world_size})",
            f"  no AC:           peak {self.baseline_peak_bytes / u:8.3f} {un}, recompute     0.000 ms",
        ]
        if self.full_ac_point is not None:
            peak, ms = self.full_ac_point
            lines.append(
                f"  full AC ({len(self.blocks)} blocks): peak {peak / u:8.3f} {un}, recompute {ms:9.3f} ms"
            )
        lines.append(f"  minimum feasible budget {self.min_feasible_bytes / u:.3f} {un}")
        lines.append("")
        # extra ms: recomputation plus the selective regions' dispatch (sacplan.sacmode), what the plan adds to a step
        lines.append(f"  {'budget ' + un:>10}  {'peak ' + un:>9}  {'extra ms':>12}  {'overhead':>8}  {'#ckpt':>5}  status")
        for r in self.rows:
            if r.feasible:
                extra = r.recompute_ms + r.dispatch_ms
                ov = f"{100 * extra / self.baseline_step_ms:7.2f}%" if self.baseline_step_ms > 0 else "      -"
                lines.append(
                    f"  {r.budget_bytes / u:10.3f}  {r.predicted_peak_bytes / u:9.3f}  {extra:12.3f}  "
                    f"{ov:>8}  {r.n_checkpointed:5d}  {r.status}"
                )
            else:
                lines.append(f"  {r.budget_bytes / u:10.3f}  {'-':>9}  {'-':>12}  {'-':>8}  {'-':>5}  infeasible")
        if self.notes:
            lines.append("")
            lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "device_name": self.device_name,
            "world_size": self.world_size,
            "min_feasible_bytes": self.min_feasible_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "baseline_step_ms": self.baseline_step_ms,
            "full_ac_point": None
            if self.full_ac_point is None
            else {"peak_bytes": self.full_ac_point[0], "recompute_ms": self.full_ac_point[1]},
            "blocks": list(self.blocks),
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }


def repeated_blocks(tree: ModuleTree) -> tuple[str, ...]:
    """The model's repeated blocks (e.g. transformer layers): :func:`sacplan.blocks.repeated_blocks`."""
    return find_repeated(tree.stats)


def full_ac_point(
    tree: ModuleTree, blocks: Iterable[str] | None = None, world_size: int | None = None
) -> tuple[int, float] | None:
    """``(predicted peak bytes, recompute ms)`` of fully checkpointing every block (default: repeated blocks)."""
    from sacplan.evaluate import full_choices, predict

    fqns = tuple(repeated_blocks(tree) if blocks is None else blocks)
    if not fqns:
        return None
    p = predict(tree, full_choices(fqns), world_size=world_size)
    return int(p.peak_bytes), float(p.recompute_ms)


def sweep(
    tree: ModuleTree,
    budgets: Sequence[int | float | str] | None = None,
    *,
    points: int = 8,
    world_size: int | None = None,
    solver: str = "auto",
    time_limit_s: float | None = 60.0,
    ac_units: list[str] | None = None,
    fsdp_units: list[str] | None = None,
    options: SolverOptions | None = None,
) -> SweepResult:
    """Solve the plan at several budgets.

    Args:
        tree: the collected module tree.
        budgets: budgets in any :func:`~sacplan.units.parse_budget` form; default ``points`` budgets evenly
            spaced from the minimum feasible budget to the no-checkpointing peak (both included).
        points: number of default budgets (≥ 2).
        world_size, solver, ac_units, fsdp_units: passed to :func:`sacplan.solver.solve`.
        time_limit_s: wall-clock budget (s) of the whole sweep (default 60; None: none), shared evenly among
            the minimum-feasible solve and the points still to solve; points stopped by it keep status
            ``"time_limit"`` and their gap, said in one :class:`~sacplan.solver.TimeLimitWarning` line.
        options: the solver settings as one :class:`~sacplan.solver.SolverOptions` instead of ``solver`` and
            ``time_limit_s`` (its time limit is the whole sweep's; every point is solved with its settings).

    Returns:
        :class:`SweepResult`; budgets below the minimum feasible appear with status ``"infeasible"``.
    """
    from sacplan.solver.limits import DEFAULT_SWEEP_S, deadline
    from sacplan.solver.options import resolve_options

    opts = resolve_options(options, dict(solver=solver, time_limit_s=time_limit_s), DEFAULT_SWEEP_S)
    with deadline(opts.time_limit_s):
        return _sweep(tree, budgets, points, world_size, opts, ac_units, fsdp_units)


def _sweep(
    tree: ModuleTree, budgets: Sequence[int | float | str] | None, points: int, world_size: int | None,
    opts: SolverOptions, ac_units: list[str] | None, fsdp_units: list[str] | None,
) -> SweepResult:

    from sacplan.errors import ConfigError
    from sacplan.solver import TimeLimitWarning, baseline_peak, min_feasible_budget, solve
    from sacplan.solver.limits import remaining

    tree = as_tree(tree)
    stats = tree.stats
    t0 = time.monotonic()
    time_limit_s = opts.time_limit_s
    n_solves = (points if budgets is None else len(budgets)) + 1

    def share(k_left: int) -> float | None:  # an even share of what is left among the solves still to run
        left = remaining(None if time_limit_s is None else time_limit_s - (time.monotonic() - t0))
        return None if left is None else left / max(1, k_left)

    # each solve's deterministic work budget: an even share of the sweep's, fixed in advance (the wall-clock
    # shares above are the safety net), so the sweep gives the same rows on every run
    work = None if opts.work_limit is None else max(1, opts.work_limit // n_solves)
    opts = opts.replace(work_limit=work)

    base = baseline_peak(tree, world_size=world_size)
    mf = min_feasible_budget(tree, world_size=world_size, ac_units=ac_units, fsdp_units=fsdp_units,
                             options=opts.replace(time_limit_s=share(n_solves)))
    if budgets is None:
        if points < 2:
            raise ConfigError(f"a sweep needs at least 2 points, got {points}")
        lo, hi = mf, max(mf, base)
        bs = sorted({int(round(lo + (hi - lo) * k / (points - 1))) for k in range(points)})
    else:
        bs = sorted(parse_budget(b, capacity_bytes=stats.device.memory_bytes) for b in budgets)
    rows = []
    for k, b in enumerate(bs):
        try:
            with warnings.catch_warnings():  # budgets above the device were warned about above, or are the sweep's own
                warnings.simplefilter("ignore", BudgetWarning)
                warnings.simplefilter("ignore", TimeLimitWarning)  # said once for the sweep, below
                p = solve(  # "<n>B": an int below 1 MiB would be read as GiB by parse_budget
                    tree, f"{b}B", world_size=world_size, options=opts.replace(time_limit_s=share(len(bs) - k)),
                    ac_units=ac_units, fsdp_units=fsdp_units,
                )
        except InfeasibleBudgetError:
            rows.append(SweepRow(b, math.nan, -1, "infeasible", 0, math.nan))
            continue
        rows.append(SweepRow(b, float(p.recompute_ms), int(p.predicted_peak_bytes), p.status, len(p.decisions), float(p.gap),
                             p.dispatch_ms))
    stopped = [r for r in rows if r.status == "time_limit"]
    if stopped:
        warnings.warn(
            f"{len(stopped)} of {len(rows)} sweep points stopped at the time limit ({time_limit_s:g} s for the sweep) "
            f"with the best plan found, at most gap {max(r.gap for r in stopped):.4%} above the optimum; raise "
            "time_limit_s (CLI: --time-limit) to prove them", TimeLimitWarning, stacklevel=3)
    blocks = repeated_blocks(tree)
    ws = world_size or stats.world_size
    full = full_ac_point(tree, blocks, world_size=world_size)
    return SweepResult(
        rows=tuple(rows),
        min_feasible_bytes=int(mf),
        baseline_peak_bytes=int(base),
        full_ac_point=full,
        blocks=blocks,
        baseline_step_ms=float(stats.step_ms),
        model_name=stats.model_name,
        device_name=stats.device.name,
        world_size=int(ws),
        notes=flat_notes(tree, int(mf), int(base), full),
    )


def flat_notes(tree: ModuleTree, min_feasible_bytes: int, baseline_peak_bytes: int,
               full: tuple[int, float] | None) -> tuple[str, ...]:
    """Why no plan lowers the peak (lines), when the minimum feasible budget is the no-checkpointing peak."""
    from sacplan.plan import peak_advice
    from sacplan.units import fmt_bytes

    if min_feasible_bytes < baseline_peak_bytes:
        return ()
    same = "" if full is None else f" (full AC of every block peaks at {fmt_bytes(full[0])} too)"
    lines = [f"flat: no plan lowers this step's peak of {fmt_bytes(baseline_peak_bytes)}{same}."]
    lines += peak_advice(tree.stats.peak_phase, tree.stats.peak_module)
    lines.append("planning matters when activations set the peak, e.g. with a larger batch or sequence "
                 "(--batch/--seq, or your factory's inputs)")
    return tuple(lines)
