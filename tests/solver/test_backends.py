"""Solver back-ends: what reaches the user's terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
from sacplan.solver.backends import solve_model
from sacplan.solver.model import MilpModel
m = MilpModel()
x = m.add_col("x", 0, 3, True, -1.0)
m.add_row("r", [x], [2.0], ub=5.0)
res = solve_model(m, "highs")
print("objective", res.objective)
"""


def test_highs_banner_does_not_reach_stdout():
    pytest.importorskip("highspy")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "objective -2.0"  # HiGHS prints "Running HiGHS ..." on first construction
