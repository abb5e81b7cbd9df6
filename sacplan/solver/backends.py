"""MILP back-ends: which solver runs a :class:`~sacplan.solver.model.MilpModel`, and the call that runs it.

:func:`solve_model` hands the model to

* ``"cbc"``: COIN-OR CBC through PuLP (:mod:`sacplan.solver.cbc`);
* ``"highs"``: HiGHS through ``highspy`` (:mod:`sacplan.solver.highs`).

Both return a :class:`~sacplan.solver.model.SolveResult` with a normalised status, objective, best bound,
relative gap and wall seconds. Runs are deterministic: one thread unless asked otherwise, fixed random seeds.
:func:`check_solver` normalises a solver name; :func:`lp_solver` picks the solver for auxiliary LPs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from sacplan.errors import SolverError
from sacplan.solver import limits
from sacplan.solver.cbc import cbc_path, solve_cbc
from sacplan.solver.count_branching import branch_on_priorities
from sacplan.solver.highs import solve_highs
from sacplan.solver.model import OPTIMAL, MilpModel, RunSettings, SolveResult

#: Solver names :func:`solve_model` accepts.
SOLVERS = ("cbc", "highs")


def check_solver(name: str) -> str:
    """Normalise a solver name; :class:`SolverError` saying how to install it when unusable."""
    key = str(name).lower().strip()
    if key == "auto":
        # HiGHS when installed (the [highs] / [test] extras): it proves the symmetric many-block MILPs that CBC
        # cannot close in minutes (Llama-70B, 80 blocks, 401 units: HiGHS 9 s; CBC still at a 1.3e-4 gap after
        # 120 s even when handed the optimum); else CBC, which PuLP bundles.
        try:
            import highspy  # noqa: F401

            return "highs"
        except ImportError:
            key = "cbc"
    if key in ("cbc", "pulp", "pulp_cbc", "coin"):
        try:
            import pulp  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise SolverError("solver 'cbc' needs PuLP (which bundles CBC): pip install pulp") from e
        if cbc_path() is None:  # pragma: no cover
            raise SolverError(
                "solver 'cbc': PuLP's bundled CBC binary is missing for this platform; install CBC "
                "(apt-get install coinor-cbc, or pip install 'pulp[cbc]') or use solver='highs'"
            )
        return "cbc"
    if key in ("highs", "highspy"):
        try:
            import highspy  # noqa: F401
        except ImportError as e:
            raise SolverError("solver 'highs' needs highspy: pip install highspy") from e
        return "highs"
    raise SolverError(
        f"unknown solver {name!r}: use 'auto' (HiGHS if installed, else CBC), 'cbc' (pip install pulp, which "
        "bundles CBC) or 'highs' (pip install highspy)"
    )


def solve_model(
    model: MilpModel,
    solver: str = "cbc",
    *,
    time_limit_s: float | None = None,
    gap_rel: float = 1e-4,
    gap_abs: float = 1e-9,
    threads: int | None = None,
    warm_start: Sequence[float] | None = None,
    feas_tol: float = 1e-9,
    priorities: Mapping[int, int] | None = None,
    options: Sequence[str] = (),
    highs_options: Mapping[str, Any] | None = None,
    node_limit: int | None = None,
    shared: bool = True,
) -> SolveResult:
    """Solve ``model`` with ``solver`` ("cbc" or "highs"); see :class:`SolveResult`.

    Args:
        time_limit_s: wall-clock limit (None = none), capped by the active :func:`limits.deadline`; on expiry
            the best solution found is returned with status ``"time_limit"`` (``x`` None when none was found).
            Ctrl-C raises :class:`~sacplan.solver.model.SolveInterrupted` carrying the best result so far.
        gap_rel, gap_abs: stop once the relative / absolute gap is this small.
        threads: solver threads (None: serial CBC / one HiGHS thread, which keeps the search deterministic).
        warm_start: a full column vector to start from (a feasible incumbent helps a lot).
        feas_tol: primal feasibility tolerance (model units).
        priorities: branching priorities for integer columns, ``{column: priority}`` (smaller = branched
            first). CBC reads them natively; for HiGHS, which has none, they are branched on first by
            :func:`~sacplan.solver.count_branching.branch_on_priorities`.
        options: extra raw CBC command-line options (CBC only), e.g. ``["preprocess off"]``.
        highs_options: extra HiGHS options (HiGHS only), e.g. ``{"mip_heuristic_effort": 0.0}``.
        node_limit: branch-and-bound nodes this run may explore (None: none of its own); deterministic.
        shared: also bounded by, and charged to, the call's work budget (:func:`limits.work`); False for the
            small auxiliary MILPs (op-level knapsacks) that carry their own ``node_limit``.

    A run cut short is recorded with :func:`limits.stopped` (work limit, or the wall-clock safety net).
    """
    name = check_solver(solver)
    if model.num_cols == 0:
        return SolveResult(OPTIMAL, [], model.obj_offset, model.obj_offset, 0.0, 0.0, name, "empty")
    time_limit_s = limits.remaining(time_limit_s)  # never past the enclosing call's budget (limits.deadline)
    if shared:
        node_limit = limits.nodes_left(node_limit)
    run = RunSettings(time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol, node_limit)
    res = _run(model, name, run, priorities, options, highs_options)
    if shared:
        limits.spend(res.nodes)
    if res.stopped_by:
        limits.stopped(res.stopped_by, model.name)
    return res


def _run(
    model: MilpModel, name: str, run: RunSettings, priorities: Mapping[int, int] | None, options: Sequence[str],
    highs_options: Mapping[str, Any] | None,
) -> SolveResult:
    """One back-end run (CBC with its fallbacks, or HiGHS with count branching)."""
    if name == "cbc":
        try:
            return solve_cbc(model, run, priorities, options)
        except SolverError as first:
            # The bundled CBC binary occasionally dies without a log on a valid model (seen with
            # warm starts). Retry plainly, then with HiGHS when installed; say so in the result.
            try:
                res = solve_cbc(model, dataclasses.replace(run, warm_start=None), None, options)
                return dataclasses.replace(res, log=f"CBC retried without warm start/priorities after: {first}\n" + res.log)
            except SolverError:
                try:
                    import highspy  # noqa: F401
                except ImportError:
                    raise first from None
                res = solve_highs(model, run)
                return dataclasses.replace(res, log=f"CBC failed ({first}); solved with HiGHS\n" + res.log)
    if priorities and any(model.col_int):
        return branch_on_priorities(model, priorities, run, highs_options)
    return solve_highs(model, run, highs_options)


def lp_solver(solver: str) -> str:
    """Auxiliary problems (the heuristic's LPs, op-level knapsacks) run in-process with HiGHS when highspy is
    installed (a CBC call costs a subprocess and an MPS file each); the module-level MILP always runs on
    the solver asked for."""
    try:
        import highspy  # noqa: F401

        return "highs"
    except ImportError:  # pragma: no cover - depends on the environment
        return solver
