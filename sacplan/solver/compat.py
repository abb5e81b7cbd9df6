"""``sac_milp`` with PyTorch's signature and meaning (``torch.distributed._tools.sac_ilp.sac_milp``).

``sac_milp(graph, memory_budget, world_size=1, ac_units=None, fsdp_units=None)`` returns
``(decisions: {fqn: discard ratio}, recompute_ms, peak_bytes)``; ``({}, 0, -1)`` when no plan fits (it does
not raise, like PyTorch's).

* ``graph`` a :class:`~sacplan.tree.ModuleTree`: sacplan's event-timeline memory model
  (:func:`sacplan.solver.solve`, ratio-only decisions, ``world_size`` = the ranks to plan for).
* ``graph`` a PyTorch ``ilp_utils.Graph`` (from ``parse_module_info``): PyTorch's own memory model, as a
  :class:`~sacplan.solver.problem.SacProblem` with one forward event per node (:func:`graph_problem`), solved by the
  budget MILP (gap 1e-4, not the reference's 5%) and repaired to fit exactly. Per node ``i`` (bytes)::

      d_i  = ACM_i·r_i − (ACM_i − IA_i)·y_i,   (ACM_i − IA_i)/ACM_i·y_i ≤ r_i ≤ y_i
      m_i  = TA_i + AG_i − Σ_{j before i in fw_post_order} d_j + (P_1 + TG_i)/world_size ≤ budget
      TA_i + AG_i − Σ_{j before i} d_j ≥ 0            (the reference's a_i ≥ 0)
      rcp_i ≥ slope_s·r_i + intercept_s·y_i             (the reference's big-M on rct replaced)
      minimise Σ_i sac_runtime_i · rcp_i

  with the reference's unit rules (leaves, ``ac_units``, ``fsdp_units`` via ``is_submodule``) and no nesting
  along the ancestor chains of ``ad_matrix`` (laminar: each node's descendants are the contiguous pre-order run
  after it). A candidate is a call with discardable bytes ``A = ACM``, overhead ``o = ACM − IA`` and the node's
  trade-off lines; ``d_i`` is the running sums' ``A·r − o·y``. The reference's ``max_m`` column is any value
  between the true peak and the budget; here the returned peak is the true predicted peak.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from sacplan.errors import ConfigError, InfeasibleBudgetError
from sacplan.solver import limits
from sacplan.solver.budget_milp import solve_budget_milp
from sacplan.solver.candidates import Candidate
from sacplan.solver.formulation import build_budget_model, decision_from
from sacplan.solver.limits import DEFAULT_SOLVE_S
from sacplan.solver.options import SolverOptions, resolve_options
from sacplan.solver.problem import SacProblem
from sacplan.solver.repair import repair
from sacplan.stats import ModelStats
from sacplan.timeline import FW, Timeline
from sacplan.tree import ModuleTree
from sacplan.units import GiB, parse_budget


def _budget_bytes(memory_budget: float | int | str) -> int:
    """PyTorch's ``memory_budget`` is GiB (any number); strings go through :func:`parse_budget`."""
    if isinstance(memory_budget, str):
        return parse_budget(memory_budget)
    return int(math.floor(float(memory_budget) * GiB))  # whole bytes, never above the budget given


