"""Solvers: which modules to checkpoint and which of their ops to save, under a memory budget.

``solve(tree, budget)`` (:mod:`sacplan.solver.milp`) is a pipeline: the problem (``problem``, ``candidates``, the
op-level options of ``ops``, ``front``, ``knapsack``) → the strategies (``strategies``: ``tree_dp``, ``chain_dp``,
``budget_milp`` with ``heuristic``, ``descent`` and ``count_branching``, ``min_peak``) → the judge (``judge``,
``repair``, ``realise``) → the Plan. Beneath: ``formulation``, ``model``, ``backends`` (CBC, HiGHS), ``options``,
``limits``, ``progress``; beside: ``certify`` and ``compat`` (PyTorch's ``sac_milp``).
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
