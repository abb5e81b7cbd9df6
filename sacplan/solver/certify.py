"""How good can any plan be? The best plan over *every* plan, and a lower bound, at one budget.

:func:`certify` widens ``solve``'s choice to every unit (the root too, :func:`every_unit`) and each module's whole
Pareto front of save lists (``max_options=None``): when no front was thinned and the optimum is proven, it is the
least recompute any plan can have under sacplan's memory model. The fractional bound
(:func:`~sacplan.solver.milp.recompute_lower_bound`) over the same units stands beside it (no integer search: it
answers where the whole-front MILP is too large for the time limit).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from sacplan.errors import SolverError
from sacplan.solver import limits
from sacplan.solver.limits import DEFAULT_CERTIFY_S, remaining
from sacplan.solver.milp import TimeLimitWarning, recompute_lower_bound, solve
from sacplan.solver.options import SolverOptions, resolve_options
from sacplan.tree import ModuleTree, as_tree
from sacplan.units import parse_budget


def every_unit(tree: ModuleTree) -> list[str]:
    """Every module (leaves and the root included) that has activations a checkpoint could discard."""
    return [
        n.fqn
        for n in tree.nodes
        if n.stats.tradeoff is not None and n.stats.tradeoff.max_discard_bytes > 0
    ]


@dataclass(frozen=True)
class Certificate:
    """What no plan can beat at one budget (ms a plan adds to the step on the tree's device: recomputation plus the
    selective mode's dispatch, :mod:`sacplan.sacmode`).

    Attributes:
        budget_bytes: the budget (bytes).
        lower_bound_ms: no plan adds less (fractional knapsack per module, every unit, without the dispatch).
        best_ms: the least any plan adds (``plan.extra_ms``) when ``proven`` (else the best plan found's, or None).
        proven: ``best_ms`` is proven optimal over every plan (whole fronts, optimal status).
        status: the solver's status for the whole-front MILP ("optimal", "time_limit", or "not run: …").
        units: how many modules were allowed as checkpoint units.
    """

    budget_bytes: int
    lower_bound_ms: float
    best_ms: float | None
    proven: bool
    status: str
    units: int

    def summary(self, reference_ms: float | None = None) -> str:
        """One line; with ``reference_ms`` (e.g. full checkpointing's recompute) also as percentages of it."""

        def pct(v: float | None) -> str:
            if v is None or not reference_ms:
                return ""
            return f" ({v / reference_ms:.2%})"

        best = "none found" if self.best_ms is None else f"{self.best_ms:.6g} ms{pct(self.best_ms)}"
        if self.proven:
            kind = "proven optimal over every plan"
        elif self.status == "optimal":
            kind = "optimal, but a large module's save lists were sampled: not a proof"
        else:
            kind = f"not proven: {self.status}"
        return (
            f"best plan {best} [{kind}; {self.units} units, whole save-list fronts]; "
            f"no plan below {self.lower_bound_ms:.6g} ms{pct(self.lower_bound_ms)}"
        )


def certify(
    tree: ModuleTree,
    budget: int | float | str,
    *,
    units: list[str] | None = None,
    solver: str = "auto",
    time_limit_s: float | None = DEFAULT_CERTIFY_S,
    options: SolverOptions | None = None,
) -> Certificate:
    """The best plan over every plan at ``budget`` (proven when tractable) and a lower bound over every plan.

    Args:
        tree, budget: as :func:`~sacplan.solver.milp.solve`.
        units: the checkpoint units allowed (default :func:`every_unit`).
        solver, time_limit_s: as :class:`~sacplan.solver.options.SolverOptions`; the time limit (default 300 s)
            is the whole call's, at most half for the lower bound: stopped first, the certificate keeps the best
            plan found, ``proven=False``, and the lower bound.
        options: all settings as one :class:`~sacplan.solver.options.SolverOptions` (its ``max_options`` is
            overridden: whole fronts are the point).

    Raises:
        InfeasibleBudgetError: no plan fits (with the smallest feasible budget).
    """
    opts = resolve_options(options, dict(solver=solver, time_limit_s=time_limit_s), DEFAULT_CERTIFY_S)
    with limits.call(opts.time_limit_s, opts.work_limit):
        return _certify(tree, budget, units, opts)


def _certify(tree: ModuleTree, budget: int | float | str, units: list[str] | None, opts: SolverOptions) -> Certificate:
    tree = as_tree(tree)
    time_limit_s = opts.time_limit_s
    units = every_unit(tree) if units is None else list(units)
    budget_bytes = parse_budget(budget, capacity_bytes=tree.stats.device.memory_bytes)
    lb = recompute_lower_bound(tree, budget_bytes, ac_units=units,
                               options=opts.replace(time_limit_s=None if time_limit_s is None else time_limit_s / 2))
    left = remaining(time_limit_s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimeLimitWarning)
        warnings.simplefilter("ignore", UserWarning)  # units without activations are skipped, by design
        try:
            plan = solve(tree, budget_bytes, ac_units=units, options=opts.replace(max_options=None, time_limit_s=left))
        except SolverError as e:  # e.g. the time limit before any plan
            return Certificate(budget_bytes, lb, None, False, f"not run: {e}", len(units))
    if plan.status == "not needed":  # the budget fits without checkpointing
        return Certificate(budget_bytes, 0.0, 0.0, True, "optimal", len(units))
    proven = plan.status == "optimal" and bool(plan.meta.get("options_complete")) and math.isfinite(plan.objective_ms)
    return Certificate(budget_bytes, lb, float(plan.extra_ms), proven, plan.status, len(units))