def sac_milp(
    graph: Any,
    memory_budget: float | int | str,
    world_size: int = 1,
    ac_units: Sequence[str] | None = None,
    fsdp_units: Sequence[str] | None = None,
    *,
    solver: str = "auto",
    gap_rel: float = 1e-4,
    time_limit_s: float | None = DEFAULT_SOLVE_S,
    options: SolverOptions | None = None,
) -> tuple[dict[str, float], float, int]:
    """PyTorch-compatible SAC MILP (see the module docstring).

    Args:
        graph: a :class:`~sacplan.tree.ModuleTree` or PyTorch's ``ilp_utils.Graph``.
        memory_budget: GiB (a number, PyTorch's meaning) or a string such as ``"40GiB"``.
        world_size: ranks sharing parameters and gradients (FSDP).
        ac_units: allowed checkpoint units (fqns as the graph names them).
        fsdp_units: FSDP units (no checkpoint unit may contain one).
        solver, gap_rel, time_limit_s: as :class:`~sacplan.solver.options.SolverOptions` (time limit: the call's,
            default 60 s), or all settings as ``options`` (decisions are ratio-only whatever its ``op_level``).

    Returns:
        ``({fqn: discard_ratio}, recompute_ms, peak_bytes)``, ratios to 4 digits (rounded up: peak_bytes <= budget)
        and ms to 2 like PyTorch's; ``({}, 0, -1)`` when the budget is infeasible.
    """
    opts = resolve_options(options, dict(solver=solver, gap_rel=gap_rel, time_limit_s=time_limit_s))
    budget = _budget_bytes(memory_budget)
    if isinstance(graph, ModelStats):
        graph = ModuleTree(graph)
    if not isinstance(graph, ModuleTree) and not hasattr(graph, "nodes"):
        raise ConfigError(
            f"sac_milp needs a sacplan.ModuleTree (or the ModelStats sacplan.collect() returns) or PyTorch's "
            f"ilp_utils.Graph, got {type(graph).__name__}"
        )
    if isinstance(graph, ModuleTree):
        from sacplan.solver.milp import solve

        try:
            plan = solve(
                graph,
                budget,
                world_size=world_size,
                ac_units=list(ac_units) if ac_units is not None else None,
                fsdp_units=list(fsdp_units or ()),  # PyTorch's None: no FSDP units (solve's None: the stats' own)
                options=opts.replace(op_level=False),
            )
        except InfeasibleBudgetError:
            return {}, 0, -1
        return (
            {d.fqn: _ratio_up(d.discard_ratio) for d in plan.decisions},
            round(plan.recompute_ms, 2),
            int(plan.predicted_peak_bytes),
        )
    with limits.call(opts.time_limit_s, opts.work_limit):
        return _graph_milp(graph, budget, world_size, ac_units, fsdp_units, opts)


def _graph_milp(
    graph: Any, budget: int, world_size: int, ac_units: Sequence[str] | None, fsdp_units: Sequence[str] | None,
    opts: SolverOptions,
) -> tuple[dict[str, float], float, int]:
    """:func:`sac_milp` on PyTorch's Graph at ``budget`` bytes: its problem, the budget MILP, the repair."""
    nodes: list[Mapping[str, Any]] = list(graph.nodes)
    if not nodes:
        return {}, 0, -1
    problem, caps = graph_problem(graph, nodes, world_size, ac_units, fsdp_units)
    if problem.baseline_peak() <= budget:
        return {}, 0.0, int(math.ceil(problem.baseline_peak() - 1e-6))
    if problem.num_candidates == 0 or problem.lower_bound_peak() > budget:
        return {}, 0, -1
    # the reference's a_i >= 0 as caps on the running sum F: what is discarded so far never exceeds what exists
    model, idx, trivially_infeasible = build_budget_model(problem, float(budget), caps)
    if trivially_infeasible:
        return {}, 0, -1
    res = solve_budget_milp(problem, model, idx, float(budget), opts).result
    if res.x is None:
        return {}, 0, -1
    y, r = decision_from(problem, idx, res.x)
    r = repair(problem, y, r, float(budget))  # a solver's tolerance: raise ratios until it fits in bytes
    if r is None:
        return {}, 0, -1
    # 4 digits like PyTorch's, rounded up: a larger ratio discards more, so the rounded plan stays within the
    # budget (to the nearest, it could exceed it by up to 0.5e-4 of a node's memory)
    ratios = np.array([_ratio_up(v) for v in r]) * y
    decisions = {c.fqn: float(ratios[c.slot]) for c in problem.candidates if y[c.slot] > 0.5}
    return decisions, round(float(res.objective), 2), int(math.ceil(problem.peak(y, ratios) - 1e-6))


