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

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from sacplan.errors import ConfigError, InfeasibleBudgetError
from sacplan.solver import limits
from sacplan.solver.limits import DEFAULT_SOLVE_S
from sacplan.solver.backends import lp_solver, solve_model
from sacplan.solver.budget_milp import prove_or_search
from sacplan.solver.formulation import count_column, line_rows, nesting_rows, ratio_rows
from sacplan.solver.options import SolverOptions, resolve_options
from sacplan.solver.model import OPTIMAL, TIME_LIMIT, MilpModel, relaxed, relaxed_with_fixed
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


@dataclasses.dataclass
class _GraphMilp:
    """PyTorch's Graph as the MILP of the module docstring: the nodes, the candidates and their per-node terms
    (GiB), the model and its columns (``y``, ``r``, ``q`` per candidate; class counts ``kcols``)."""

    nodes: list[Mapping[str, Any]]
    cand: list[int]
    ACM: np.ndarray
    IA: np.ndarray
    parent_c: dict[int, int]
    model: MilpModel = dataclasses.field(default_factory=lambda: MilpModel(name="sacplan_sac_milp"))
    y: dict[int, int] = dataclasses.field(default_factory=dict)
    r: dict[int, int] = dataclasses.field(default_factory=dict)
    kcols: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)


def _graph_milp(
    graph: Any,
    budget_gib: float,
    world_size: int,
    ac_units: Sequence[str] | None,
    fsdp_units: Sequence[str] | None,
    opts: SolverOptions,
    _retry: bool = True,
) -> tuple[dict[str, float], float, int]:
    nodes: list[Mapping[str, Any]] = list(graph.nodes)
    if not nodes:
        return {}, 0, -1
    g = _units(graph, nodes, ac_units, fsdp_units)
    memory = _Memory(graph, g, float(world_size))
    if not memory.add_rows(g, budget_gib):
        return {}, 0, -1
    res = _solve_graph_model(g, opts)
    if res.x is None or res.status not in (OPTIMAL, TIME_LIMIT):
        return {}, 0, -1
    decisions, peak = memory.read(g, res.x)
    budget_bytes = int(math.floor(budget_gib * _GIB))  # whole bytes, never above the budget given
    if peak > budget_bytes and _retry:
        # within the solver's feasibility tolerance above the budget: solve again just below it
        return _graph_milp(graph, budget_gib - (peak - budget_bytes + 1024) / _GIB, world_size, ac_units,
                           fsdp_units, opts, _retry=False)
    if peak > budget_bytes:
        return {}, 0, -1
    return decisions, round(float(res.objective), 2), peak


def _units(
    graph: Any, nodes: list[Mapping[str, Any]], ac_units: Sequence[str] | None, fsdp_units: Sequence[str] | None
) -> _GraphMilp:
    """The candidates (the reference's y_i == 0 rules), their columns, no-nesting rows and class counts."""
    n = len(nodes)
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
    # ancestor chains from the reference's ad_matrix
    ad = np.asarray(graph.ad_matrix)
    anc_c: dict[int, list[int]] = {j: [i for i in cand if i < j and ad[i][j] == 1] for j in cand}
    parent_c = {j: (max(a) if a else -1) for j, a in anc_c.items()}
    g = _GraphMilp(nodes, cand, ACM, IA, parent_c)
    _unit_columns(g)
    _nesting_rows(g, anc_c)
    _class_counts(g)
    return g


def _unit_columns(g: _GraphMilp) -> None:
    """Per candidate: y (checkpoint), r (discard ratio), q (recompute fraction above every trade-off line), with
    the formulation's rows on them."""
    model, ACM, IA = g.model, g.ACM, g.IA
    for i in g.cand:
        y = g.y[i] = model.add_col(f"y{i}", 0.0, 1.0, True)
        r = g.r[i] = model.add_col(f"r{i}", 0.0, 1.0)
        q = model.add_col(f"q{i}", 0.0, math.inf, False, float(g.nodes[i]["sac_runtime"]))
        ratio_rows(model, i, y, r, (ACM[i] - IA[i]) / ACM[i])
        line_rows(model, i, q, r, y, g.nodes[i]["slopes"], g.nodes[i]["intercepts"])


def _nesting_rows(g: _GraphMilp, anc_c: dict[int, list[int]]) -> None:
    """No checkpointed candidate inside another: one row per candidate along laminar chains (``u`` columns carry
    "an ancestor is checkpointed"), else the reference's pairwise rows."""
    model, y, parent_c = g.model, g.y, g.parent_c
    laminar = all(
        set(anc_c[j]) == (set(anc_c[parent_c[j]]) | {parent_c[j]} if parent_c[j] >= 0 else set()) for j in g.cand
    )
    if not laminar:  # pragma: no cover - non-laminar names: the reference's pairwise rows
        for j in g.cand:
            for i in anc_c[j]:
                model.add_row(f"nest{i}_{j}", [y[i], y[j]], [1.0, 1.0], ub=1.0)
        return
    has_child = {i: False for i in g.cand}
    for j in g.cand:
        if parent_c[j] >= 0:
            has_child[parent_c[j]] = True
    nesting_rows(model, y, parent_c, has_child)


