"""CLI on bad input (issue 15): one line on stderr, exit 2, never a traceback; loud one-line warnings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sacplan.cli import main

TINY = ["llama-tiny", "-q"]
ROOT = Path(__file__).resolve().parents[1]


def _err_line(capsys) -> str:
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1, out.err
    assert "Traceback" not in out.err
    return lines[0]


@pytest.fixture()
def raising_factory(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def build():\n    raise RuntimeError('no weights here')\n")
    return f"{f}:build"


def test_plan_with_a_raising_factory(raising_factory, capsys):
    assert main(["plan", raising_factory, "-q", "--device", "cpu"]) == 2
    line = _err_line(capsys)
    assert "factory raised RuntimeError: no weights here" in line


def test_validate_with_a_raising_factory(raising_factory, tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["plan", *TINY, "--budget", "65.75MiB", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["validate", raising_factory, "--plan", str(plan)]) == 2
    assert "factory raised RuntimeError" in _err_line(capsys)


@pytest.mark.parametrize(
    "budget, needle",
    [("1e400GiB", "too large"), ("", "cannot parse"), ("0.1B", "less than one byte")],
)
def test_bad_budgets(budget, needle, capsys):
    assert main(["plan", *TINY, "--budget", budget]) == 2
    assert needle in _err_line(capsys)


def test_budget_above_the_device_warns_in_one_line(capsys):
    assert main(["plan", *TINY, "--budget", "100GiB"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [
        "sacplan: warning: budget 100.00 GiB exceeds the target device's 79.19 GiB of memory: a plan for it may not "
        "fit on the device; lower the budget or give a percentage such as '90%'"
    ]


def test_output_into_a_read_only_folder_or_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    dest = blocker / "plan.json"
    assert main(["plan", *TINY, "--budget", "65.75MiB", "-o", str(dest)]) == 2
    line = _err_line(capsys)
    assert str(dest) in line and ".tmp" not in line
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert main(["plan", *TINY, "--budget", "65.75MiB", "-o", str(ro / "plan.json")]) == 2
            line = _err_line(capsys)
            assert str(ro / "plan.json") in line and ".tmp" not in line and "writable" in line
        finally:
            ro.chmod(0o700)


def test_show_a_file_that_is_not_utf8(tmp_path, capsys):
    p = tmp_path / "p.json"
    p.write_bytes(b"\xff\xfe{\x00}")
    assert main(["show", str(p)]) == 1
    assert "not UTF-8" in _err_line(capsys)


@pytest.mark.parametrize("name, needle", [("missing/x.png", "does not exist"), ("x.foo", "unknown picture type")])
def test_plot_path_checked_before_collecting(tmp_path, capsys, name, needle):
    assert main(["sweep", *TINY, "--plot", str(tmp_path / name)]) == 2
    assert needle in _err_line(capsys)


def test_ctrl_c_while_importing_is_one_line_and_130():
    """SIGINT while torch is being imported (seen through -X importtime's lines): one line, exit 130."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONPROFILEIMPORTTIME="1")
    p = subprocess.Popen([sys.executable, "-m", "sacplan.cli", "plan", "llama-tiny", "--device", "cpu"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stderr:  # importtime prints each module when it is done: torch's submodules come first
        seen.append(line)
        if "| torch." in line or "|   torch." in line or line.rstrip().endswith(" torch._C"):
            break
    p.send_signal(signal.SIGINT)
    _, rest = p.communicate(timeout=120)
    err = [ln for ln in "".join(seen).splitlines() + rest.splitlines() if ln.strip() and not ln.startswith("import time:")]
    assert p.returncode == 130, err
    assert err == ["sacplan: interrupted"]


def test_import_of_the_cli_does_not_load_torch():
    code = "import sys, sacplan.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "False", out.stderr