def graph_problem(
    graph: Any, nodes: list[Mapping[str, Any]], world_size: int, ac_units: Sequence[str] | None,
    fsdp_units: Sequence[str] | None,
) -> tuple[SacProblem, dict[int, float]]:
    """PyTorch's Graph as a :class:`SacProblem` (see the module docstring): one forward event per node at its
    ``fw_post_order`` position, the candidates with their nesting, and the caps of the running sum ``F`` (bytes at
    each candidate-entry count: the reference's ``a_i ≥ 0``, only those below every later one)."""
    n = len(nodes)
    P1 = float(nodes[0]["param_per_module"])
    cap = np.array([float(nd["act_total"]) + float(nd["act_grad_per_module"]) for nd in nodes])
    base = cap + np.array([(P1 + float(nd["grad_total"])) / world_size for nd in nodes])
    pos = np.array([int(nd["pos_fw_post_order"]) for nd in nodes], dtype=np.int64)
    timeline = Timeline(
        world_size=int(world_size), state_keep=1.0, phase=np.full(n, FW, dtype=np.int64),
        module=tuple(nd["fqn"] for nd in nodes), base=base, pos=pos, extra=np.zeros(n),
        fw_entries=tuple((f, 0) for f in graph.fw_post_order), bw_entries=(), active_event=np.zeros(0, dtype=np.int64),
        active_pos=np.zeros(0, dtype=np.int64), fw_pos=pos, bw_pos=np.zeros(n, dtype=np.int64),
        mixed=np.zeros(n, dtype=bool),
    )
    problem = SacProblem.of_timeline(timeline, _candidates(graph, nodes, ac_units, fsdp_units))
    upper: dict[int, float] = {}
    for i in range(n):
        kc = int(problem.kc_fw[pos[i]])
        if kc > 0:
            upper[kc] = min(upper.get(kc, math.inf), float(cap[i]))
    caps, run = {}, math.inf
    for kc in sorted(upper, reverse=True):  # F is non-decreasing in kc: a cap above a later one never binds
        if upper[kc] < run:
            caps[kc] = run = upper[kc]
    return problem, dict(sorted(caps.items()))


def _candidates(
    graph: Any, nodes: list[Mapping[str, Any]], ac_units: Sequence[str] | None, fsdp_units: Sequence[str] | None
) -> list[Candidate]:
    """The reference's units (its ``y_i == 0`` rules) with something to discard, in pre-order, each with its nearest
    candidate ancestor of ``ad_matrix``."""
    ac_set = set(ac_units) if ac_units else None
    chosen = [
        i for i, nd in enumerate(nodes)
        if not nd["is_leaf"] and (ac_set is None or nd["fqn"] in ac_set)
        and not (fsdp_units and any(nd["fqn"] + "." in f for f in fsdp_units))  # ilp_utils.is_submodule's test
        and max(float(nd["sac_memory"]), float(nd["act_fw_per_module"])) > 0  # (the reference divides by it)
    ]
    ad = np.asarray(graph.ad_matrix)
    parent = [max((s for s, a in enumerate(chosen) if a < j and ad[a][j] == 1), default=-1) for j in chosen]
    out = []
    for s, i in enumerate(chosen):
        nd = nodes[i]
        IA = float(nd["act_fw_per_module"])
        ACM = max(float(nd["sac_memory"]), IA)
        out.append(Candidate(
            slot=s, node=i, fqn=nd["fqn"], calls=1, max_discard_bytes=ACM, act_bytes=(ACM,),  # type: ignore[arg-type]
            recompute_ms=float(nd["sac_runtime"]), slopes=tuple(float(v) for v in nd["slopes"]),
            intercepts=tuple(float(v) for v in nd["intercepts"]), parent_slot=parent[s], has_child=s in parent,
            overhead_bytes=(ACM - IA,), min_ratio=(ACM - IA) / ACM,
        ))
    return out


def _ratio_up(r: float) -> float:
    """A discard ratio in [0, 1] rounded up to 4 digits (never below the solver's value)."""
    return min(1.0, math.ceil(min(1.0, max(0.0, float(r))) * 1e4 - 1e-7) / 1e4)