def _class_counts(g: _GraphMilp) -> None:
    """Identical candidates: count columns ``K = Σ_class y`` (branched on first; see sacplan.solver.budget_milp)."""
    classes: dict[tuple, list[int]] = {}
    for i in g.cand:
        nd = g.nodes[i]
        key = (g.ACM[i], g.IA[i], float(nd["sac_runtime"]), tuple(nd["slopes"]), tuple(nd["intercepts"]))
        classes.setdefault(key, []).append(i)
    for members in sorted(classes.values()):
        if len(members) >= 2:
            g.kcols.append((count_column(g.model, "K", f"{members[0]}", [g.y[i] for i in members]), members))


class _Memory:
    """The reference's memory per node along ``fw_post_order`` (GiB): ``base`` (no checkpointing), ``cap``
    (what discards can lower), each node's position, and the candidates' positions for the running sums."""

    def __init__(self, graph: Any, g: _GraphMilp, ws: float) -> None:
        nodes, n = g.nodes, len(g.nodes)
        post = list(graph.fw_post_order)
        name2idx = {nd["fqn"]: i for i, nd in enumerate(nodes)}
        P1 = float(nodes[0]["param_per_module"]) / _GIB
        self.base, self.cap, self.pos = np.zeros(n), np.zeros(n), np.zeros(n, dtype=np.int64)
        for i, nd in enumerate(nodes):
            TA = float(nd["act_total"]) / _GIB
            AG = float(nd["act_grad_per_module"]) / _GIB
            TG = float(nd["grad_total"]) / _GIB
            self.cap[i] = TA + AG
            self.base[i] = TA + AG + (P1 + TG) / ws
            self.pos[i] = int(nd["pos_fw_post_order"])
        self.entries = [name2idx[f] for f in post]  # node index per fw_post_order position
        cset = set(g.cand)
        self.cand_pos = [p for p, i in enumerate(self.entries) if i in cset]
        self.kc_of_pos = np.searchsorted(np.asarray(self.cand_pos, dtype=np.int64), np.arange(len(post) + 1),
                                         side="left")

    def add_rows(self, g: _GraphMilp, budget_gib: float) -> bool:
        """The running-sum columns ``F`` with each node's need as a bound (dominated ones dropped); False when
        no plan can fit (the state alone, or a need before any candidate)."""
        if np.any(self.base - self.cap > budget_gib + 1e-12):  # the state part alone exceeds the budget
            return False
        need: dict[int, float] = {}
        upper: dict[int, float] = {}
        for i in range(len(g.nodes)):
            kc = int(self.kc_of_pos[self.pos[i]])
            nd_ = self.base[i] - budget_gib
            if nd_ > 0:
                if kc == 0:
                    return False
                need[kc] = max(need.get(kc, -math.inf), nd_)
            if kc > 0:
                upper[kc] = min(upper.get(kc, math.inf), self.cap[i])
        lbs, ubs = _monotone_bounds(need, upper)
        prev_col, prev_kc = -1, 0
        for kc in sorted(set(lbs) | set(ubs)):
            col = g.model.add_col(f"F{kc}", max(0.0, lbs.get(kc, 0.0)), ubs.get(kc, math.inf))
            ind, val = [col], [1.0]
            if prev_col >= 0:
                ind.append(prev_col)
                val.append(-1.0)
            for p in self.cand_pos[prev_kc:kc]:
                i = self.entries[p]
                ind += [g.r[i], g.y[i]]
                val += [-g.ACM[i], g.ACM[i] - g.IA[i]]
            g.model.add_row(f"Fdef{kc}", ind, val, lb=0.0, ub=0.0)
            prev_col, prev_kc = col, kc
        return True

    def read(self, g: _GraphMilp, x: Sequence[float]) -> tuple[dict[str, float], int]:
        """The decisions of solution ``x`` (ratios rounded up to 4 digits) and their true predicted peak (bytes)."""
        n = len(g.nodes)
        decisions: dict[str, float] = {}
        rv = np.zeros(n)
        yv = np.zeros(n)
        for i in g.cand:
            if x[g.y[i]] > 0.5:
                yv[i] = 1.0
                # 4 digits like PyTorch's, rounded up: a larger ratio discards more, so the rounded plan stays
                # within the budget (to the nearest, it could exceed it by up to 0.5e-4 of a node's memory)
                rv[i] = _ratio_up(x[g.r[i]])
                decisions[g.nodes[i]["fqn"]] = rv[i]
        d = g.ACM * rv - (g.ACM - g.IA) * yv
        dpos = np.array([d[i] for i in self.entries])
        F = np.concatenate([[0.0], np.cumsum(dpos)])
        m = self.base - F[self.pos]
        return decisions, int(math.ceil(float(np.max(m)) * _GIB - 1e-6))


def _monotone_bounds(need: dict[int, float], upper: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
    """Dominance: F is non-decreasing in kc, so only needs above every earlier one and caps below every later
    one bind."""
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
    return lbs, ubs


def _solve_graph_model(g: _GraphMilp, opts: SolverOptions) -> Any:
    """The warm start (LP relaxation, rounded, ratios re-solved), then the budget MILP's search from it."""
    warm, lp_bound = _warm_start(g.model, g.cand, g.y, g.parent_c, opts.backend)
    return prove_or_search(g.model, warm, {k: 1 for k, _ in g.kcols}, opts, lp_bound)[0]


def _ratio_up(r: float) -> float:
    """A discard ratio in [0, 1] rounded up to 4 digits (never below the solver's value)."""
    return min(1.0, math.ceil(min(1.0, max(0.0, float(r))) * 1e4 - 1e-7) / 1e4)


def _warm_start(model: MilpModel, cand: list[int], y: dict[int, int], parent_c: dict[int, int], solver: str):
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
