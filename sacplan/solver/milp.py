"""The public entry points of the module-level MILP: which modules to checkpoint and what fraction of each one's
activations to discard.

The memory model is :mod:`sacplan.timeline`; the formulation :mod:`sacplan.solver.formulation`. The layers, top down:

* this module: :func:`solve`, :func:`min_feasible_budget`, :func:`recompute_lower_bound`, :func:`baseline_peak`,
  and the budget MILP's solve to exactness in bytes (no-good cuts over solutions a solver's tolerance let
  through);
* :mod:`sacplan.solver.search`: the heuristic incumbent the branch-and-bound starts from (LP relaxation,
  rounding, LP re-solve over ratios, local descent), exact-byte repair, the min-peak MILP's plan;
* :mod:`sacplan.solver.realise`: the ratios realised with op-level selection (:func:`sacplan.solver.ops.select_ops`)
  as the :class:`~sacplan.plan.Plan`'s module decisions;
* :mod:`sacplan.solver.formulation`: the rows and columns of the budget MILP and the min-peak MILP;
* :mod:`sacplan.solver.problem`: :class:`~sacplan.solver.problem.SacProblem` reads a
  :class:`~sacplan.tree.ModuleTree` once (the step orders as running-sum positions, the memory timeline with
  per-rank state scaling) and evaluates any decision exactly in bytes;
* :mod:`sacplan.solver.candidates`: the modules that may be checkpointed and their trade-off lines.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any, Sequence

import numpy as np

from sacplan.errors import InfeasibleBudgetError, SolverError
from sacplan.plan import Plan
from sacplan.solver import limits
from sacplan.solver.backends import lp_solver, solve_model
from sacplan.solver.formulation import MilpIndex, build_budget_model, columns_for, decision_from
from sacplan.solver.lp_proof import prove_by_lp_branching
from sacplan.solver.limits import (
    DEFAULT_SOLVE_S,
    SolveInterrupted,
    lifted,
    time_limit_message,
)
from sacplan.solver.options import SolverOptions, resolve_options
from sacplan.solver.model import (
    INFEASIBLE,
    OPTIMAL,
    TIME_LIMIT,
    MilpModel,
    SolveResult,
    interrupted_result,
    relative_gap,
    relaxed,
)
from sacplan.solver.problem import SacProblem
from sacplan.solver.realise import per_module_peak, realise
from sacplan.solver.search import heuristic, repair, solve_min_peak
from sacplan.solver.tree_dp import solve_tree_dp
from sacplan.tree import ModuleTree
from sacplan.units import Bytes, parse_budget


class TimeLimitWarning(UserWarning):
    """The solver stopped at its time limit; the plan is the best found, with the gap stated."""


def baseline_peak(tree: ModuleTree, world_size: int | None = None) -> Bytes:
    """Predicted per-rank peak bytes without checkpointing (``max_e peak_e - S_e``), rounded up; a
    :class:`~sacplan.units.Bytes`, so it is read as bytes when passed back as a budget."""
    return Bytes(math.ceil(SacProblem(tree, world_size).baseline_peak() - 1e-6))


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

    A :class:`~sacplan.units.Bytes`: pass it straight back as ``solve(tree, min_feasible_budget(tree))``,
    read as bytes even for a small model whose minimum is under 1 MiB.

    ``time_limit_s`` (s, default 60; None: none) bounds the call; stopped there, the peak of the best plan found
    is returned (a budget some plan meets, not proven the smallest). ``solver``, ``threads``, ``time_limit_s``:
    as :class:`~sacplan.solver.options.SolverOptions`, or all settings as ``options`` (this call reads those
    three)."""
    opts = resolve_options(options, dict(solver=solver, threads=threads, time_limit_s=time_limit_s))
    with limits.call(opts.time_limit_s, opts.work_limit):
        problem = SacProblem(tree, world_size, ac_units, fsdp_units)
        return Bytes(solve_min_peak(problem, opts)[0])


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

    "Any plan" means any set of non-nested checkpoint units among the candidates, each with any op save
    list. Each module's cost is replaced by the LP relaxation of its op-level knapsack (see
    :func:`~sacplan.solver.ops.fractional_lines`: below every achievable option), and the resulting convex
    MILP is solved; its proven lower bound is returned. Comparing a plan's ``recompute_ms`` with this tells
    how far from the best possible plan it can at most be, e.g. whether a target ("a third of full
    checkpointing") is reachable at all. 0.0 when no checkpointing is needed. Stopped by ``time_limit_s`` before
    the search has a bound of its own, the bound of the MILP's LP relaxation is returned (weaker, still valid).
    ``solver``, ``threads``, ``time_limit_s``: as :class:`~sacplan.solver.options.SolverOptions`, or all settings
    as ``options`` (this call reads those three).

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
    problem = SacProblem(tree, world_size, ac_units, fsdp_units, relax=True)
    tree = problem.tree
    budget_bytes = parse_budget(budget, capacity_bytes=tree.stats.device.memory_bytes)
    if problem.baseline_peak() <= budget_bytes:
        return 0.0

    def infeasible() -> InfeasibleBudgetError:
        return InfeasibleBudgetError(budget_bytes, solve_min_peak(SacProblem(tree, world_size, ac_units, fsdp_units), opts)[0])

    if problem.num_candidates == 0 or problem.lower_bound_peak() > budget_bytes:
        raise infeasible()
    model, idx, trivially_infeasible = build_budget_model(problem, float(budget_bytes))
    if trivially_infeasible:
        raise infeasible()
    res = solve_model(model, solver, time_limit_s=opts.time_limit_s, gap_rel=1e-6, gap_abs=1e-9, threads=threads,
                      priorities={k: 1 for k in idx.K} or None, options=["preprocess off"])  # see _solve_budget_model
    if res.status == INFEASIBLE:
        raise infeasible()
    if not math.isfinite(res.bound):  # stopped before its root bound: the LP relaxation's, weaker but valid
        with lifted():  # one LP: a bound even from a spent budget
            lp = solve_model(relaxed(model), lp_solver(solver), threads=threads)
        if lp.status == INFEASIBLE:
            raise infeasible()
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

    The memory model is :mod:`sacplan.timeline` (every event's predicted bytes for a choice of checkpointed
    calls and discards); the MILP over it is :mod:`sacplan.solver.formulation` (linear in the model's size,
    no big-M), and the search that proves its optimum is described there and in :mod:`sacplan.solver.search`.
    Solutions are checked exactly in bytes and tiny tolerance violations repaired by raising ratios. With
    ``op_level`` each checkpointed module's ratio is realised by :func:`~sacplan.solver.ops.select_ops`
    (saving at most ``floor(A·(1-r))`` bytes), and the reported peak and recompute time are recomputed from
    the realised discards.

    Args:
        tree: the collected module tree (or the ModelStats ``collect`` returns).
        budget: per-rank memory budget: GiB number, bytes, ``"40GiB"``, ``"80%"`` of the target device...
            (:func:`sacplan.units.parse_budget`).
        world_size: ranks to plan for (None: as collected). State bytes scale by ``stats.world_size/world_size``.
        ac_units: only these modules may be checkpointed (None: every module with discardable activations,
            leaves included, except the root; the root too when named).
        fsdp_units: FSDP units; their ancestors are never checkpoint units.
        solver: ``"auto"`` (HiGHS when highspy is installed, else CBC), ``"cbc"`` (PuLP's bundled CBC) or
            ``"highs"`` (highspy).
        time_limit_s: wall-clock budget (s) of the whole call (default 60; None: no limit); when it runs out
            the best plan found is returned with ``status="time_limit"``, its proven ``gap`` and ``bound_ms``
            (and a one-line :class:`TimeLimitWarning`). <= 0 or NaN: :class:`ConfigError`.
        on_interrupt: Ctrl-C during the search: ``"raise"`` (KeyboardInterrupt) or ``"incumbent"`` (return the
            best plan so far, ``status="interrupted"``).
        gap_rel: relative optimality gap to prove.
        op_level: realise ratios with op-level selection (else ratio-only decisions).
        threads: solver threads (default 1: deterministic).
        exact: choose among exact op-level options (default: ``op_level``); False uses the trade-off lines
            and realises their ratios by op selection.
        max_options: options per module in exact mode (more: finer choice, larger MILP). None keeps each
            module's whole Pareto front of save lists: the MILP then ranges over *every* plan (any non-nested
            units, any save lists), and ``plan.meta["options_complete"]`` is True when no front had to be
            thinned — its proven optimum is the best plan there is under the memory model.
        options: all of the settings above (``solver`` … ``max_options``, ``on_interrupt``) as one
            :class:`~sacplan.solver.options.SolverOptions`, instead of the keywords (not both).

    Raises:
        InfeasibleBudgetError: no plan fits; carries the computed smallest feasible budget.
        ConfigError: unknown module names, world_size < 1, bad budget.
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
    """:func:`solve` inside its time budget."""
    t_start = time.perf_counter()
    solver, time_limit_s, op_level = opts.backend, opts.time_limit_s, opts.op_level
    problem = SacProblem(tree, world_size, ac_units, fsdp_units, exact=opts.exact_mode, max_options=opts.max_options,
                         solver=solver)
    for note in problem.notes:
        warnings.warn(note, stacklevel=2)
    tree = problem.tree
    stats = tree.stats
    budget_bytes = parse_budget(budget, capacity_bytes=stats.device.memory_bytes)
    base_f = problem.baseline_peak()
    baseline = int(math.ceil(base_f - 1e-6))
    nc = problem.num_candidates
    common: dict[str, Any] = dict(
        budget_bytes=budget_bytes,
        baseline_peak_bytes=baseline,
        baseline_step_ms=float(stats.step_ms),
        world_size=problem.world_size,
        device_name=stats.device.name,
        model_name=stats.model_name,
        fingerprint=stats.fingerprint,
    )
    if base_f <= budget_bytes:
        zeros = np.zeros(nc)
        return Plan(
            decisions=(),
            predicted_peak_bytes=baseline,
            recompute_ms=0.0,
            status="not needed",
            objective_ms=0.0,
            bound_ms=0.0,
            gap=0.0,
            solver="",
            build_s=time.perf_counter() - t_start,
            solve_s=0.0,
            per_module_peak=per_module_peak(problem, problem.peaks(zeros, zeros)),
            min_feasible_bytes=None,
            meta={"candidates": nc, "op_level": op_level, "baseline_peak_at": [stats.peak_phase, stats.peak_module]},
            **common,
        )

    def infeasible() -> InfeasibleBudgetError:
        mf, *_ = solve_min_peak(problem, opts)
        return InfeasibleBudgetError(budget_bytes, mf)

    if nc == 0 or problem.lower_bound_peak() > budget_bytes:
        raise infeasible()
    model, idx, trivially_infeasible = build_budget_model(problem, float(budget_bytes))
    if trivially_infeasible:
        raise infeasible()
    # exact mode, few events that can bind: the tree DP proves the optimum in well under a second (issue 14)
    why: list[str] = []
    t_dp = time.perf_counter()
    dp = solve_tree_dp(problem, float(budget_bytes), why=why) if problem.exact and opts.tree_dp else None
    dp_s = time.perf_counter() - t_dp
    t_h = time.perf_counter()
    start, lp_bound = heuristic(problem, model, idx, float(budget_bytes), opts) if dp is None else (None, None)
    heur_s = time.perf_counter() - t_h
    warm = columns_for(problem, model, idx, *start) if start is not None else None
    build_s = time.perf_counter() - t_start - dp_s  # the DP's time is solve time (below)
    t_solve = time.perf_counter() - dp_s
    counts = idx.K + [n for n, _, _ in idx.N]  # class counts: how many blocks checkpoint / reach each option
    try:
        if dp is not None:
            x = columns_for(problem, model, idx, dp.y, dp.r)
            res, cuts, by_lp = SolveResult(OPTIMAL, x, dp.cost_ms, dp.cost_ms, 0.0, dp.seconds, solver, "tree-dp"), 0, False
        else:
            res, cuts, by_lp = _solve_budget_model(
                problem, model, idx, warm, counts, float(budget_bytes), opts, lp_bound
            )
    except SolveInterrupted as e:
        if opts.on_interrupt != "incumbent":
            raise
        res, cuts, by_lp = interrupted_result(e.result, model, warm, solver), 0, False
    solve_s = time.perf_counter() - t_solve
    meta: dict[str, Any] = {
        "baseline_peak_at": [stats.peak_phase, stats.peak_module],
        "candidates": nc,
        "model": model.stats(),
        "events": len(problem.ev_base),
        "events_kept": idx.kept_events,
        "heuristic_ms": None if start is None else problem.cost(*start),
        "raw_status": res.raw_status,
        "lp_bound_ms": lp_bound,
        # wall seconds of the parts (the only figures of a plan that differ from run to run)
        "timing_s": {"tree_dp": dp_s, "heuristic": heur_s},
        # "lp": the incumbent met the LP bounds (after branching on count columns only); else the MILP solver
        "proved_by": "tree-dp" if dp is not None else "lp" if by_lp else solver,
        # the tree DP's figures (s, binding events, largest front), or why it did not apply (None: not tried,
        # i.e. lines mode or SolverOptions(tree_dp=False))
        "tree_dp": (why or [None])[0] if dp is None else
        {"binding_events": len(dp.binding), "max_front": max(dp.front_sizes, default=0)},
        # solutions the solver accepted within its tolerance that exceed the budget in exact bytes, cut off
        "tolerance_cuts": cuts,
        "op_level": op_level,
        "exact": problem.exact,
        # every candidate chose among its whole Pareto front: the optimum is over every plan (max_options=None)
        "options_complete": problem.options_complete(),
    }
    min_feasible: int | None = None
    if res.x is None:
        if res.status == INFEASIBLE:
            mf, y_mp, r_mp, _, _ = solve_min_peak(problem, opts)
            if mf > budget_bytes:
                raise InfeasibleBudgetError(budget_bytes, mf)
            # solver tolerance at the very edge: the min-peak solution fits exactly
            y, r = y_mp, r_mp
            objective, bound, gap, status = problem.cost(y, r), -math.inf, math.inf, TIME_LIMIT
            meta["fallback"] = "min-peak solution (the budget MILP was declared infeasible at the feasibility edge)"
            min_feasible = mf
        elif res.status == TIME_LIMIT:
            raise SolverError(
                f"{solver} stopped ({', '.join(f'{w}: {p}' for w, p in limits.stops()) or 'time limit'}) before "
                f"finding any plan (time limit {time_limit_s} s, work limit {opts.work_limit} nodes); raise "
                "time_limit_s (CLI: --time-limit) or work_limit"
            )
        else:
            raise SolverError(f"{solver} failed on the SAC MILP: {res.raw_status}")
    else:
        y, r = decision_from(problem, idx, res.x)
        objective, bound, gap, status = res.objective, res.bound, res.gap, res.status
        if lp_bound is not None and math.isfinite(lp_bound) and not bound >= lp_bound:
            # stopped before the search had its own bound: the root LP relaxation bounds every plan
            bound = min(objective, lp_bound)
            gap = relative_gap(objective, bound)
        slack = problem.options_slack_ms()
        if slack > 0:  # options built past the time budget: bound the exact options' plans too, not proven
            meta["options_slack_ms"] = slack
            bound = bound - slack
            gap = relative_gap(objective, bound)
            status = TIME_LIMIT if status == OPTIMAL else status
    r_fixed = repair(problem, y, r, float(budget_bytes))
    if r_fixed is None:
        mf, y_mp, r_mp, _, _ = solve_min_peak(problem, opts)
        if mf > budget_bytes:
            raise InfeasibleBudgetError(budget_bytes, mf)
        y, r = y_mp, r_mp
        meta["fallback"] = "min-peak solution (the solver's plan violated the budget beyond repair)"
        min_feasible = mf
    else:
        r = r_fixed
    r = problem.snap(y, r)  # exact mode: repaired ratios up to the next option (discards only grow)
    # a checkpoint that discards nothing only adds its recompute transient: drop it (every event falls or stays)
    y = np.where(r <= 1e-12, 0.0, y)
    r = r * y
    if status == TIME_LIMIT and math.isfinite(objective):  # unproven: state what the plan returned costs (a repair
        objective = max(objective, problem.cost(y, r))  # above may have raised it past the solver's objective)
        gap = relative_gap(objective, bound)
    if not problem.nesting_ok(y):  # pragma: no cover - guaranteed by the constraints
        raise SolverError("internal error: the solver returned nested checkpoint units")
    meta["model_recompute_ms"] = problem.cost(y, r)
    decisions, y_real, r_real = realise(problem, y, r, opts)
    m = problem.peaks(y_real, r_real)
    predicted = int(math.ceil(float(np.max(m)) - 1e-6))
    if predicted > budget_bytes:  # pragma: no cover - realised discards only ever grow
        raise SolverError(f"internal error: realised plan peaks at {predicted} > budget {budget_bytes}")
    stops = limits.stops()
    # what cut the search short: "work limit: <part>" (deterministic) or "wall clock: <part>" (the safety net:
    # this plan depends on the machine's speed and load)
    meta["stopped_by"] = [f"{what}: {where}" for what, where in stops]
    meta["work_limit_nodes"] = opts.work_limit
    meta["work_nodes"] = limits.nodes_spent()  # branch-and-bound nodes this call explored (the same on every run)
    if status == TIME_LIMIT:
        warnings.warn(time_limit_message(time_limit_s, objective, bound, gap, stops, opts.work_limit),
                      TimeLimitWarning, stacklevel=3)
    elif any(what == limits.WALL_CLOCK for what, _ in stops):
        warnings.warn("the wall-clock time limit cut part of the search short (" + ", ".join(meta["stopped_by"])
                      + "): this plan may differ on a faster or less loaded machine and between ranks; raise "
                      "time_limit_s", TimeLimitWarning, stacklevel=3)
    return Plan(
        decisions=tuple(decisions),
        predicted_peak_bytes=predicted,
        recompute_ms=float(sum(d.recompute_ms for d in decisions)),
        status=status,
        objective_ms=float(objective),
        bound_ms=float(bound),
        gap=float(gap),
        solver=solver,
        build_s=build_s,
        solve_s=solve_s,
        per_module_peak=per_module_peak(problem, m),
        min_feasible_bytes=min_feasible,
        meta=meta,
        **common,
    )


#: rounds of :func:`_solve_budget_model` before it hands over to ratio repair
_MAX_CUTS = 32


def _solve_budget_model(
    problem: SacProblem,
    model: MilpModel,
    idx: MilpIndex,
    warm: list[float] | None,
    counts: list[int],
    budget: float,
    opts: SolverOptions,
    lp_bound: float | None,
) -> tuple[SolveResult, int, bool]:
    """Solve the budget MILP; in exact mode, also to exactness in bytes.

    Returns (result, cuts added, whether the LP bounds alone proved it: :func:`prove_by_lp_branching`).

    A solver accepts rows violated by up to its feasibility tolerance (~1e-9 GiB, about a byte here), so at a
    budget met with equality it may return a plan a few bytes over. In exact mode every column is fixed by
    the binary columns (``y``, option levels ``w``), so such a solution is removed exactly by a no-good cut
    over them — ``Σ_{x_j=0} x_j + Σ_{x_j=1} (1 - x_j) ≥ 1`` — which excludes that one assignment and no
    other, and the model is solved again: the optimum over exactly feasible plans, proven. (Repairing the
    ratio of some checkpointed module instead, as the lines mode does, is not optimal in exact mode: it jumps
    to a dearer option, or to the min-peak fallback when nothing was checkpointed.) CBC runs with
    preprocessing off: on budgets met with equality its preprocessing has cut off the optimum (a 3-module
    tree: 25.912 ms "optimal" against 22.994 ms with it off, and by brute force).
    """
    solver, gap_rel = opts.backend, opts.gap_rel
    binaries = (idx.y + [j for cols in idx.w.values() for j in cols]) if problem.exact else []
    cuts = 0
    while True:
        proven = prove_by_lp_branching(
            model, warm, counts, gap_rel=gap_rel, lp_solver=lp_solver(solver), root_bound=lp_bound if not cuts else None,
            solver_name=solver,
        )
        res = proven or solve_model(
            model,
            solver,
            gap_rel=gap_rel,
            gap_abs=1e-7,
            threads=opts.threads,
            warm_start=warm,
            # branch on class counts first (CBC's preprocessing would substitute the count columns away), then
            # on how many members of a class reach each option level: llama-small x48 at 0.5 GiB, gap 5.8e-4
            # after 500 s without the level counts, proven in ~15 s with them (issue 14)
            priorities={**{k: 1 for k in idx.K}, **{n: 2 for n, _, _ in idx.N}} or None,
            options=["preprocess off"],
        )
        if res.x is None or not binaries or cuts >= _MAX_CUTS:
            return res, cuts, proven is not None
        y, r = decision_from(problem, idx, res.x)
        if math.ceil(problem.peak(y, problem.snap(y, r)) - 1e-6) <= budget:
            return res, cuts, proven is not None
        if limits.nodes_left() == 0 or limits.past_deadline("no-good cuts"):
            # no work left for another round: :func:`_solve` repairs the few bytes over, unproven
            if res.status == OPTIMAL:
                res = dataclasses.replace(res, status=TIME_LIMIT)
            return res, cuts, False
        ones = [j for j in binaries if res.x[j] > 0.5]
        zeros = [j for j in binaries if res.x[j] <= 0.5]
        model.add_row(f"cut{cuts}", zeros + ones, [1.0] * len(zeros) + [-1.0] * len(ones), lb=1.0 - len(ones))
        cuts += 1

