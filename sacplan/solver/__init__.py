"""Solvers: the module-level SAC MILP, op-level selection and PyTorch-compatible ``sac_milp``.

``solve(tree, budget)`` is the entry point; the memory model is :mod:`sacplan.timeline`, the MILP over it
:mod:`sacplan.solver.formulation`. The MILP's layers, top down: ``milp`` (entry points), ``search`` (incumbent, repair, min-peak
plan), ``realise`` (ratios to op save lists), ``formulation`` (rows and columns), ``problem``
(:class:`SacProblem`: the timeline and exact evaluation), ``candidates`` (checkpointable modules). Beside them:

* op level, top down: ``ops`` (a module's save list at one budget, its options, its lower-bound lines),
  ``front`` (the Pareto front of save lists and its thinning), ``knapsack`` (the knapsack at one budget,
  :class:`OpSelection`); the ops decided together are :mod:`sacplan.opgroups`;
* solvers, top down: ``lp_proof`` (an incumbent proven optimal by LP bounds), ``backends`` (solver choice and
  :func:`solve_model`), ``cbc`` and ``highs`` (one back-end each), ``model`` (:class:`MilpModel`,
  :class:`SolveResult`, status codes);
* ``options`` (:class:`SolverOptions`: every solver setting, validated once), ``limits`` (time budget),
  ``certify`` and ``compat``.
"""

from sacplan.solver.backends import SOLVERS, solve_model
from sacplan.solver.certify import Certificate, certify, every_unit
from sacplan.solver.compat import sac_milp
from sacplan.solver.knapsack import OpSelection
from sacplan.solver.milp import (
    TimeLimitWarning,
    baseline_peak,
    min_feasible_budget,
    recompute_lower_bound,
    solve,
)
from sacplan.solver.model import MilpModel, SolveResult
from sacplan.solver.options import SolverOptions
from sacplan.solver.ops import ModuleOptions, module_options, select_ops
from sacplan.solver.problem import SacProblem

__all__ = [
    "solve",
    "SolverOptions",
    "sac_milp",
    "select_ops",
    "OpSelection",
    "min_feasible_budget",
    "recompute_lower_bound",
    "certify",
    "Certificate",
    "every_unit",
    "module_options",
    "ModuleOptions",
    "baseline_peak",
    "SacProblem",
    "TimeLimitWarning",
    "MilpModel",
    "SolveResult",
    "solve_model",
    "SOLVERS",
]
