"""How a plan is searched for, in one validated object (:class:`SolverOptions`; *what* is planned, the tree, budget,
world size and units, is the problem). Every public solving call (``solve``, ``min_feasible_budget``,
``recompute_lower_bound``, ``certify``, ``sweep``, ``fit_to_budget``, ``sac_milp``) accepts ``options=`` or the same
settings as keywords, never both::

    opts = SolverOptions(solver="cbc", time_limit_s=30)
    plan = solve(tree, "60GiB", options=opts)
    curve = sweep(tree, options=opts)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from sacplan.errors import ConfigError
from sacplan.solver.backends import check_solver
from sacplan.solver.limits import DEFAULT_SOLVE_S, DEFAULT_WORK_NODES, check_time_limit

#: accepted values of :attr:`SolverOptions.on_interrupt`
ON_INTERRUPT = ("raise", "incumbent")


@dataclass(frozen=True)
class SolverOptions:
    """Solver settings (validated on construction; :class:`~sacplan.errors.ConfigError` /
    :class:`~sacplan.errors.SolverError` say what is wrong).

    Attributes:
        solver: ``"auto"`` (HiGHS when highspy is installed, else CBC), ``"cbc"`` or ``"highs"``; the back-end
            that runs is :attr:`backend`.
        work_limit: the whole call's deterministic budget of branch-and-bound nodes (None: none; default
            :data:`~sacplan.solver.limits.DEFAULT_WORK_NODES`): stopped there, the best plan found, with its proven
            gap, is the same on every run and rank, whatever the machine's load.
        time_limit_s: the whole call's wall-clock budget (s; None: none; default 60, ``certify`` 300), the safety
            net: stopped there, ``plan.meta["stopped_by"]`` and the warning say the plan depends on the machine.
        gap_rel: relative optimality gap to prove, in [0, 1).
        threads: solver threads (None: 1, deterministic).
        op_level: realise ratios as op save lists (else ratio-only decisions).
        exact: choose among each module's exact op-level options (None: as ``op_level``); False: the trade-off
            lines, their ratios realised by op selection.
        max_options: options per module in exact mode (more: finer choice, larger MILP). None: each module's whole
            Pareto front of save lists; the MILP then ranges over every plan, and ``plan.meta["options_complete"]``
            says when no front had to be thinned (its proven optimum is then the best plan there is).
        on_interrupt: Ctrl-C during the search: ``"raise"`` or ``"incumbent"`` (return the best plan so far).
        tree_dp: in exact mode, try the tree DP (:mod:`sacplan.solver.tree_dp`: few binding events, proofs in well
            under a second) before the MILP. False: the MILP alone (to compare; no chain DP either).
        chain_dp: in exact mode, where the tree DP gives up, try the DP over sequential blocks
            (:mod:`sacplan.solver.chain_dp`: the repeated-block trees users bring, BERT, ViT, GPT-2, ConvNeXt...,
            in seconds) before the MILP. False: skip it (to compare).
    """

    solver: str = "auto"
    time_limit_s: float | None = DEFAULT_SOLVE_S
    gap_rel: float = 1e-4
    work_limit: int | None = DEFAULT_WORK_NODES
    threads: int | None = None
    op_level: bool = True
    exact: bool | None = None
    max_options: int | None = 16
    on_interrupt: str = "raise"
    tree_dp: bool = True
    chain_dp: bool = True
    #: the MILP back-end that runs (``"highs"`` or ``"cbc"``), from :attr:`solver`
    backend: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", check_solver(self.solver))
        object.__setattr__(self, "time_limit_s", check_time_limit(self.time_limit_s))
        try:
            gap = float(self.gap_rel)
        except (TypeError, ValueError):
            gap = math.nan
        if not 0.0 <= gap < 1.0:
            raise ConfigError(f"gap_rel must be a number in [0, 1), e.g. 1e-4, got {self.gap_rel!r}")
        object.__setattr__(self, "gap_rel", gap)
        for name in ("threads", "max_options", "work_limit"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or None, got {v!r}")
        for name in ("tree_dp", "chain_dp"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.on_interrupt not in ON_INTERRUPT:
            raise ConfigError(f"on_interrupt must be 'raise' or 'incumbent', got {self.on_interrupt!r}")

    @property
    def exact_mode(self) -> bool:
        """Whether candidates choose among exact op-level options (``exact``, default ``op_level``)."""
        return bool(self.op_level and (self.op_level if self.exact is None else self.exact))

    def replace(self, **changes: Any) -> "SolverOptions":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def resolve_options(
    options: SolverOptions | None, given: Mapping[str, Any], time_limit_default: float | None = DEFAULT_SOLVE_S
) -> SolverOptions:
    """The settings of one call: ``options`` when given, else the call's keywords ``given`` (named as
    :class:`SolverOptions`' fields; default time limit ``time_limit_default``).

    Raises:
        ConfigError: ``options`` is not a :class:`SolverOptions`, or a keyword differs from its default while
            ``options`` is given (which of the two was meant is not guessed).
    """
    defaults = {f.name: f.default for f in dataclasses.fields(SolverOptions) if f.init}
    defaults["time_limit_s"] = time_limit_default
    if options is None:
        return SolverOptions(**{**defaults, **given})
    if not isinstance(options, SolverOptions):
        raise ConfigError(f"options must be a sacplan.SolverOptions, got {type(options).__name__}")
    clash = sorted(k for k, v in given.items() if not _same(v, defaults[k]))
    if clash:
        raise ConfigError(
            f"{', '.join(clash)} given both as keyword and through options=: pass the solver settings one way, "
            f"e.g. options.replace({clash[0]}=...)"
        )
    return options


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b) or (
        isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and a == b
    )
