"""Progress lines of a solve: a status line (elapsed, incumbent, bound, gap) every few seconds on a stream.

:func:`progress_to` turns them on for a block (the CLI's ``plan``: standard error); the searches call
:func:`report`, and a sub-problem's search inside :func:`within` reports the whole search's figures.
"""

from __future__ import annotations

import contextvars
import math
import time
from contextlib import contextmanager
from typing import Iterator, TextIO

from sacplan.solver import limits

#: Seconds between progress lines.
PROGRESS_EVERY_S = 3.0

#: the stream lines go to, with the time of the last line written to it (``time.monotonic``)
_STREAM: contextvars.ContextVar[tuple[TextIO, list[float]] | None] = contextvars.ContextVar(
    "sacplan_progress", default=None)
#: (incumbent, bound) of the search around a sub-problem being solved (ms): what progress lines combine with
_OUTER: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("sacplan_outer", default=None)


@contextmanager
def progress_to(stream: TextIO | None) -> Iterator[None]:
    """Write a status line to ``stream`` (e.g. ``sys.stderr``) every few seconds of solving (None: silent)."""
    tok = _STREAM.set(None if stream is None else (stream, [0.0]))
    try:
        yield
    finally:
        _STREAM.reset(tok)


@contextmanager
def within(incumbent: float, bound: float) -> Iterator[None]:
    """Progress reported inside this block is of a sub-problem of a search whose best plan costs ``incumbent``
    and whose other open parts are bounded by ``bound`` (ms): lines show the whole search's figures."""
    token = _OUTER.set((incumbent, bound))
    try:
        yield
    finally:
        _OUTER.reset(token)


def report(incumbent: float, bound: float, gap: float, force: bool = False) -> None:
    """One status line (objective and bound in ms of recompute; elapsed since the outermost
    :func:`~sacplan.solver.limits.deadline`) when progress is on and it is time; inside :func:`within`, the whole
    search's figures."""
    held = _STREAM.get()
    now = time.monotonic()
    if held is None or (not force and now - held[1][0] < PROGRESS_EVERY_S):
        return
    stream, last = held
    outer = _OUTER.get()
    if outer is not None:
        incumbent, bound = min(incumbent, outer[0]), min(bound, outer[1])
        gap = math.inf
    last[0] = now
    t0 = limits.started() or now
    inc = f"{incumbent:.4f} ms" if math.isfinite(incumbent) else "none yet"
    bnd = f"{bound:.4f} ms" if math.isfinite(bound) else "-"
    if not math.isfinite(gap) and math.isfinite(incumbent) and math.isfinite(bound):
        gap = max(0.0, incumbent - bound) / max(abs(incumbent), 1e-10)
    g = f"{gap:.3%}" if math.isfinite(gap) else "-"
    try:
        stream.write(f"solving: {now - t0:.0f} s elapsed, best {inc}, bound {bnd}, gap {g}\n")
        stream.flush()
    except (OSError, ValueError):  # a closed stream: progress is optional
        pass
