"""The package's public functions stay functions, whatever was imported before (a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import sacplan
assert callable(sacplan.collect) and callable(sacplan.collect)  # twice: the first call imports sacplan.collect
import sacplan.solver.milp, sacplan.budget_sweep, sacplan.validation  # submodules set attributes
import sacplan.collector.tracker as tracker  # a plain import of a submodule works (no class swap)
assert tracker.StepRecorder is not None
for name in ("collect", "solve", "validate", "sweep", "sac_milp", "min_feasible_budget", "baseline_peak",
             "load_plan", "apply_plan", "remove_plan", "certify", "recompute_lower_bound"):
    f = getattr(sacplan, name)
    assert callable(f) and not isinstance(f, type(sacplan)), (name, f)
from sacplan.solver import solve
from sacplan.collector import collect
assert sacplan.solve is solve and sacplan.collect is collect
try:
    sacplan.no_such_thing
except AttributeError as e:
    assert "no_such_thing" in str(e)
else:
    raise SystemExit("no AttributeError")
print("ok")
"""


def test_public_functions_survive_submodule_imports():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_import_is_light():
    """``import sacplan`` loads no solver back-end."""
    code = "import sys, sacplan; print(any(m == 'pulp' or m.startswith('pulp.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_phase_is_one_enum_and_reads_old_strings():
    """Event phases are one enum (issue 16: a string in one place, int constants in two others); it is a str, so
    stats saved with ``"fw"``/``"bw"``/``"rc"``/``"other"`` load and compare unchanged."""
    import json

    from sacplan.stats import MemoryEvent, Phase

    assert [p.value for p in Phase] == ["fw", "bw", "rc", "other"]
    e = MemoryEvent(Phase.RC, "blk", 0, 3, 2, 10, 4, 1)
    assert json.loads(json.dumps(e.to_dict()))["phase"] == "rc"
    assert MemoryEvent("rc", "blk", 0, 3, 2, 10, 4, 1).phase == Phase.RC and str(Phase.BW) == "bw"
