"""Work and time limits of a solving call: no solve runs unbounded, and the same inputs give the same plan on every
run and rank, under any machine load.

* :func:`work`: the call's **deterministic** budget of branch-and-bound nodes, counted by the solvers themselves
  (HiGHS's ``mip_node_count``, CBC's enumerated nodes, one per LP of sacplan's own branching) and shared by every
  MILP of the call (:func:`nodes_left`, :func:`spend`).
* :func:`deadline`: one wall-clock budget shared by every sub-solve inside (:func:`remaining`; nested budgets take
  the earlier end). The **safety net** only: what it cuts short is recorded (:func:`stopped`) and the plan says so
  loudly, since such a plan depends on the machine's speed and load.
"""

from __future__ import annotations

import contextvars
import math
import time
from contextlib import contextmanager
from typing import Any, Iterator

from sacplan.errors import ConfigError

#: Default wall-clock budget (s) of ``solve`` / ``sacplan plan``, ``min_feasible_budget``,
#: ``recompute_lower_bound`` and ``sac_milp``.
DEFAULT_SOLVE_S = 60.0
#: Default total budget (s) of a ``sweep`` (shared among its points).
DEFAULT_SWEEP_S = 60.0
#: Default budget (s) of ``certify`` (several solves).
DEFAULT_CERTIFY_S = 300.0
#: Shortest limit handed to a solver (s): a spent budget still lets it return its warm start.
MIN_SLICE_S = 0.01
#: Default deterministic work budget of one call (branch-and-bound nodes over all of its MILPs). Proofs (gap 1e-4):
#: the tiny conformance T5 690 nodes at its midway budget, 127 near its minimum, the tiny Mixtral 67, llama-small
#: x48 13 count nodes; ~0.02-0.1 s a node on a 2-core host (more on large trees: the safety net may end it first).
DEFAULT_WORK_NODES = 2_000
#: What :func:`stopped` records: a deterministic work limit, or the wall-clock safety net.
WORK_LIMIT = "work limit"
WALL_CLOCK = "wall clock"

_NODES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("sacplan_nodes", default=None)
_STOPS: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("sacplan_stops", default=None)
_SPENT: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("sacplan_spent", default=None)

_END: contextvars.ContextVar[float | None] = contextvars.ContextVar("sacplan_deadline", default=None)
#: when the outermost :func:`deadline` opened (``time.monotonic``): what progress lines count elapsed from
_T0: contextvars.ContextVar[float | None] = contextvars.ContextVar("sacplan_progress_t0", default=None)


def check_time_limit(value: Any, name: str = "time_limit_s") -> float | None:
    """``value`` as seconds (float), or None for no limit; :class:`ConfigError` when not a positive number."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number of seconds > 0 (or None for no limit), got {value!r}") from None
    if math.isnan(v) or v <= 0:
        raise ConfigError(f"{name} must be a number of seconds > 0 (or None for no limit), got {value!r}")
    return None if math.isinf(v) else v


@contextmanager
def deadline(limit_s: float | None) -> Iterator[None]:
    """Every solve inside shares one budget of ``limit_s`` seconds (None: only the enclosing budget, if any)."""
    end = _END.get()
    if limit_s is not None:
        mine = time.monotonic() + float(limit_s)
        end = mine if end is None else min(end, mine)
    tok = _END.set(end)
    t0tok = _T0.set(_T0.get() or time.monotonic())
    try:
        yield
    finally:
        _END.reset(tok)
        _T0.reset(t0tok)


@contextmanager
def work(nodes: int | None) -> Iterator[list[tuple[str, str]]]:
    """Every solve inside shares one budget of ``nodes`` branch-and-bound nodes (None: none of its own; an
    enclosing budget still counts). Yields the ``(what, where)`` pairs :func:`stopped` records for this call."""
    outer = _NODES.get()
    left = None if nodes is None else [int(nodes)]
    if outer is not None and (left is None or outer[0] < left[0]):
        left = outer  # the enclosing budget is the smaller: charge it directly
    stops: list[tuple[str, str]] = []
    outer_spent = _SPENT.get()
    tok, stok, ptok = _NODES.set(left), _STOPS.set(stops), _SPENT.set([0])
    try:
        yield stops
    finally:
        spent = _SPENT.get()
        _NODES.reset(tok)
        _STOPS.reset(stok)
        _SPENT.reset(ptok)
        if outer_spent is not None and spent is not None:
            outer_spent[0] += spent[0]
        outer_stops = _STOPS.get()
        if outer_stops is not None:
            outer_stops.extend(s for s in stops if s not in outer_stops)


def nodes_left(limit: int | None = None) -> int | None:
    """Nodes a solve may still explore: the smaller of ``limit`` and what the call's :func:`work` budget has left
    (None: neither bounds it)."""
    held = _NODES.get()
    left = None if held is None else max(0, held[0])
    if limit is not None:
        left = int(limit) if left is None else min(left, int(limit))
    return left


def spend(nodes: int) -> None:
    """Charge ``nodes`` explored nodes to the call's :func:`work` budget."""
    held, spent = _NODES.get(), _SPENT.get()
    if held is not None:
        held[0] -= max(0, int(nodes))
    if spent is not None:
        spent[0] += max(0, int(nodes))


