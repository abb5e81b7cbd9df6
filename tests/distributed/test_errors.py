"""Bad input for multi-GPU planning: every mistake is a typed sacplan error that says what to do.

Unknown unit names, world sizes below 1 (or not integers), FSDP units of a wrong type, a model that is not
the one the stats came from, and FSDP units nested inside checkpoint units, through ``shard_stats``,
``collect``, ``solve``, ``sac_milp``, ``check_units`` and the CLI (exit 2, one line).
"""

from __future__ import annotations

import pytest
import torch

from sacplan.cli import main
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.distributed import check_units, shard_stats
from sacplan.errors import ConfigError
from sacplan.models import get_model
from sacplan.solver import sac_milp, solve
from sacplan.tree import ModuleTree


@pytest.fixture(scope="module")
def setup():
    preset = get_model("llama-tiny")
    build = lambda: preset.build(n_layers=2)  # noqa: E731
    args = preset.example_inputs(2, 64)
    stats = collect(build, args, device=CPU, loss_fn=preset.loss_fn)
    return preset, build, args, stats, ModuleTree(stats)


@pytest.mark.parametrize("ws", [0, -1, 1.5, 2.0, True, "2"])
def test_world_size_below_one_or_not_an_integer(setup, ws):
    preset, build, args, stats, tree = setup
    with pytest.raises(ConfigError, match="world_size must be an integer >= 1"):
        shard_stats(stats, ws)
    with pytest.raises(ConfigError, match="world_size must be an integer >= 1"):
        solve(tree, int(stats.peak_bytes * 0.9), world_size=ws)
    with pytest.raises(ConfigError, match="world_size must be an integer >= 1"):
        sac_milp(tree, memory_budget=stats.peak_bytes * 0.9 / 2**30, world_size=ws)


def test_collect_world_size_zero(setup):
    preset, build, args, _, _ = setup
    with pytest.raises(ConfigError, match="world_size must be an integer >= 1, got 0"):
        collect(build, args, device=CPU, loss_fn=preset.loss_fn, world_size=0)


def test_unknown_unit_names_suggest_close_ones(setup):
    preset, build, args, stats, tree = setup
    budget = int(stats.peak_bytes * 0.9)
    with pytest.raises(ConfigError, match=r"'layers\.9' is not a module of this model; did you mean"):
        shard_stats(stats, 2, fsdp_units=["layers.9"])
    with pytest.raises(ConfigError, match=r"'layers\.9'.*did you mean"):
        collect(build, args, device=CPU, loss_fn=preset.loss_fn, world_size=2, fsdp_units=["layers.9"])
    with pytest.raises(ConfigError, match=r"no module named 'layers\.9'.*did you mean"):
        solve(tree, budget, fsdp_units=["layers.9"])
    with pytest.raises(ConfigError, match=r"no module named 'layers\.9'.*did you mean"):
        sac_milp(tree, memory_budget=budget / 2**30, fsdp_units=["layers.9"])
    with pytest.raises(ConfigError, match=r"no module named 'layers\.9'"):
        sac_milp(tree, memory_budget=budget / 2**30, ac_units=["layers.9"])
    with pytest.raises(ConfigError, match=r"no module named 'layers\.9'"):
        check_units(tree, ["layers.0"], ["layers.9"])


@pytest.mark.parametrize("units", [5, [5], "layers.0", [None]])
def test_fsdp_units_of_a_wrong_type(setup, units):
    stats = setup[3]
    with pytest.raises(ConfigError, match="fsdp_units must be"):
        shard_stats(stats, 2, fsdp_units=units)


def test_model_that_is_not_the_stats_model(setup):
    preset, _, _, stats, _ = setup
    with torch.device("meta"):
        other = preset.build(n_layers=3)
        same = preset.build(n_layers=2)
    with pytest.raises(ConfigError, match=r"not the model these stats were collected from.*layers\.2"):
        shard_stats(stats, 2, model=other)
    assert shard_stats(stats, 2, model=same).meta["distributed"]["shapes"].startswith("exact")


def test_fsdp_unit_nested_in_a_checkpoint_unit(setup):
    """``check_units`` refuses; ``solve`` / ``sac_milp`` follow PyTorch's ``sac_milp`` (never checkpoint it)."""
    _, _, _, stats, tree = setup
    with pytest.raises(ConfigError, match=r"FSDP unit 'layers\.0' is nested inside checkpoint unit '<root>'"):
        check_units(tree, [""], ["layers.0"])
    with pytest.raises(ConfigError, match=r"nested inside checkpoint unit 'layers\.0'"):
        check_units(tree, ["layers.0"], ["layers.0.attention"])
    check_units(tree, ["layers.0", "layers.1.attention"], ["layers.0", "layers.1"])  # itself or inside: fine
    from sacplan.solver import min_feasible_budget

    per_rank = shard_stats(stats, 2)
    t2 = ModuleTree(per_rank)
    # the peak is in layers.1's backward, which only checkpointing layers.0 lowers; layers.1 holds the FSDP unit
    ac, fs = ["layers.0", "layers.1"], ["layers.1.attention"]
    budget = min_feasible_budget(t2, ac_units=ac, fsdp_units=fs)
    assert budget < t2.stats.peak_bytes
    with pytest.warns(UserWarning, match=r"ac unit 'layers\.1' is an ancestor of an FSDP unit"):
        plan = solve(t2, budget, ac_units=ac, fsdp_units=fs)
    assert {d.fqn for d in plan.decisions} == {"layers.0"}  # the budget needs checkpointing; only layers.0 may
    with pytest.warns(UserWarning, match="ancestor of an FSDP unit"):
        decisions, _, _ = sac_milp(t2, memory_budget=budget / 2**30, ac_units=ac, fsdp_units=fs)
    assert decisions.get("layers.1", 0) == 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--world-size", "0"], "--world-size: expected a positive integer, got '0'"),
        (["--world-size", "-2"], "--world-size: expected a positive integer, got '-2'"),
        (["--world-size", "two"], "--world-size: expected a positive integer, got 'two'"),
        (["--world-size", "2", "--fsdp-units", "layers.9"], "FSDP unit 'layers.9' is not a module of this model"),
    ],
)
def test_cli_exits_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        rc = main(["plan", "llama-tiny", "-q", *argv])
        raise SystemExit(rc)
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], err
