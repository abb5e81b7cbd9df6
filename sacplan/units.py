"""Units at the edges: parsing budgets and formatting bytes.

Inside sacplan every size is an ``int`` number of bytes and every time a ``float`` number of milliseconds.
GiB appear only when reading user input or printing.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings

from sacplan.errors import BudgetError, BudgetWarning

GiB = 2**30
MiB = 2**20
KiB = 2**10

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
    "k": KiB,
    "m": MiB,
    "g": GiB,
    "t": 2**40,
}

#: Plain numbers below this are read as GiB, numbers at or above it as bytes (no real budget is under
#: 1 MiB, and none is over 1 PiB).
PLAIN_NUMBER_GIB_LIMIT = MiB


class Bytes(int):
    """An ``int`` that is a number of bytes whatever its size.

    sacplan returns its own byte figures (:func:`~sacplan.solver.min_feasible_budget`,
    :func:`~sacplan.solver.baseline_peak`) as ``Bytes`` so that they go straight back into a budget argument:
    :func:`parse_budget` reads a plain number below 1 MiB as GiB, which would turn a small model's
    900,000-byte minimum into 838 TiB. Arithmetic on a ``Bytes`` gives a plain ``int`` (read by the plain
    rule again); wrap a derived figure in ``Bytes(...)`` to keep it in bytes.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Bytes({int(self)})"

    def __str__(self) -> str:  # f"{n}B", str(n), json: the plain digits
        return int.__repr__(self)


_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def parse_budget(budget: int | float | str, capacity_bytes: int | None = None) -> int:
    """Turn a user budget into bytes.

    Accepted forms:
      * :class:`Bytes` (what sacplan's own byte figures are): bytes at any size;
      * ``int``/``float`` (numpy scalars included) below 1 MiB (1,048,576): GiB, e.g. ``40`` or ``40.5``;
      * ``int``/``float`` at or above 1 MiB: bytes, e.g. ``42949672960``;
      * strings with a unit: ``"40GiB"``, ``"42.9GB"``, ``"512MiB"``, ``"1e10B"``, ``"40"`` (GiB);
      * percentages of the target device's capacity: ``"80%"`` (needs ``capacity_bytes``).

    When ``capacity_bytes`` (the target device's memory, bytes) is given and the budget exceeds it, a
    :class:`~sacplan.errors.BudgetWarning` says so: a plan for that budget need not fit on the device.

    Raises:
        BudgetError: unparsable, non-positive, not finite, rounding to 0 bytes, or a percentage without a
            device capacity.
    """
    n = _budget_bytes(budget, capacity_bytes)
    if n < 1:
        raise BudgetError(f"memory budget {budget!r} is less than one byte; write e.g. '40GiB' or '512MiB'")
    if capacity_bytes is not None and n > capacity_bytes:
        warnings.warn(
            f"budget {fmt_bytes(n)} exceeds the target device's {fmt_bytes(capacity_bytes)} of memory: a plan for it "
            "may not fit on the device; lower the budget or give a percentage such as '90%'",
            BudgetWarning,
            stacklevel=3,
        )
    return n


def _budget_bytes(budget: object, capacity_bytes: int | None) -> int:
    """Bytes of ``budget`` (see :func:`parse_budget`), without the capacity check."""
    if isinstance(budget, bool):
        raise BudgetError(f"memory budget must be a number or a string like '40GiB', got {budget!r}")
    if isinstance(budget, Bytes):
        return int(budget)
    if isinstance(budget, numbers.Real):
        try:
            value = float(budget)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value) or value <= 0:
            raise BudgetError(f"memory budget must be positive and finite, got {repr(budget)[:40]}; write e.g. '40GiB'")
        if value < PLAIN_NUMBER_GIB_LIMIT:
            return int(round(value * GiB))
        return int(round(value))
    if not isinstance(budget, str):
        raise BudgetError(f"memory budget must be a number or a string like '40GiB', got {type(budget).__name__}")
    m = _BUDGET_RE.match(budget)
    if not m:
        raise BudgetError(
            f"cannot parse memory budget {budget!r}: write e.g. '40GiB', '42.9GB', '512MiB', '80%' or a number of GiB"
        )
    value = float(m.group(1))
    unit = m.group(2).lower()
    if not math.isfinite(value):
        raise BudgetError(f"memory budget {budget!r} is too large to be a number of bytes; write e.g. '40GiB'")
    if value <= 0:
        raise BudgetError(f"memory budget must be positive, got {budget!r}")
    if unit == "%":
        if capacity_bytes is None:
            raise BudgetError(f"budget {budget!r} is a percentage, but no target device capacity is known")
        if value > 100:
            raise BudgetError(f"budget {budget!r} is over 100% of the device capacity")
        return int(capacity_bytes * value / 100.0)
    if unit == "":
        return _budget_bytes(value, capacity_bytes)
    if unit not in _UNITS:
        raise BudgetError(f"unknown unit {m.group(2)!r} in budget {budget!r}: use B, KB, MB, GB, KiB, MiB, GiB or %")
    n = value * _UNITS[unit]
    if not math.isfinite(n):
        raise BudgetError(f"memory budget {budget!r} is too large to be a number of bytes; write e.g. '40GiB'")
    return int(round(n))


def fmt_bytes(n: float, unit: str | None = None) -> str:
    """Format bytes for people: ``fmt_bytes(3 * 2**30) == '3.00 GiB'``."""
    if unit is None:
        a = abs(n)
        unit = "GiB" if a >= GiB else "MiB" if a >= MiB else "KiB" if a >= KiB else "B"
    scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}[unit]
    return f"{n / scale:.2f} {unit}" if unit != "B" else f"{int(n)} B"


def gib(n: float) -> float:
    """Bytes to GiB as a float."""
    return n / GiB