def nodes_spent() -> int:
    """Nodes charged so far to the current call's :func:`work` budget (deterministic)."""
    spent = _SPENT.get()
    return 0 if spent is None else spent[0]


def stopped(what: str, where: str) -> None:
    """Record that ``what`` (:data:`WORK_LIMIT` or :data:`WALL_CLOCK`) cut ``where`` (a part of the search) short."""
    held = _STOPS.get()
    if held is not None and (what, where) not in held:
        held.append((what, where))


def stops() -> tuple[tuple[str, str], ...]:
    """What cut the current call's search short so far (see :func:`stopped`)."""
    return tuple(_STOPS.get() or ())


def past_deadline(where: str) -> bool:
    """:func:`expired`, recording a wall-clock stop at ``where`` when it is (the safety net fired)."""
    if expired():
        stopped(WALL_CLOCK, where)
        return True
    return False


@contextmanager
def call(limit_s: float | None, nodes: int | None) -> Iterator[list[tuple[str, str]]]:
    """One public call's limits: the deterministic :func:`work` budget of ``nodes`` and the wall-clock
    :func:`deadline` of ``limit_s`` seconds (the safety net); yields what :func:`stopped` records."""
    with deadline(limit_s), work(nodes) as stops:
        yield stops


@contextmanager
def lifted() -> Iterator[None]:
    """No budget inside (still interruptible): for the few LPs that yield the first plan, so that even a spent
    budget returns a plan rather than none."""
    tok = _END.set(None)
    try:
        yield
    finally:
        _END.reset(tok)


def remaining(limit_s: float | None = None) -> float | None:
    """Seconds a solve may spend now: the smaller of ``limit_s`` and what the active budget has left (at
    least :data:`MIN_SLICE_S`); None when neither bounds it."""
    end = _END.get()
    left = None if end is None else end - time.monotonic()
    if limit_s is not None:
        left = float(limit_s) if left is None else min(left, float(limit_s))
    return None if left is None else max(MIN_SLICE_S, left)


def started() -> float | None:
    """``time.monotonic()`` when the outermost :func:`deadline` opened (None outside every one)."""
    return _T0.get()


def expired() -> bool:
    """True once the active budget is spent."""
    end = _END.get()
    return end is not None and time.monotonic() >= end


def time_limit_message(
    limit_s: float | None, objective_ms: float, bound_ms: float, gap: float,
    stops: tuple[tuple[str, str], ...] = (), work_nodes: int | None = None,
) -> str:
    """The one line said when a solve stops at a limit (objective/bound in ms of recompute; ``stops`` from
    :func:`stops`, none recorded: the time limit)."""
    best = (f"with the best plan found: {objective_ms:.4f} ms of recompute, at most gap {gap:.4%} above the optimum "
            f"(bound {bound_ms:.4f} ms)")
    if stops and all(what == WORK_LIMIT for what, _ in stops):
        lim = "its work limit" if work_nodes is None else f"its work limit of {work_nodes:,} nodes"
        return (f"stopped at {lim} {best}; the same plan on every run and rank (deterministic); raise work_limit "
                "to prove it")
    lim = "its time limit" if limit_s is None else f"the time limit of {limit_s:g} s"
    where = ", ".join(sorted({w for what, w in stops if what == WALL_CLOCK})) or "the search"
    return (f"stopped at {lim} (wall clock, in {where}) {best}; NOT deterministic: this plan depends on the "
            "machine's speed and load, and ranks planning for themselves may get different plans (they must all "
            "use one plan file); raise time_limit_s (CLI: --time-limit) or lower work_limit so the work limit ends "
            "the search")
