"""validate(compile=...) and ``sacplan validate --compile``: compiled (Inductor, CPU) steps against the
prediction for the compiled step (tests/apply/test_compiled_prediction.py checks its rules on tiny models, by
default). The compiled runs here take a minute or more on 2 cores (Inductor compiles each graph with a C++
compiler), so they run under ``-m slow``; the argument handling runs by default."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sacplan
import sacplan.validation
from sacplan.cli import main
from sacplan.compiling import compile_choice
from sacplan.errors import ConfigError
from sacplan.solver import baseline_peak, min_feasible_budget, solve


def test_compile_choice():
    assert compile_choice(True, ("layers.0", "layers.1")) == "blocks"  # as torchtitan compiles
    assert compile_choice(True, ()) == "model"
    assert compile_choice("model", ("layers.0",)) == "model"
    assert compile_choice(False, ("layers.0",)) is None and compile_choice(None, ()) is None
    with pytest.raises(ConfigError, match="no repeated blocks"):
        compile_choice("blocks", ())
    with pytest.raises(ConfigError, match="compile must be True, False, 'blocks' or 'model'"):
        compile_choice("max-autotune", ("a",))


def test_a_bad_compile_value_fails_before_any_step():
    said: list[str] = []
    with pytest.raises(ConfigError, match="compile must be"):
        sacplan.validate(lambda: nn.Linear(4, 4), (torch.randn(2, 4),), object.__new__(type("P", (), {"decisions": ()})),
                         compile="yes", progress=said.append)
    assert said == []  # not even the fake step


@pytest.mark.parametrize("flag, value", [(["--compile"], True), (["--compile", "model"], "model"), ([], False)])
def test_cli_compile_reaches_validate(flag, value, tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_validate(*a, **kw):
        seen.update(kw)
        raise sacplan.errors.SacplanError("stopped here")

    monkeypatch.setattr(sacplan.validation, "validate", fake_validate)
    plan = tmp_path / "p.json"
    assert main(["plan", "llama-tiny", "-q", "--budget", "65.75MiB", "-o", str(plan)]) == 0
    assert main(["validate", "llama-tiny", "--plan", str(plan), "-q", *flag]) == 1
    assert seen["compile"] == value


def _blocks(n: int = 4, d: int = 128) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)])


@pytest.mark.slow  # ~1-3 min: Inductor compiles the blocks' forward and backward, with and without the plan
def test_compiled_steps_stay_under_the_prediction():
    """4 LayerNorm-Linear-GELU-Linear blocks (nn.Sequential: compiled through compile_model's own frame), a
    solved plan that saves layer norms."""
    torch.manual_seed(0)
    x = torch.randn(512, 128)
    stats = sacplan.collect(_blocks, (x,), device="cpu")
    tree = sacplan.ModuleTree(stats)
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    plan = solve(tree, int(lo + 0.3 * (hi - lo)))
    assert plan.decisions
    eager = sacplan.validate(_blocks, (x,), plan, timed_steps=0)
    r = sacplan.validate(_blocks, (x,), plan, compile=True, timed_steps=0)
    assert "4 repeated blocks compiled one by one (inductor)" in r.summary()
    # the plan saves layer norms: under compile each also keeps its normalized input
    assert r.predicted_peak_bytes > eager.predicted_peak_bytes
    # without a plan: the compiled regions (sacplan.compiled_partition) save no more than eager here
    assert r.predicted_baseline_peak_bytes <= eager.predicted_baseline_peak_bytes
    # measured <= predicted, within 3%, without and with the plan (2026-11-26, regions compiled on fakes: exact
    # both; with the compiled_saves bound -0.18% planned; with the eager prediction the planned step measured
    # 1.70% above it)
    assert -0.03 <= r.baseline_peak_error <= 0, r.summary()
    assert -0.03 <= r.peak_error <= 0, r.summary()
    assert r.planned.peak_bytes < r.baseline.peak_bytes  # and the plan still lowers the compiled peak
    assert r.measured_recompute_flops is None and "not counted" in r.summary()
    assert r.grads_match


@pytest.mark.slow  # ~1-3 min
def test_cli_validate_compile(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)])\n"
        "    return dict(model=m, inputs=(torch.randn(256, 64, generator=g),))\n"
    )
    assert main(["plan", "m.py:build", "-q", "--budget", "66.6MiB", "-o", "p.json"]) == 0
    capsys.readouterr()
    assert main(["validate", "m.py:build", "--plan", "p.json", "-q", "--compile"]) == 0
    out = capsys.readouterr().out
    assert "compiled: 3 repeated blocks compiled one by one (inductor)" in out and "not counted" in out


@pytest.mark.slow
def test_many_planned_blocks_compile_without_recompiling():
    """Each planned block's forward is its own object (the plan's _PlannedForward), yet 12 checkpointed blocks
    compiled one by one trace one graph: no recompilation, so Dynamo's cache-size limit (8) is not reached."""
    import torch._dynamo

    from sacplan.alternatives import plan_from_choices
    from sacplan.apply import apply_plan
    from sacplan.blocks import repeated_blocks
    from sacplan.collector import collect
    from sacplan.compiling import compile_model
    from sacplan.models import get_model
    from sacplan.tree import ModuleTree

    p = get_model("llama-tiny")

    def build():
        return p.build(n_layers=12)

    x = p.example_inputs(2, 32)
    stats = collect(build, x, device="cpu", loss_fn=p.loss_fn)
    plan = plan_from_choices(ModuleTree(stats), {f"layers.{i}": None for i in range(12)}, "full")
    m = build()
    apply_plan(m, plan)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_model(m, "blocks", repeated_blocks(stats)).startswith("12 repeated blocks")
    args = x if isinstance(x, tuple) else (x,)
    for _ in range(2):
        p.loss_fn(m(*args), *args).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
