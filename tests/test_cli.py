"""The command line interface, in-process through ``main([...])`` (plus one subprocess run)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from sacplan.cli import main

TINY = ["llama-tiny", "-q"]  # bf16 on H100: no-AC peak ~66 MiB (64 of them cuBLAS workspaces), minimum feasible ~65.3 MiB




def _err_line(capsys) -> tuple[str, str]:
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1, out.err  # one clear line, no traceback
    assert "Traceback" not in out.err
    return lines[0], out.out


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    assert main(["plan", *TINY, "--budget", "65.75MiB", "-o", str(path)]) == 0
    return path


def test_plan_writes_a_file_that_loads(plan_file, capsys):
    from sacplan.plan import load_plan

    plan = load_plan(plan_file)
    assert plan.model_name == "llama-tiny"
    assert plan.decisions, "65.75 MiB lies between the minimum feasible and the no-AC peak: a selective plan"
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes


def test_plan_table(capsys):
    assert main(["plan", *TINY, "--budget", "65.75MiB"]) == 0
    out = capsys.readouterr().out
    for key in ("no-AC baseline peak", "predicted peak", "discard", "freed", "recompute", "policy", "tree DP: optimal"):
        assert key in out  # few events can bind: the tree DP proves the plan before any MILP back-end runs
    assert "feed_forward" in out
    assert main(["plan", *TINY, "--budget", "65.75MiB", "--solver", "cbc"]) == 0
    assert "tree DP: optimal" in capsys.readouterr().out  # whichever back-end was asked for
    assert main(["plan", *TINY, "--budget", "65.75MiB", "--solver", "cbc", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["solver"] == "cbc"


def test_plan_json(capsys):
    assert main(["plan", *TINY, "--budget", "65.75MiB", "--json", "--solver", "highs"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["solver"] == "highs" and d["decisions"]
    assert d["predicted_peak_bytes"] <= d["budget_bytes"]
    assert main(["plan", *TINY, "--budget", "65.75MiB", "--json", "--world-size", "2"]) == 0
    d2 = json.loads(capsys.readouterr().out)
    assert d2["world_size"] == 2 and d2["baseline_peak_bytes"] < d["baseline_peak_bytes"]  # state sharded


def test_plan_not_needed_with_default_budget(capsys):
    assert main(["plan", *TINY]) == 0  # 80% of an H100
    assert "no module is checkpointed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, code, needle",
    [
        (["plan", *TINY, "--device", "h900"], 2, "unknown device"),
        (["plan", *TINY, "--device", "tpu"], 2, "unknown device 'tpu'"),
        (["plan", *TINY, "--device", "a100"], 2, "ambiguous: name one of a100-40gb"),
        (["validate", "llama-tiny", "--plan", "p.json", "--device", "cpu"], 2, "use --on cpu or --on cuda"),
        (["plan", "cnn-tiny", "-q", "--seq", "64"], 2, "--seq does not apply to cnn-tiny"),
        (["plan", *TINY, "--budget", "lots"], 2, "cannot parse memory budget"),
        (["plan", *TINY, "--budget", "65MiB"], 3, "minimum feasible"),
        (["plan", "no/such/file.py:build", "-q"], 2, "does not exist"),
        (["plan", "llama-tinyy", "-q"], 2, "unknown model"),
        (["plan", *TINY, "--batch", "0"], 2, "positive integer"),
        (["frobnicate"], 2, "invalid choice"),
        (["show", "no/such/plan.json"], 1, "cannot read plan file"),
    ],
)
def test_bad_arguments(argv, code, needle, capsys):
    assert main(argv) == code
    line, _ = _err_line(capsys)
    assert needle in line


def test_infeasible_message_states_the_minimum_readably(capsys):
    assert main(["plan", *TINY, "--budget", "65MiB"]) == 3
    line, _ = _err_line(capsys)
    # 64 MiB of them are the H100's two cuBLAS workspaces. Without those: norm leaves are checkpoint candidates
    # too (1.38 MiB when only non-leaf modules were); 1.28 MiB before
    # AdamW's step scalars (512 B each on a GPU target) were known to live on the host; 1.27 MiB before a
    # checkpointed call's held inputs (kept by the checkpoint until its backward ends) were counted
    assert "budget 65.00 MiB is infeasible; minimum feasible budget is 65.30 MiB" in line


def test_factory_file_errors(tmp_path, capsys):
    f = tmp_path / "m.py"
    f.write_text("import torch\ndef build():\n    return torch.nn.Linear(4, 4)\n")
    assert main(["plan", f"{f}:nope", "-q"]) == 2
    line, _ = _err_line(capsys)
    assert "no function 'nope'" in line and "build" in line
    assert main(["plan", str(f), "-q"]) == 2
    line, _ = _err_line(capsys)
    assert "name the factory function" in line


MLP = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 64)
    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + x

def model():
    return nn.Sequential(*[Block() for _ in range(3)])
"""


