"""The public entry points of the solver: the plan (:func:`solve`, the pipeline of :mod:`sacplan.solver` read top to
bottom in :func:`_solve`), the smallest feasible budget, a lower bound on recompute, the no-checkpointing peak."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Sequence

import numpy as np

from sacplan.errors import SolverError
from sacplan.plan import Plan
from sacplan.solver import limits
from sacplan.solver.backends import lp_solver, solve_model
from sacplan.solver.formulation import build_budget_model
from sacplan.solver.judge import Verdict, judge
from sacplan.solver.limits import DEFAULT_SOLVE_S, lifted, time_limit_message
from sacplan.solver.model import INFEASIBLE, OPTIMAL, TIME_LIMIT, relaxed
from sacplan.solver.options import SolverOptions, resolve_options
from sacplan.solver.problem import SacProblem
from sacplan.solver.realise import per_module_peak
from sacplan.solver.min_peak import min_peak_plan, solve_min_peak
from sacplan.solver.strategies import Found, find
from sacplan.tree import ModuleTree, as_tree
from sacplan.units import Bytes, parse_budget


class TimeLimitWarning(UserWarning):
    """The solver stopped at its time limit; the plan is the best found, with the gap stated."""


def baseline_peak(tree: ModuleTree, world_size: int | None = None) -> Bytes:
    """Predicted per-rank peak bytes without checkpointing (``max_e peak_e - S_e``), rounded up; a
    :class:`~sacplan.units.Bytes`, so it is read as bytes when passed back as a budget."""
    return Bytes(math.ceil(SacProblem(tree, world_size).baseline_peak() - 1e-6))


def _problem(
    tree: ModuleTree, world_size: int | None, ac_units: Sequence[str] | None, fsdp_units: Sequence[str] | None,
    **kw: Any,
) -> SacProblem:
    """The :class:`SacProblem` of a public call (``kw``: its modelling settings). ``fsdp_units`` None: the modules
    ``fully_shard`` was called on in the stats (:func:`sacplan.distributed.unit_modules`; none for stats not
    collected on a mesh); ``[]``: none."""
    tree = as_tree(tree)
    if fsdp_units is None:
        from sacplan.distributed import unit_modules

        fsdp_units = unit_modules(tree.stats) or None
    return SacProblem(tree, world_size, ac_units, fsdp_units, **kw)


def min_feasible_budget(
    tree: ModuleTree,
    *,
    world_size: int | None = None,
    ac_units: Sequence[str] | None = None,
    fsdp_units: Sequence[str] | None = None,
    solver: str = "auto",
    threads: int | None = None,
    time_limit_s: float | None = DEFAULT_SOLVE_S,
    options: SolverOptions | None = None,
) -> Bytes:
    """Smallest budget (bytes) any plan meets: the optimum of the MILP minimising the predicted peak.

    A :class:`~sacplan.units.Bytes`: pass it straight back as ``solve(tree, min_feasible_budget(tree))``, read as
    bytes even under 1 MiB. Stopped by ``time_limit_s`` (s, default 60), the peak of the best plan found (a budget
    some plan meets, not proven the smallest). ``solver``, ``threads``, ``time_limit_s``: as
    :class:`~sacplan.solver.options.SolverOptions`, or all settings as ``options``."""
    opts = resolve_options(options, dict(solver=solver, threads=threads, time_limit_s=time_limit_s))
    with limits.call(opts.time_limit_s, opts.work_limit):
        return Bytes(solve_min_peak(_problem(tree, world_size, ac_units, fsdp_units), opts)[0])


def recompute_lower_bound(
    tree: ModuleTree,
    budget: int | float | str,
    *,
    world_size: int | None = None,
    ac_units: Sequence[str] | None = None,
    fsdp_units: Sequence[str] | None = None,
    solver: str = "auto",
    threads: int | None = None,
    time_limit_s: float | None = DEFAULT_SOLVE_S,
    options: SolverOptions | None = None,
) -> float:
    """A recompute time (ms) that *no* plan fitting ``budget`` can beat, under sacplan's memory model.

    "Any plan": any non-nested checkpoint units among the candidates, each with any op save list. Each module's
    cost is replaced by the LP relaxation of its op-level knapsack (:func:`~sacplan.solver.ops.fractional_lines`,
    below every option) and the proven bound of that convex MILP returned: how far from the best possible plan a
    plan can at most be, e.g. whether "a third of full checkpointing" is reachable at all. 0.0 when no
    checkpointing is needed; stopped by ``time_limit_s`` before a bound of its own, the LP relaxation's (weaker,
    valid). ``solver``, ``threads``, ``time_limit_s``: as in :func:`min_feasible_budget`.

    Raises:
        InfeasibleBudgetError: no plan fits (with the smallest feasible budget).
    """
    opts = resolve_options(options, dict(solver=solver, threads=threads, time_limit_s=time_limit_s))
    with limits.call(opts.time_limit_s, opts.work_limit):
        return _recompute_lower_bound(tree, budget, world_size, ac_units, fsdp_units, opts)


def _recompute_lower_bound(
    tree: ModuleTree, budget: int | float | str, world_size: int | None, ac_units: Sequence[str] | None,
    fsdp_units: Sequence[str] | None, opts: SolverOptions,
) -> float:
    solver, threads = opts.backend, opts.threads
    problem = _problem(tree, world_size, ac_units, fsdp_units, relax=True)
    tree = problem.tree
    budget_bytes = parse_budget(budget, capacity_bytes=tree.stats.device.memory_bytes)
    if problem.baseline_peak() <= budget_bytes:
        return 0.0

    def infeasible() -> float:  # raises with the exact problem's smallest feasible budget; 0.0 if its plan fits
        min_peak_plan(_problem(tree, world_size, ac_units, fsdp_units), budget_bytes, opts)
        return 0.0

    if problem.num_candidates == 0 or problem.lower_bound_peak() > budget_bytes:
        return infeasible()
    model, idx, trivially_infeasible = build_budget_model(problem, float(budget_bytes))
    if trivially_infeasible:
        return infeasible()
    res = solve_model(model, solver, time_limit_s=opts.time_limit_s, gap_rel=1e-6, gap_abs=1e-9, threads=threads,
                      priorities={k: 1 for k in idx.K} or None, options=["preprocess off"])  # see _solve_budget_model
    if res.status == INFEASIBLE:
        return infeasible()
    if not math.isfinite(res.bound):  # stopped before its root bound: the LP relaxation's, weaker but valid
        with lifted():  # one LP: a bound even from a spent budget
            lp = solve_model(relaxed(model), lp_solver(solver), threads=threads)
        if lp.status == INFEASIBLE:
            return infeasible()
        if lp.status != OPTIMAL:
            raise SolverError(f"{solver} proved no lower bound ({res.raw_status}); raise time_limit_s")
        return max(0.0, float(lp.objective))
    return max(0.0, float(res.bound))


def solve(
    tree: ModuleTree,
    budget: int | float | str,
    *,
    world_size: int | None = None,
    ac_units: list[str] | None = None,
    fsdp_units: list[str] | None = None,
    solver: str = "auto",
    time_limit_s: float | None = DEFAULT_SOLVE_S,
    gap_rel: float = 1e-4,
    op_level: bool = True,
    threads: int | None = None,
    exact: bool | None = None,
    max_options: int | None = 16,
    on_interrupt: str = "raise",
    options: SolverOptions | None = None,
) -> Plan:
    r"""Cheapest selective activation checkpointing plan whose predicted per-rank peak fits ``budget``.

    The memory model is :mod:`sacplan.timeline`, the MILP over it :mod:`sacplan.solver.formulation`, the strategies
    :mod:`sacplan.solver.strategies`. Solutions are checked exactly in bytes (tolerance violations repaired by
    raising ratios) and realised as op save lists (``op_level``); the reported peak and recompute time are the
    realised plan's.

    Args:
        tree: the collected module tree (or the ModelStats ``collect`` returns).
        budget: per-rank memory budget: GiB number, bytes, ``"40GiB"``, ``"80%"`` of the target device...
            (:func:`sacplan.units.parse_budget`).
        world_size: ranks to plan for (None: as collected). State bytes scale by ``stats.world_size/world_size``.
        ac_units: only these modules may be checkpointed (None: every module with discardable activations,
            leaves included, except the root; the root too when named).
        fsdp_units: FSDP units; their ancestors are never checkpoint units. None: the modules ``fully_shard`` was
            called on when the stats were collected on a mesh (:func:`sacplan.distributed.unit_modules`), else
            none; ``[]``: none.
        solver, time_limit_s, gap_rel, op_level, threads, exact, max_options, on_interrupt: the settings, as
            :class:`~sacplan.solver.options.SolverOptions`' fields; stopped by a limit, the best plan found is
            returned with ``status="time_limit"``, its proven ``gap`` and ``bound_ms``, and a one-line
            :class:`TimeLimitWarning`.
        options: all of those settings as one :class:`~sacplan.solver.options.SolverOptions` (not both).

    Raises:
        InfeasibleBudgetError: no plan fits; carries the computed smallest feasible budget.
        ConfigError: unknown module names, world_size < 1, a bad budget or setting.
        SolverError: unknown/missing solver, or the solver failed.
    """
    opts = resolve_options(options, dict(
        solver=solver, time_limit_s=time_limit_s, gap_rel=gap_rel, op_level=op_level, threads=threads, exact=exact,
        max_options=max_options, on_interrupt=on_interrupt,
    ))
    with limits.call(opts.time_limit_s, opts.work_limit):
        return _solve(tree, budget, world_size, ac_units, fsdp_units, opts)


def _solve(
    tree: ModuleTree, budget: int | float | str, world_size: int | None, ac_units: list[str] | None,
    fsdp_units: list[str] | None, opts: SolverOptions,
) -> Plan:
    """:func:`solve` inside its limits, as a pipeline: the problem, the strategies' decision, the judge's verdict,
    the plan."""
    t0 = time.perf_counter()
    problem = _problem(tree, world_size, ac_units, fsdp_units, exact=opts.exact_mode, max_options=opts.max_options,
                       solver=opts.backend)
    for note in problem.notes:
        warnings.warn(note, stacklevel=2)
    budget_bytes = parse_budget(budget, capacity_bytes=problem.tree.stats.device.memory_bytes)
    build_s = time.perf_counter() - t0
    if problem.baseline_peak() <= budget_bytes:
        return _not_needed(problem, budget_bytes, opts, build_s)
    found = find(problem, budget_bytes, opts)
    verdict = judge(problem, found, budget_bytes, opts)
    plan = _plan(problem, budget_bytes, found, verdict, opts, build_s)
    _warn_unproven(plan, opts)
    return plan


def _common(problem: SacProblem, budget_bytes: int) -> dict[str, Any]:
    """The plan's fields that describe the problem (budget, baseline, device, model)."""
    stats = problem.tree.stats
    return dict(
        budget_bytes=budget_bytes,
        baseline_peak_bytes=int(math.ceil(problem.baseline_peak() - 1e-6)),
        baseline_step_ms=float(stats.step_ms),
        world_size=problem.world_size,
        device_name=stats.device.name,
        model_name=stats.model_name,
        fingerprint=stats.fingerprint,
    )


