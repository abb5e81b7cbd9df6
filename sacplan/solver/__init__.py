"""Solvers: which modules to checkpoint and which of their ops to save, under a memory budget.

``solve(tree, budget)`` is the entry point (:mod:`sacplan.solver.milp`), a pipeline read top to bottom:

* the problem: :class:`SacProblem` (``problem``: the Timeline read once, exact evaluation in bytes), its
  candidates (``candidates``) and their exact op-level options (``ops``, ``front``, ``knapsack``);
* the strategies (``strategies.find``), each a module with one entry: the tree DP (``tree_dp``), the DP over
  sequential blocks when many events bind (``chain_dp``), the budget MILP (``budget_milp``: the incumbent of
  ``heuristic`` with the local descent of ``descent``, the LP proof by count branching of ``count_branching``, the
  back-ends), the min-peak plan at the feasibility edge (``min_peak``);
* the judge (``judge``): exact bytes, repair (``repair``), realisation as op save lists (``realise``);
* the Plan.

Beneath: the formulation (``formulation``), the solver-neutral model (``model``: also Ctrl-C's
``SolveInterrupted``), the back-ends (``backends``: CBC and HiGHS; HiGHS's count branching ``count_branching``), the settings (``options``), the limits (``limits``: the deterministic work budget, the
wall-clock safety net) and the progress lines (``progress``). Beside the pipeline: ``certify`` (how good can any
plan be) and ``compat`` (PyTorch's ``sac_milp`` signature; its Graph enters the same problem and budget MILP
through an adapter).
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
