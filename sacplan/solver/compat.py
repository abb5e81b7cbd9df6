"""``sac_milp`` with PyTorch's signature and meaning (``torch.distributed._tools.sac_ilp.sac_milp``).

``sac_milp(graph, memory_budget, world_size=1, ac_units=None, fsdp_units=None)`` returns
``(decisions: {fqn: discard ratio}, recompute_ms, peak_bytes)``; ``({}, 0, -1)`` when no plan fits (it does
not raise, like PyTorch's).

* ``graph`` a :class:`~sacplan.tree.ModuleTree`: sacplan's event-timeline memory model
  (:func:`sacplan.solver.solve`, ratio-only decisions, ``world_size`` = the ranks to plan for).
* ``graph`` a PyTorch ``ilp_utils.Graph`` (from ``parse_module_info``): PyTorch's own memory model, solved
  exactly (gap 1e-4 instead of 5%) with a tighter formulation. Per node ``i`` (GiB)::

      d_i  = ACM_i·r_i − (ACM_i − IA_i)·y_i,   (ACM_i − IA_i)/ACM_i·y_i ≤ r_i ≤ y_i
      m_i  = TA_i + AG_i − Σ_{j before i in fw_post_order} d_j + (P_1 + TG_i)/world_size ≤ budget
      TA_i + AG_i − Σ_{j before i} d_j ≥ 0            (the reference's a_i ≥ 0)
      rcp_i ≥ slope_s·r_i + intercept_s·y_i             (the reference's big-M on rct replaced)
      minimise Σ_i sac_runtime_i · rcp_i

  with the reference's unit rules (leaves, ``ac_units``, ``fsdp_units`` via ``is_submodule``), no nesting
  along ancestor chains of ``ad_matrix`` (one row per node instead of one per ancestor pair) and the sums
  ``Σ_{j before i} d_j`` as running-sum columns along ``fw_post_order``. The reference's ``max_m`` column is
  any value between the true peak and the budget; here the returned peak is the true predicted peak.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from sacplan.errors import ConfigError, InfeasibleBudgetError
from sacplan.solver import limits
from sacplan.solver.limits import DEFAULT_SOLVE_S
from sacplan.solver.backends import solve_model
from sacplan.solver.options import SolverOptions, resolve_options
from sacplan.solver.lp_proof import prove_by_lp_branching
from sacplan.solver.model import OPTIMAL, TIME_LIMIT, MilpModel
from sacplan.stats import ModelStats
from sacplan.tree import ModuleTree
from sacplan.units import GiB, parse_budget

_GIB = float(GiB)


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
        time_limit_s: wall-clock budget (s) of the call (default 60; None: none); <= 0 or NaN: ConfigError.
        solver, gap_rel, time_limit_s: as :class:`~sacplan.solver.options.SolverOptions`, or all settings as
            ``options`` (decisions are ratio-only here whatever its ``op_level``: PyTorch's meaning).

    Returns:
        ``({fqn: discard_ratio}, recompute_ms, peak_bytes)``, ratios to 4 digits (rounded up, so the plan
        never exceeds the budget: peak_bytes <= budget) and ms to 2 like PyTorch's; ``({}, 0, -1)`` when the budget is infeasible.
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
                fsdp_units=list(fsdp_units) if fsdp_units is not None else None,
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
        return _graph_milp(graph, budget / _GIB, world_size, ac_units, fsdp_units, opts)


def _is_submodule(desc: str, anc: str) -> bool:
    # PyTorch's ilp_utils.is_submodule (substring test, kept for identical meaning)
    return anc + "." in desc


def _graph_milp(
    graph: Any,
    budget_gib: float,
    world_size: int,
    ac_units: Sequence[str] | None,
    fsdp_units: Sequence[str] | None,
    opts: SolverOptions,
    _retry: bool = True,
) -> tuple[dict[str, float], float, int]:
    solver, gap_rel, time_limit_s = opts.backend, opts.gap_rel, opts.time_limit_s
    nodes: list[Mapping[str, Any]] = list(graph.nodes)
    n = len(nodes)
    if n == 0:
        return {}, 0, -1
    ws = float(world_size)
    # ---- candidates (the reference's y_i == 0 rules) ----------------------------------------------------
    ac_set = set(ac_units) if ac_units else None
    cand: list[int] = []
    ACM = np.zeros(n)
    IA = np.zeros(n)
    for i, nd in enumerate(nodes):
        IA[i] = float(nd["act_fw_per_module"]) / _GIB
        ACM[i] = max(float(nd["sac_memory"]), float(nd["act_fw_per_module"])) / _GIB
        if nd["is_leaf"]:
            continue
        if ac_set is not None and nd["fqn"] not in ac_set:
            continue
        if fsdp_units and any(_is_submodule(f, nd["fqn"]) for f in fsdp_units):
            continue
        if ACM[i] <= 0:
            continue  # nothing to discard (the reference would divide by zero here)
        cand.append(i)
    # ---- ancestor chains from the reference's ad_matrix -------------------------------------------------
    ad = np.asarray(graph.ad_matrix)
    cset = set(cand)
    anc_c: dict[int, list[int]] = {j: [i for i in cand if i < j and ad[i][j] == 1] for j in cand}
    parent_c = {j: (max(a) if a else -1) for j, a in anc_c.items()}
    laminar = all(
        set(anc_c[j]) == (set(anc_c[parent_c[j]]) | {parent_c[j]} if parent_c[j] >= 0 else set()) for j in cand
    )
    has_child = {i: False for i in cand}
    for j in cand:
        if parent_c[j] >= 0:
            has_child[parent_c[j]] = True
    # ---- model ------------------------------------------------------------------------------------------
    model = MilpModel(name="sacplan_sac_milp")
    y: dict[int, int] = {}
    r: dict[int, int] = {}
    q: dict[int, int] = {}
    for i in cand:
        y[i] = model.add_col(f"y{i}", 0.0, 1.0, True)
        r[i] = model.add_col(f"r{i}", 0.0, 1.0)
        q[i] = model.add_col(f"q{i}", 0.0, math.inf, False, float(nodes[i]["sac_runtime"]))
        model.add_row(f"ry{i}", [r[i], y[i]], [1.0, -1.0], ub=0.0)
        if ACM[i] > IA[i]:
            model.add_row(f"rmin{i}", [r[i], y[i]], [1.0, -(ACM[i] - IA[i]) / ACM[i]], lb=0.0)
        for s, (sl, ic) in enumerate(zip(nodes[i]["slopes"], nodes[i]["intercepts"])):
            sl, ic = float(sl), float(ic)
            if sl <= 0 and ic <= 0:
                continue
            model.add_row(f"line{i}_{s}", [q[i], r[i], y[i]], [1.0, -sl, -ic], lb=0.0)
    u: dict[int, int] = {}
    if laminar:
        for j in cand:
            p = parent_c[j]
            if p < 0:
                continue
            up = u.get(p, y[p])
            if has_child[j]:
                u[j] = model.add_col(f"u{j}", 0.0, 1.0)
                model.add_row(f"nest{j}", [u[j], up, y[j]], [1.0, -1.0, -1.0], lb=0.0, ub=0.0)
            else:
                model.add_row(f"nest{j}", [up, y[j]], [1.0, 1.0], ub=1.0)
    else:  # pragma: no cover - non-laminar names: the reference's pairwise rows
        for j in cand:
            for i in anc_c[j]:
                model.add_row(f"nest{i}_{j}", [y[i], y[j]], [1.0, 1.0], ub=1.0)
    # identical candidates: count columns (branched on first; see sacplan.solver.milp)
    classes: dict[tuple, list[int]] = {}
    for i in cand:
        nd = nodes[i]
        key = (ACM[i], IA[i], float(nd["sac_runtime"]), tuple(nd["slopes"]), tuple(nd["intercepts"]))
        classes.setdefault(key, []).append(i)
    kcols = []
    for members in sorted(classes.values()):
        if len(members) >= 2:
            k = model.add_col(f"K{members[0]}", 0.0, float(len(members)), True)
            kcols.append((k, members))
            model.add_row(f"Kdef{members[0]}", [k] + [y[i] for i in members], [1.0] + [-1.0] * len(members), lb=0, ub=0)
    # ---- memory: running sums along fw_post_order -----------------------------------------------------
    post = list(graph.fw_post_order)
    name2idx = {nd["fqn"]: i for i, nd in enumerate(nodes)}
    P1 = float(nodes[0]["param_per_module"]) / _GIB
    base = np.zeros(n)
    cap = np.zeros(n)
    pos = np.zeros(n, dtype=np.int64)
    for i, nd in enumerate(nodes):
        TA = float(nd["act_total"]) / _GIB
        AG = float(nd["act_grad_per_module"]) / _GIB
        TG = float(nd["grad_total"]) / _GIB
        cap[i] = TA + AG
        base[i] = TA + AG + (P1 + TG) / ws
        pos[i] = int(nd["pos_fw_post_order"])
    entries = [name2idx[f] for f in post]  # node index per fw_post_order position
    cand_pos = [p for p, i in enumerate(entries) if i in cset]
    kc_of_pos = np.searchsorted(np.asarray(cand_pos, dtype=np.int64), np.arange(len(post) + 1), side="left")
    if np.any(base - cap > budget_gib + 1e-12):  # the state part alone exceeds the budget
        return {}, 0, -1
    need: dict[int, float] = {}
    upper: dict[int, float] = {}
    for i in range(n):
        kc = int(kc_of_pos[pos[i]])
        nd_ = base[i] - budget_gib
        if nd_ > 0:
            if kc == 0:
                return {}, 0, -1
            need[kc] = max(need.get(kc, -math.inf), nd_)
        if kc > 0:
            upper[kc] = min(upper.get(kc, math.inf), cap[i])
    # dominance: F is non-decreasing in kc
    kcs = sorted(set(need) | set(upper))
    run = -math.inf
    lbs: dict[int, float] = {}
    for kc in kcs:
        if kc in need and need[kc] > run:
            lbs[kc] = need[kc]
            run = need[kc]
    run = math.inf
    ubs: dict[int, float] = {}
    for kc in reversed(kcs):
        if kc in upper and upper[kc] < run:
            ubs[kc] = upper[kc]
            run = upper[kc]
    Fcol: dict[int, int] = {}
    prev_col, prev_kc = -1, 0
    for kc in sorted(set(lbs) | set(ubs)):
        col = model.add_col(f"F{kc}", max(0.0, lbs.get(kc, 0.0)), ubs.get(kc, math.inf))
        ind, val = [col], [1.0]
        if prev_col >= 0:
            ind.append(prev_col)
            val.append(-1.0)
        for p in cand_pos[prev_kc:kc]:
            i = entries[p]
            ind += [r[i], y[i]]
            val += [-ACM[i], ACM[i] - IA[i]]
        model.add_row(f"Fdef{kc}", ind, val, lb=0.0, ub=0.0)
        Fcol[kc] = col
        prev_col, prev_kc = col, kc
    # ---- warm start: LP relaxation, round, re-solve the ratios -------------------------------------------
    warm, lp_bound = _warm_start(model, cand, y, parent_c, solver)
    from sacplan.solver.backends import lp_solver

    proven = prove_by_lp_branching(
        model, warm, [k for k, _ in kcols], gap_rel=gap_rel, lp_solver=lp_solver(solver), root_bound=lp_bound,
        solver_name=solver,
    )
    res = proven or solve_model(
        model,
        solver,
        gap_rel=gap_rel,
        gap_abs=1e-7,
        time_limit_s=time_limit_s,
        warm_start=warm,
        priorities={k: 1 for k, _ in kcols} or None,
        options=["preprocess off"],  # CBC preprocessing has cut off optima at tight budgets (see milp)
    )
    if res.x is None or res.status not in (OPTIMAL, TIME_LIMIT):
        return {}, 0, -1
    x = res.x
    decisions: dict[str, float] = {}
    rv = np.zeros(n)
    yv = np.zeros(n)
    for i in cand:
        if x[y[i]] > 0.5:
            yv[i] = 1.0
            # 4 digits like PyTorch's, rounded up: a larger ratio discards more, so the rounded plan stays
            # within the budget (to the nearest, it could exceed it by up to 0.5e-4 of a node's memory)
            rv[i] = _ratio_up(x[r[i]])
            decisions[nodes[i]["fqn"]] = rv[i]
    d = ACM * rv - (ACM - IA) * yv
    dpos = np.array([d[i] for i in entries])
    F = np.concatenate([[0.0], np.cumsum(dpos)])
    m = base - F[pos]
    peak = int(math.ceil(float(np.max(m)) * _GIB - 1e-6))
    budget_bytes = int(math.floor(budget_gib * _GIB))  # whole bytes, never above the budget given
    if peak > budget_bytes and _retry:
        # within the solver's feasibility tolerance above the budget: solve again just below it
        return _graph_milp(graph, budget_gib - (peak - budget_bytes + 1024) / _GIB, world_size, ac_units,
                           fsdp_units, opts, _retry=False)
    if peak > budget_bytes:
        return {}, 0, -1
    return decisions, round(float(res.objective), 2), peak


def _ratio_up(r: float) -> float:
    """A discard ratio in [0, 1] rounded up to 4 digits (never below the solver's value)."""
    return min(1.0, math.ceil(min(1.0, max(0.0, float(r))) * 1e4 - 1e-7) / 1e4)


def _warm_start(model: MilpModel, cand: list[int], y: dict[int, int], parent_c: dict[int, int], solver: str):
    from sacplan.solver.backends import lp_solver
    from sacplan.solver.model import relaxed, relaxed_with_fixed

    aux = lp_solver(solver)
    lp = solve_model(relaxed(model), aux)
    if lp.x is None:
        return None, None
    yl = {i: lp.x[y[i]] for i in cand}
    best = None
    for thr in (1e-6, 0.5):
        chosen = {i for i in cand if yl[i] > thr}
        # no nesting: keep the candidate with the larger LP value along each chain
        for i in sorted(chosen, key=lambda i: (-yl[i], i)):
            if i not in chosen:
                continue
            p = parent_c[i]
            while p >= 0:
                if p in chosen:
                    chosen.discard(i)
                    break
                p = parent_c[p]
        for j in list(chosen):
            p = parent_c[j]
            while p >= 0:
                if p in chosen and p != j:
                    chosen.discard(j)
                    break
                p = parent_c[p]
        fixed = relaxed_with_fixed(model, {y[i]: (1.0 if i in chosen else 0.0) for i in cand})
        sub = solve_model(fixed, aux)
        if sub.x is None:
            continue
        x = list(sub.x)
        for i in cand:
            x[y[i]] = 1.0 if i in chosen else 0.0
        # K columns are integral already (sums of fixed y)
        if model.max_violation(x) > 1e-7:
            continue
        if best is None or model.evaluate(x) < model.evaluate(best):
            best = x
    return best, lp.objective