def test_factory_file_dict_with_labels_and_loss(tmp_path, capsys):
    f = tmp_path / "mlp.py"
    f.write_text(MLP + textwrap.dedent("""
        def build():
            x, labels = torch.randn(512, 64), torch.randint(0, 64, (512,))
            return dict(model=model(), inputs=(x,), loss_fn=lambda out, inputs: nn.functional.cross_entropy(out, labels),
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    """))
    assert main(["plan", f"{f}:build", "-q", "--device", "a100-40gb", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model_name"] == "mlp.py:build" and d["status"] == "not needed"
    assert main(["sweep", f"{f}:build", "-q", "--points", "3"]) == 0
    out = capsys.readouterr().out
    assert "full AC (3 blocks)" in out
    assert main(["plan", f"{f}:build", "-q", "--budget", "1KiB"]) == 3
    line, _ = _err_line(capsys)
    assert "a smaller batch in your factory's inputs" in line and "--batch" not in line


@pytest.mark.parametrize(
    "body, needle",
    [
        ("return model()", "returned a model but no inputs: return a dict with one batch of inputs and the loss, "
                           "e.g. return dict(model=model, inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, y))"),
        ("return [model()]", "returned list; it must return dict(model=..., inputs=..., loss_fn=..., optimizer=...)"),
        ("return dict(model=model(), inputs=torch.randn(2, 64), labels=1)", "unknown keys ['labels']"),
        ("return dict(model=model())", "returned no inputs"),
        ("return dict(model=model(), inputs=torch.randn(2, 64), loss_fn=3)", "'loss_fn' must be callable"),
    ],
)
def test_factory_errors_say_what_to_return(tmp_path, capsys, body, needle):
    f = tmp_path / "mlp.py"
    f.write_text(MLP + f"\ndef build():\n    {body}\n")
    assert main(["plan", f"{f}:build", "-q"]) == 2
    line, _ = _err_line(capsys)
    assert needle in line


def test_factory_tuple_form_still_accepted():
    import torch

    from sacplan.cli_models import parse_factory_output

    m, x = torch.nn.Linear(2, 2), torch.randn(1, 2)
    assert parse_factory_output((m, x), "f") == (m, x, None, None)
    opt = lambda ps: None  # noqa: E731
    assert parse_factory_output((m, x, opt), "f") == (m, x, None, opt)


def test_batch_and_seq_refused_for_file_models(tmp_path, capsys):
    f = tmp_path / "mlp.py"
    f.write_text(MLP + "\ndef build():\n    return dict(model=model(), inputs=torch.randn(2, 64))\n")
    assert main(["plan", f"{f}:build", "-q", "--batch", "4", "--seq", "8"]) == 2
    line, _ = _err_line(capsys)
    assert "--batch and --seq apply to presets only" in line
    assert main(["validate", f"{f}:build", "--plan", "p.json", "--batch", "4"]) == 2
    line, _ = _err_line(capsys)
    assert "--batch/--seq apply to presets only" in line


def test_help_states_the_factory_contract(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "dict(model=..., inputs=..., loss_fn=..., optimizer=...)" in out and "labels" in out


def test_default_job_is_the_default_model_job():
    from sacplan.cli import resolve_job, build_parser

    parse = build_parser().parse_args
    spec0, dev0, budget0, knobs0 = resolve_job(parse(["plan"]))
    spec1, dev1, budget1, knobs1 = resolve_job(parse(["plan", "llama-1b"]))
    assert (spec0.label, dev0, budget0, knobs0) == (spec1.label, dev1, budget1, knobs1)
    assert knobs0 == {"batch": 3, "seq": 8192, "dtype": "bf16"}


def test_plan_header_states_batch_and_seq(capsys):
    assert main(["plan", *TINY]) == 0
    assert "  batch 2, seq 64, dtype bf16" in capsys.readouterr().out


def test_models(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama-1b" in out and "batch 3 x seq 8192" in out and "cnn-tiny" in out and "file.py:factory" in out
    assert main(["models", "--json"]) == 0
    assert "llama-70b" in [m["name"] for m in json.loads(capsys.readouterr().out)]


def test_help_imports_no_torch():
    code = "import sys, sacplan.cli as c; c.build_parser().format_help(); print('torch' in sys.modules, 'pulp' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_show(plan_file, capsys):
    assert main(["show", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "SAC plan: llama-tiny" in out and "feed_forward" in out
    assert main(["show", str(plan_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_name"] == "llama-tiny"


def test_sweep_monotone(capsys, tmp_path):
    assert main(["sweep", *TINY, "--points", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    rows = d["rows"]
    assert len(rows) == 5
    budgets = [r["budget_bytes"] for r in rows]
    ms = [r["recompute_ms"] for r in rows]
    assert budgets == sorted(budgets)
    assert budgets[0] == d["min_feasible_bytes"] and budgets[-1] == d["baseline_peak_bytes"]
    assert all(b <= a + 1e-9 for a, b in zip(ms, ms[1:])), ms
    assert ms[-1] == 0.0
    assert d["full_ac_point"]["recompute_ms"] >= ms[0] - 1e-9
    png = tmp_path / "p.png"
    assert main(["sweep", *TINY, "--budgets", "65MiB,65.6MiB,66MiB", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "infeasible" in out and png.stat().st_size > 0


def test_devices(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "H100-SXM" in out and "memory GiB" in out
    assert main(["devices", "--json"]) == 0
    names = [d["name"] for d in json.loads(capsys.readouterr().out)]
    assert "H100-SXM" in names


def test_validate_preset(plan_file, capfd):
    assert main(["validate", "llama-tiny", "--plan", str(plan_file), "--on", "cpu"]) == 0
    out, err = capfd.readouterr()
    assert "peak, with plan" in out and "gradients" in out
    assert "predicted for this host (cpu)" in out and "the plan's own prediction, for its target H100-SXM" in out
    assert "step ms, with plan (median of 3 after warm-up)" in out
    assert "sacplan: real steps with the plan" in err
    assert "USDT" not in out + err  # the profiler's native log lines are filtered out


def test_validate_builds_a_preset_in_the_dtype_plan_made_it(tmp_path, capfd):
    """`sacplan plan PRESET --device cpu` plans the preset in bf16 (its default): `validate` on this CPU builds it
    in bf16 too, so the host's prediction is the plan's own (it validated an fp32 model against a bf16 plan)."""
    p = tmp_path / "p.json"
    assert main(["plan", "llama-tiny", "--device", "cpu", "--budget", "1.7MiB", "-o", str(p), "-q"]) == 0
    capfd.readouterr()
    assert main(["validate", "llama-tiny", "--plan", str(p), "--on", "cpu", "-q"]) == 0
    out = capfd.readouterr().out
    assert "(the same as re-predicted above for this host)" in out, out
    assert main(["validate", "llama-tiny", "--plan", str(p), "--on", "cpu", "-q", "--dtype", "fp32"]) == 0
    assert "whose sizes, kernels or dtype may differ" in capfd.readouterr().out
    f = tmp_path / "m.py"
    f.write_text("import torch\ndef build():\n    return dict(model=torch.nn.Linear(4, 4), inputs=(torch.randn(2, 4),))\n")
    assert main(["validate", f"{f}:build", "--plan", str(p), "--dtype", "bf16"]) == 2
    assert "--dtype applies to presets only" in capfd.readouterr().err


def test_python_m_sacplan_devices():
    r = subprocess.run([sys.executable, "-m", "sacplan", "devices"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "H100-SXM" in r.stdout


def test_plan_certify(capsys):
    """--certify prints, beside the plan, the best recompute any plan can have at the budget and a lower bound."""
    assert main(["plan", *TINY, "--budget", "65.6MiB", "--certify"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("best possible at this budget:"))
    assert "proven optimal over every plan" in line and "no plan below" in line
    assert main(["plan", *TINY, "--budget", "65.6MiB", "--certify", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    cert = d["certificate"]
    assert cert["proven"] and cert["lower_bound_ms"] <= cert["best_ms"] <= d["recompute_ms"] + 1e-12
    assert cert["budget_bytes"] == d["budget_bytes"]


def test_plan_for_another_model_names_it(plan_file, capsys):
    assert main(["validate", "cnn-tiny", "--plan", str(plan_file), "-q"]) == 2
    line, _ = _err_line(capsys)
    assert f"{plan_file} was made for llama-tiny" in line and "not cnn-tiny" in line
    assert f"sacplan validate llama-tiny --plan {plan_file}" in line and "sacplan plan cnn-tiny -o PLAN.json" in line


def test_show_a_json_dump_points_to_o(tmp_path, capsys):
    dump = tmp_path / "x.json"
    assert main(["plan", *TINY, "--json"]) == 0
    dump.write_text(capsys.readouterr().out)
    assert main(["show", str(dump)]) == 1
    line, _ = _err_line(capsys)
    assert "`sacplan plan --json` output, not a plan file" in line and "-o plan.json" in line


def test_plan_file_mode_follows_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        assert main(["plan", *TINY, "-o", str(tmp_path / "p.json")]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "p.json").stat().st_mode & 0o777 == 0o644


def test_a_flat_sweep_says_why(capsys):
    # batch 1 x 8 tokens: the step peaks in the optimizer step, where no activation is live
    assert main(["sweep", *TINY, "--batch", "1", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "not needed" in out
    assert "flat: no plan lowers this step's peak" in out and "optimizer step" in out and "--batch/--seq" in out
    assert main(["sweep", *TINY, "--points", "3"]) == 0  # a sweep where planning matters says nothing of the kind
    assert "flat:" not in capsys.readouterr().out


def test_plan_names_the_next_steps(tmp_path, capsys):
    assert main(["plan", *TINY, "--budget", "65.75MiB"]) == 0
    out = capsys.readouterr().out
    assert "rerun with -o plan.json" in out and "sacplan validate llama-tiny --plan plan.json" in out
    assert "sacplan.apply_plan(model, sacplan.load_plan('plan.json', model=model))" in out
    p = tmp_path / "p.json"
    assert main(["plan", *TINY, "--budget", "65.75MiB", "-o", str(p)]) == 0
    out = capsys.readouterr().out
    assert "rerun with -o" not in out and f"--plan {p}" in out
    assert main(["plan", *TINY]) == 0  # nothing to apply
    assert "nothing to apply" in capsys.readouterr().out
