"""Plan files: versioned JSON, atomic writes, and a clear error for every way a file can be wrong."""

from __future__ import annotations

import json

import pytest

from sacplan.errors import PlanError, PlanMismatchError
from sacplan.plan import PLAN_FILE_VERSION, load_plan
from sacplan.solver import solve


@pytest.fixture(scope="module")
def plan(llama_setup):
    _, _, _, tree = llama_setup
    return solve(tree, int(tree.stats.peak_bytes * 0.7))


def test_round_trip(plan, tmp_path, llama_setup):
    path = plan.save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "sacplan.plan-file" and doc["version"] == PLAN_FILE_VERSION
    assert {"sacplan_version", "torch_version", "created", "plan"} <= doc.keys()
    back = load_plan(path, model=llama_setup[0]())
    assert back == plan
    assert back.to_dict() == plan.to_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp file left behind


def test_atomic_write_keeps_old_file_on_failure(plan, tmp_path, monkeypatch):
    path = plan.save(tmp_path / "p.json")
    before = path.read_text()
    import json as json_mod

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(json_mod, "dumps", boom)
    with pytest.raises(RuntimeError):
        plan.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def _write(tmp_path, doc, name="bad.json"):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def test_older_file_with_input_shapes_and_checkpoint_keys_loads(plan, tmp_path):
    """Files written before the envelope dropped ``input_shapes`` (always ``[]``) still load."""
    doc = json.loads(plan.save(tmp_path / "p.json").read_text())
    assert "input_shapes" not in doc
    doc["input_shapes"] = []
    for d in doc["plan"]["decisions"]:
        d["checkpoint"] = True
    assert load_plan(_write(tmp_path, doc, "old.json")) == plan
    assert plan.decisions
    doc["plan"]["decisions"][0]["checkpoint"] = False  # hand-written: that module is not checkpointed
    back = load_plan(_write(tmp_path, doc, "off.json"))
    assert back.checkpointed == plan.checkpointed[1:]


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "nope.json")


def test_damaged_json(tmp_path):
    with pytest.raises(PlanError, match="damaged"):
        load_plan(_write(tmp_path, '{"schema": "sacplan.plan-file", "vers'))


def test_not_a_plan(tmp_path):
    with pytest.raises(PlanError, match="not a sacplan plan file"):
        load_plan(_write(tmp_path, {"hello": 1}))


def test_newer_version(plan, tmp_path):
    doc = json.loads(plan.save(tmp_path / "p.json").read_text())
    doc["version"] = PLAN_FILE_VERSION + 1
    with pytest.raises(PlanError, match="newer"):
        load_plan(_write(tmp_path, doc))


@pytest.mark.parametrize("field", ["budget_bytes", "fingerprint", "decisions"])
def test_missing_field_is_named(plan, tmp_path, field):
    doc = json.loads(plan.save(tmp_path / "p.json").read_text())
    del doc["plan"][field]
    with pytest.raises(PlanError, match=f"plan.{field}"):
        load_plan(_write(tmp_path, doc))


def test_bad_ratio_names_module(plan, tmp_path):
    doc = json.loads(plan.save(tmp_path / "p.json").read_text())
    doc["plan"]["decisions"][0]["discard_ratio"] = 1.7
    with pytest.raises(PlanError, match=doc["plan"]["decisions"][0]["fqn"].replace(".", r"\.")):
        load_plan(_write(tmp_path, doc))


def test_bad_saved_ops(plan, tmp_path):
    doc = json.loads(plan.save(tmp_path / "p.json").read_text())
    doc["plan"]["decisions"][0]["saved_ops"] = [[1, "aten.mm.default"]]
    with pytest.raises(PlanError, match="saved_ops"):
        load_plan(_write(tmp_path, doc))


def test_other_model(plan, tmp_path):
    from sacplan.models import get_model
    from sacplan.models.llama import Llama

    path = plan.save(tmp_path / "p.json")
    small = Llama(get_model("llama-tiny").config.with_(n_layers=2))
    with pytest.raises(PlanMismatchError):
        load_plan(path, model=small)
    wider = Llama(get_model("llama-tiny").config.with_(n_layers=4, dim=128))
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        load_plan(path, model=wider)