def _not_needed(problem: SacProblem, budget_bytes: int, opts: SolverOptions, build_s: float) -> Plan:
    """The plan when the no-checkpointing peak already fits the budget."""
    stats, zeros = problem.tree.stats, np.zeros(problem.num_candidates)
    common = _common(problem, budget_bytes)
    return Plan(
        decisions=(),
        predicted_peak_bytes=common["baseline_peak_bytes"],
        recompute_ms=0.0,
        status="not needed",
        objective_ms=0.0,
        bound_ms=0.0,
        gap=0.0,
        solver="",
        build_s=build_s,
        solve_s=0.0,
        per_module_peak=per_module_peak(problem, problem.peaks(zeros, zeros)),
        min_feasible_bytes=None,
        meta={"candidates": problem.num_candidates, "op_level": opts.op_level,
              "baseline_peak_at": [stats.peak_phase, stats.peak_module]},
        **common,
    )


def _plan(problem: SacProblem, budget_bytes: int, found: Found, verdict: Verdict, opts: SolverOptions,
          build_s: float) -> Plan:
    """The :class:`Plan` of the judged decision, with the search's figures in ``meta``."""
    stats = problem.tree.stats
    timing = dict(found.timing_s)
    meta: dict[str, Any] = {
        "baseline_peak_at": [stats.peak_phase, stats.peak_module],
        "candidates": problem.num_candidates,
        **found.meta,
        # wall seconds of the parts (the only figures of a plan that differ from run to run)
        "timing_s": timing,
        "op_level": opts.op_level,
        "exact": problem.exact,
        # every candidate chose among its whole Pareto front: the optimum is over every plan (max_options=None)
        "options_complete": problem.options_complete(),
    }
    if verdict.fallback is not None:
        meta["fallback"] = verdict.fallback
    meta["model_recompute_ms"] = verdict.model_recompute_ms
    # what cut the search short: "work limit: <part>" (deterministic) or "wall clock: <part>" (the safety net:
    # this plan depends on the machine's speed and load)
    meta["stopped_by"] = [f"{what}: {where}" for what, where in limits.stops()]
    meta["work_limit_nodes"] = opts.work_limit
    meta["work_nodes"] = limits.nodes_spent()  # branch-and-bound nodes this call explored (the same on every run)
    return Plan(
        decisions=verdict.decisions,
        predicted_peak_bytes=verdict.predicted_peak_bytes,
        recompute_ms=float(sum(d.recompute_ms for d in verdict.decisions)),
        status=found.status,
        objective_ms=float(verdict.objective),
        bound_ms=float(found.bound),
        gap=float(verdict.gap),
        solver=opts.backend,
        build_s=build_s + timing.get("model", 0.0) + timing.get("heuristic", 0.0),
        solve_s=timing.get("tree_dp", 0.0) + timing.get("search", 0.0),
        per_module_peak=per_module_peak(problem, verdict.peaks),
        min_feasible_bytes=verdict.min_feasible,
        meta=meta,
        **_common(problem, budget_bytes),
    )


def _warn_unproven(plan: Plan, opts: SolverOptions) -> None:
    """One :class:`TimeLimitWarning` when a limit ended the search before its proof, or when the wall-clock
    safety net cut any part of it short (then the plan may differ from run to run)."""
    stops = limits.stops()
    if plan.status == TIME_LIMIT:
        warnings.warn(time_limit_message(opts.time_limit_s, plan.objective_ms, plan.bound_ms, plan.gap, stops,
                                         opts.work_limit), TimeLimitWarning, stacklevel=4)
    elif any(what == limits.WALL_CLOCK for what, _ in stops):
        warnings.warn("the wall-clock time limit cut part of the search short (" + ", ".join(plan.meta["stopped_by"])
                      + "): this plan may differ on a faster or less loaded machine and between ranks; raise "
                      "time_limit_s", TimeLimitWarning, stacklevel=4)
