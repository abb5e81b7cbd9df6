"""parse_budget on edge inputs (issue 15): numpy scalars, overflow, sub-byte budgets, budgets above the device."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from sacplan.errors import BudgetError, BudgetWarning
from sacplan.units import GiB, parse_budget


def test_numpy_scalars_are_numbers():
    assert parse_budget(np.int64(2)) == 2 * GiB
    assert parse_budget(np.float32(1.5)) == int(1.5 * GiB)
    assert parse_budget(np.int64(3 * GiB)) == 3 * GiB


@pytest.mark.parametrize("budget", ["1e400GiB", 10**400, "1e300TiB"])
def test_overflowing_budget_is_a_budget_error(budget):
    with pytest.raises(BudgetError, match="too large|finite"):
        parse_budget(budget)


@pytest.mark.parametrize("budget", ["0.1B", 1e-12, "0.4B"])
def test_budget_rounding_to_zero_bytes_is_refused(budget):
    with pytest.raises(BudgetError, match="less than one byte"):
        parse_budget(budget)


def test_budget_above_the_device_warns_once_in_one_line():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert parse_budget("100GiB", capacity_bytes=80 * 10**9) == 100 * GiB
    assert len(w) == 1 and issubclass(w[0].category, BudgetWarning)
    msg = str(w[0].message)
    assert "100.00 GiB" in msg and "74.51 GiB" in msg and "\n" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_budget("70GiB", capacity_bytes=80 * 10**9) == 70 * GiB  # below: no warning
