"""Budgets in, bytes out: parse_budget and fmt_bytes."""

from __future__ import annotations

import math

import pytest

from sacplan.errors import BudgetError, ConfigError
from sacplan.units import GiB, KiB, MiB, PLAIN_NUMBER_GIB_LIMIT, fmt_bytes, gib, parse_budget

H100_BYTES = 81_090 * MiB


@pytest.mark.parametrize(
    "budget, expected",
    [
        (40, 40 * GiB),
        (40.5, 40 * GiB + GiB // 2),
        ("40", 40 * GiB),
        ("40GiB", 40 * GiB),
        ("40 GiB", 40 * GiB),
        ("40gib", 40 * GiB),
        ("40G", 40 * GiB),
        ("42.9GB", 42_900_000_000),
        ("512MiB", 512 * MiB),
        ("512MB", 512_000_000),
        ("1.5TiB", 3 * 2**39),
        ("64KiB", 64 * KiB),
        ("1e10B", 10**10),
        ("1e10", 10**10),  # a plain number at or above 1 MiB is bytes, as a string too
        (42_949_672_960, 42_949_672_960),  # an int of bytes
        (MiB, MiB),  # the boundary: 1 MiB and above are bytes
        (MiB - 1, (MiB - 1) * GiB),  # below it, GiB (no budget is under 1 MiB)
        (2.5e10, 25_000_000_000),
    ],
)
def test_parse_budget(budget, expected):
    assert parse_budget(budget) == expected
    assert isinstance(parse_budget(budget), int)


def test_percent_of_capacity():
    assert parse_budget("80%", capacity_bytes=H100_BYTES) == int(H100_BYTES * 0.8)
    assert parse_budget("100%", capacity_bytes=1000) == 1000
    assert parse_budget("12.5 %", capacity_bytes=800) == 100


@pytest.mark.parametrize(
    "budget, capacity",
    [
        (-1, None),
        (0, None),
        (-2.5, None),
        (math.nan, None),
        (math.inf, None),
        ("abc", None),
        ("", None),
        ("-4GiB", None),
        ("0GiB", None),
        ("40 parsecs", None),
        ("4 0GiB", None),
        ("80%", None),
        ("150%", 1000),
        (True, None),
        (False, None),
        (None, None),
        ([40], None),
    ],
)
def test_bad_budgets_raise(budget, capacity):
    with pytest.raises(BudgetError):
        parse_budget(budget, capacity_bytes=capacity)


def test_budget_error_is_a_config_error():
    with pytest.raises(ConfigError, match="40GiB"):  # the message shows the accepted forms
        parse_budget("abc")
    assert PLAIN_NUMBER_GIB_LIMIT == MiB


@pytest.mark.parametrize(
    "n, unit, text",
    [
        (3 * GiB, None, "3.00 GiB"),
        (GiB, None, "1.00 GiB"),
        (GiB - 1, None, "1024.00 MiB"),
        (1536 * MiB, None, "1.50 GiB"),
        (5 * MiB, None, "5.00 MiB"),
        (1536, None, "1.50 KiB"),
        (512, None, "512 B"),
        (0, None, "0 B"),
        (-2 * GiB, None, "-2.00 GiB"),
        (GiB, "MiB", "1024.00 MiB"),
        (3 * MiB, "GiB", "0.00 GiB"),
        (2048, "B", "2048 B"),
    ],
)
def test_fmt_bytes(n, unit, text):
    assert fmt_bytes(n, unit) == text


def test_gib():
    assert gib(3 * GiB) == 3.0 and gib(GiB // 2) == 0.5


@pytest.mark.parametrize("n", [1, 978_760, MiB, 40 * GiB])
def test_bytes_from_sacplan_are_read_as_bytes_at_any_size(n):
    from sacplan.units import Bytes

    assert parse_budget(Bytes(n)) == n  # a plain 978_760 would be 978,760 GiB
    assert parse_budget(n) == (n * GiB if n < PLAIN_NUMBER_GIB_LIMIT else n)
    assert repr(Bytes(n)) == f"Bytes({n})" and Bytes(n) == n
    assert f"{Bytes(n)}B" == str(Bytes(n)) + "B" == f"{n}B" and parse_budget(f"{Bytes(n)}B") == n
    import json

    assert json.dumps({"b": Bytes(n)}) == json.dumps({"b": n})
    assert type(Bytes(n) + 1) is int  # derived figures fall back to the plain rule
