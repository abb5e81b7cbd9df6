"""examples/pipeline_cpu.py trains a 2-stage Llama pipeline on gloo with per-stage plans (minutes: -m slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pipeline_example_trains_and_validates(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "pipeline_cpu.py"), "--model", "llama-tiny", "--steps", "2",
                        "--validate"], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "== stage 0 (rank 0)" in r.stdout and "step 1: loss" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2 and all("gradients bitwise equal: True" in ln for ln in lines), r.stdout
