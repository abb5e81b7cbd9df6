"""Every field of a plan file is validated on load (docs/plan-schema.md); bad files end in a PlanError naming it.

Each case here used to load (and apply something nobody planned) or end in a traceback from json/Python.
The hypothesis test mutates a valid file at random: either a PlanError/ConfigError, or a plan that applies and
keeps the gradients bitwise.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from sacplan.apply import apply_plan, remove_plan
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import ConfigError, PlanError
from sacplan.plan import load_plan
from sacplan.solver import solve
from sacplan.tree import ModuleTree


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(16, 1))


def _loss(out, args):
    return out.float().pow(2).mean()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    _loss(model(x), (x,)).backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return g


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    x = torch.randn(32, 16)
    tree = ModuleTree(collect(tiny, (x,), device=CPU, loss_fn=_loss))
    plan = solve(tree, f"{int(tree.stats.peak_bytes * 0.97)}B")
    assert plan.decisions and any(d.saved_ops for d in plan.decisions), plan.summary()
    path = plan.save(tmp_path_factory.mktemp("plans") / "good.json")
    return x, json.loads(path.read_text()), _grads(tiny(), x)


def _write(tmp_path, doc, name="p.json"):
    p = tmp_path / name
    p.write_bytes(doc if isinstance(doc, bytes) else (doc if isinstance(doc, str) else json.dumps(doc)).encode())
    return p


def _selective(doc):
    return next(d for d in doc["plan"]["decisions"] if d["saved_ops"])


MUTATIONS = {
    "negative discard_bytes": (lambda doc: doc["plan"]["decisions"][0].__setitem__("discard_bytes", -5), "discard_bytes"),
    "nan recompute_ms": (lambda doc: doc["plan"]["decisions"][0].__setitem__("recompute_ms", "nan"), "recompute_ms"),
    "negative budget": (lambda doc: doc["plan"].__setitem__("budget_bytes", -1), "budget_bytes"),
    "nan plan recompute": (lambda doc: doc["plan"].__setitem__("recompute_ms", "nan"), "recompute_ms"),
    "ratio true": (lambda doc: doc["plan"]["decisions"][0].__setitem__("discard_ratio", True), "discard_ratio"),
    "calls 0": (lambda doc: doc["plan"]["decisions"][0].__setitem__("calls", 0), "calls"),
    "world_size 0": (lambda doc: doc["plan"].__setitem__("world_size", 0), "world_size"),
    "version 0": (lambda doc: doc.__setitem__("version", 0), "version"),
    "plan version 0": (lambda doc: doc["plan"].__setitem__("version", 0), "plan.version"),
    "duplicate decision": (lambda doc: doc["plan"]["decisions"].append(copy.deepcopy(doc["plan"]["decisions"][0])), "twice"),
    "nested decision": (
        lambda doc: doc["plan"]["decisions"].append(dict(copy.deepcopy(doc["plan"]["decisions"][0]), fqn="")), "nested"
    ),
    "unknown op": (lambda doc: _selective(doc)["saved_ops"][0].__setitem__(1, "aten.no_such_op.default"), "no_such_op"),
    "negative op index": (lambda doc: _selective(doc)["saved_ops"][0].__setitem__(0, -1), "index"),
    "per_module_peak list": (lambda doc: doc["plan"].__setitem__("per_module_peak", [1, 2]), "per_module_peak"),
    "per_module_peak negative": (lambda doc: doc["plan"].__setitem__("per_module_peak", {"0": -3}), "per_module_peak"),
    "unknown decision key": (lambda doc: doc["plan"]["decisions"][0].__setitem__("discard_ration", 0.5), "discard_ration"),
    "checkpoint string": (lambda doc: doc["plan"]["decisions"][0].__setitem__("checkpoint", "no"), "checkpoint"),
    "gap nan": (lambda doc: doc["plan"].__setitem__("gap", "nan"), "gap"),
    "meta list": (lambda doc: doc["plan"].__setitem__("meta", [1]), "meta"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_bad_field_is_named(setup, tmp_path, name):
    mutate, field = MUTATIONS[name]
    doc = copy.deepcopy(setup[1])
    mutate(doc)
    with pytest.raises(PlanError, match=field):
        load_plan(_write(tmp_path, doc))


def test_good_file_loads_and_applies(setup, tmp_path):
    x, doc, g0 = setup
    model = tiny()
    plan = load_plan(_write(tmp_path, doc), model=model)
    apply_plan(model, plan)
    g1 = _grads(model, x)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xff\xfe{\x00", "not UTF-8"),
        ("[" * 100000 + "]" * 100000, "damaged"),
        ('{"schema": "sacplan.plan-file", "version": NaN}', "damaged"),
    ],
    ids=["latin", "deep", "bare-nan"],
)
def test_undecodable_files(tmp_path, raw, match):
    with pytest.raises(PlanError, match=match):
        load_plan(_write(tmp_path, raw))


def test_bare_nan_inside_the_plan_is_refused(setup, tmp_path):
    text = json.dumps(setup[1]).replace('"recompute_ms": ', '"recompute_ms": NaN, "x": ', 1)
    with pytest.raises(PlanError):
        load_plan(_write(tmp_path, text))


@pytest.mark.parametrize("path", [None, 3, b"p.json", ""])
def test_load_plan_wants_a_path(path):
    with pytest.raises(PlanError, match="path"):
        load_plan(path)


# ----------------------------------------------------------------------------------------------------------
# Random mutations of a valid file
# ----------------------------------------------------------------------------------------------------------
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(min_value=2**63), st.floats(allow_nan=True),
    st.sampled_from(["nan", "inf", "-inf", "", "x", "aten.mm.default", "0"]), st.just([]), st.just({}),
    st.just([0, "aten.mm.default", 0]), st.just([[0, "aten.mm.default", 0]]),
)


def _paths(doc):
    """Every (container, key) in the document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield doc, k
            yield from _paths(v)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield doc, i
            yield from _paths(v)


@st.composite
def mutated(draw, doc):
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        places = list(_paths(doc))
        container, key = draw(st.sampled_from(places))
        kind = draw(st.sampled_from(["set", "delete", "extra", "duplicate"]))
        # copies: st.just hands out one shared object, which a later "duplicate" would grow for every example after
        if kind == "set":
            container[key] = copy.deepcopy(draw(_VALUES))
        elif kind == "delete":
            del container[key]
        elif kind == "extra" and isinstance(container, dict):
            container[draw(st.sampled_from(["extra", "fqn", "calls", "note"]))] = copy.deepcopy(draw(_VALUES))
        elif kind == "duplicate" and isinstance(container, list):
            container.append(copy.deepcopy(container[key]))
    text = json.dumps(doc, allow_nan=True)
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-16", "latin-1"]))
    try:
        return text.encode(encoding)
    except UnicodeEncodeError:
        return text.encode("utf-8")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_plan_files_error_cleanly_or_keep_gradients(setup, tmp_path, data):
    x, doc, g0 = setup
    raw = data.draw(mutated(doc))
    model = tiny()
    try:
        plan = load_plan(_write(tmp_path, raw), model=model)
        apply_plan(model, plan)
    except (PlanError, ConfigError) as e:
        event(f"refused: {type(e).__name__}")
        return
    event("applied")
    g1 = _grads(model, x)
    remove_plan(model)
    assert g0.keys() == g1.keys()
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k
