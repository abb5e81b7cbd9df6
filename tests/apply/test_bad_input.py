"""apply_plan's arguments and Plan.save's destination (issue 15): typed errors, never a traceback."""

from __future__ import annotations

import tempfile

import pytest

from sacplan.apply import applied_plan, apply_plan, remove_plan
from sacplan.enable import show_plan
from sacplan.validation import validate
from sacplan.errors import ConfigError
from sacplan.solver import solve


@pytest.fixture(scope="module")
def plan(llama_setup):
    _, _, _, tree = llama_setup
    return solve(tree, int(tree.stats.peak_bytes * 0.7))


@pytest.mark.parametrize("bad, needle", [("plan.json", "load_plan"), ({}, "from_dict"), (3, "solve"), (None, "solve")])
def test_plan_argument_must_be_a_plan(llama_setup, bad, needle, tmp_path):
    model = llama_setup[0]()
    with pytest.raises(ConfigError, match=needle):
        apply_plan(model, bad)


def test_plan_path_object(llama_setup, tmp_path, plan):
    path = plan.save(tmp_path / "p.json")
    with pytest.raises(ConfigError, match="load_plan"):
        apply_plan(llama_setup[0](), path)


def test_model_argument_must_be_a_module(plan):
    with pytest.raises(ConfigError, match="nn.Module"):
        apply_plan("llama-tiny", plan)
    for call in (remove_plan, show_plan, applied_plan):
        with pytest.raises(ConfigError, match=f"{call.__name__} needs the nn.Module"):
            call(None)


def test_show_plan_needs_a_plan(llama_setup):
    with pytest.raises(ConfigError, match="show_plan needs a Plan, got str"):
        show_plan(llama_setup[0](), "plan.json")


def test_validate_needs_a_model_factory_and_a_plan(llama_setup, plan):
    model_fn, inputs_fn = llama_setup[0], llama_setup[1]
    with pytest.raises(ConfigError, match="factory"):
        validate(model_fn(), inputs_fn, plan)  # the model itself: validate must build it twice
    with pytest.raises(ConfigError, match="validate needs the Plan"):
        validate(model_fn, inputs_fn, None)


def test_save_under_a_regular_file_names_the_destination(plan, tmp_path):
    (tmp_path / "f").write_text("x")
    dest = tmp_path / "f" / "plan.json"
    with pytest.raises(ConfigError) as e:
        plan.save(dest)
    assert str(dest) in str(e.value) and ".tmp" not in str(e.value)


def test_save_into_a_read_only_folder_names_the_destination(plan, tmp_path, monkeypatch):
    def denied(*a, **k):  # what mkstemp raises in a read-only folder (tests may run as root, who writes anyway)
        raise PermissionError(13, "Permission denied", str(tmp_path / ".plan.json.abc.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(ConfigError, match="writable") as e:
        plan.save(tmp_path / "plan.json")
    assert str(tmp_path / "plan.json") in str(e.value) and ".tmp" not in str(e.value)


def test_save_onto_a_directory(plan, tmp_path):
    with pytest.raises(ConfigError, match="directory"):
        plan.save(tmp_path)
