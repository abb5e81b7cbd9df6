"""The notebook executes and every example runs (as subprocesses with small arguments)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def _run_example(name: str, *args: str, timeout: int = 600) -> str:  # wide: a loaded host
    code = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    r = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "examples" / name), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout + r.stderr  # warnings included


def test_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "explore.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "store the notebook without outputs"
    # executed as users run it (no backend forced): the plot cells must show pictures, not "<Figure ...>"
    nbclient.NotebookClient(nb, timeout=600,  # per cell; wide: a loaded host
                           kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs)
    assert "budget sweep for llama-small" in text
    assert "saved" in text and "validation on cpu" in text
    plot_cells = [c for c in nb.cells if c.cell_type == "code" and c.source.strip().splitlines()[-1].startswith("plot_")]
    assert len(plot_cells) == 3
    for c in plot_cells:
        images = [o for o in c.outputs if "image/png" in o.get("data", {})]
        assert len(images) == 1, c.source + repr(c.outputs)[:500]
        assert images[0]["data"]["image/png"].startswith("iVBOR")  # base64 of the PNG signature


def test_train_loop():
    out = _run_example("train_loop.py", "--model", "llama-tiny", "--batch", "2", "--seq", "64")
    assert "step 2: loss" in out and "trained 3 steps" in out


def test_plan_70b_fsdp_small():
    out = _run_example("plan_70b_fsdp.py", "--layers", "4", "--seq", "2048")
    assert "SAC plan: llama-70b (4 layers)" in out and "world size 8" in out
    # the default budget is below the card's 79.19 GiB (no BudgetWarning), and so is the plan
    assert "budget               75.00 GiB" in out and "warning" not in out.lower()
    peak = next(ln for ln in out.splitlines() if ln.strip().startswith("predicted peak")).split()
    assert float(peak[2]) <= 75.0 and peak[3] == "GiB"


def test_compare_reference():
    out = _run_example("compare_reference.py", "--model", "llama-tiny")
    assert "sacplan sac_milp (sacplan tree)" in out and "PyTorch sac_milp (PyTorch graph)" in out


def test_transformers_llama():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    out = _run_example("transformers_llama.py", "--seq", "32")
    assert "step 1: loss" in out and "validation on cpu" in out and "gradients: bitwise equal" in out


def test_timm_vit():
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")
    out = _run_example("timm_vit.py", "--batch", "16")
    assert "step 1: loss" in out and "validation on cpu" in out and "gradients: bitwise equal" in out


def _trainers_installed(*mods: str) -> None:
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install -e \".[trainers]\" (CI does)")


def test_hf_trainer():
    """Plan with fit_to_budget, then Hugging Face's Trainer trains the planned model (tiny, 3 steps)."""
    _trainers_installed("transformers", "accelerate")
    out = _run_example("hf_trainer.py", "--layers", "2", "--hidden", "64", "--seq", "64", "--steps", "3")
    assert "SAC plan: LlamaForCausalLM on CPU" in out and "trained 3 steps with the plan" in out
    assert "model.layers." in out  # something is checkpointed


def test_lightning_train():
    """Plan the LightningModule's model, then Lightning's Trainer.fit trains it (tiny, 3 steps)."""
    _trainers_installed("lightning")
    out = _run_example("lightning_train.py", "--layers", "2", "--seq", "64", "--steps", "3")
    assert "SAC plan: Llama on CPU" in out and "trained 3 steps with the plan" in out
    assert "layers." in out
