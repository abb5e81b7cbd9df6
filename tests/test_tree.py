"""ModuleTree: structure from collected stats, JSON round trip, PyTorch ModuleInfo adapter, bad trees."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import ConfigError
from sacplan.tree import ModuleTree


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.blk = Inner()
        self.shared = nn.Linear(8, 8)
        self.post = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x):
        h = self.shared(self.shared(self.blk(self.pre(x))))
        return self.post(h)


@pytest.fixture(scope="module")
def stats():
    return collect(Nested(), (torch.randn(4, 8),), device=CPU)


@pytest.fixture(scope="module")
def tree(stats):
    return ModuleTree(stats)


def test_structure(tree):
    assert tree.fqns == ("", "pre", "blk", "blk.a", "blk.b", "shared", "post", "post.0", "post.1")
    expect = {
        # fqn: (parent fqn, children fqns, depth, leaf)
        "": (None, ("pre", "blk", "shared", "post"), 0, False),
        "pre": ("", (), 1, True),
        "blk": ("", ("blk.a", "blk.b"), 1, False),
        "blk.a": ("blk", (), 2, True),
        "blk.b": ("blk", (), 2, True),
        "shared": ("", (), 1, True),
        "post": ("", ("post.0", "post.1"), 1, False),
        "post.0": ("post", (), 2, True),
        "post.1": ("post", (), 2, True),
    }
    for fqn, (parent, children, depth, leaf) in expect.items():
        n = tree.node(fqn)
        assert (tree.nodes[n.parent].fqn if n.parent is not None else None) == parent, fqn
        assert tuple(tree.nodes[c].fqn for c in n.children) == children, fqn
        assert (n.depth, n.is_leaf) == (depth, leaf), fqn
        assert n.stats.fqn == fqn and n.is_leaf == n.stats.is_leaf
    assert tree.root.fqn == "" and len(tree) == 9 and "blk.a" in tree and "nope" not in tree
    assert [n.fqn for n in tree.descendants("blk")] == ["blk.a", "blk.b"]
    assert [n.fqn for n in tree.ancestors("blk.b")] == ["blk", ""]
    assert tree.node("blk").subtree_end == tree.index_of("shared")
    assert tree.root.is_ancestor_of(tree.node("post.1")) and not tree.node("blk").is_ancestor_of(tree.node("post"))
    assert [n.fqn for n in tree.leaves()] == ["pre", "blk.a", "blk.b", "shared", "post.0", "post.1"]
    assert tree.node("shared").stats.calls == 2


def test_unknown_fqn_names_close_matches(tree):
    with pytest.raises(ConfigError, match="blk.a"):
        tree.node("blk.aa")


def test_dict_round_trip(tree):
    d = tree.to_dict()
    again = ModuleTree.from_dict(d)
    assert again.to_dict() == d
    via_json = ModuleTree.from_dict(json.loads(json.dumps(d)))
    assert via_json.to_dict() == d
    assert via_json.stats == tree.stats  # every number survives, frozen dataclasses compare by value
    assert via_json.fqns == tree.fqns


def test_from_dict_rejects_other_documents(tree):
    with pytest.raises(ConfigError, match="schema"):
        ModuleTree.from_dict({"stats": {}})
    newer = dict(tree.to_dict(), version=99)
    with pytest.raises(ConfigError, match="newer"):
        ModuleTree.from_dict(newer)


def test_torch_module_info_parses(tree):
    from torch.distributed._tools.ilp_utils import parse_module_info

    info = tree.to_torch_module_info()
    assert len(info["mod_stats"]) == len(tree)
    # a module called twice appears once in the reference's orders
    assert info["mod_order"]["fw_pre_order"].count("Nested.shared") == 1
    graph = parse_module_info(info)
    assert len(graph.nodes) == len(tree)
    assert graph.nodes[0]["fqn"] == "Nested"
    # ancestor/descendant matrix: the root is above everything, blk above blk.a and blk.b only
    i_blk = [n["fqn"] for n in graph.nodes].index("Nested.blk")
    assert all(graph.ad_matrix[0][j] == 1 for j in range(len(tree)))
    assert [graph.ad_matrix[i_blk][j] for j in range(len(tree))] == [0, 0, 1, 1, 1, 0, 0, 0, 0]
    root = info["mod_stats"][0]
    assert root["param_per_module"] == tree.stats.param_bytes
    assert root["act_fw_per_module"] == tree.root.stats.act_bytes[0]
    assert ModuleTree.torch_fqn_to_sacplan("Nested.blk.a") == "blk.a"
    assert ModuleTree.torch_fqn_to_sacplan("Nested") == ""


def _with_modules(stats, modules):
    return dataclasses.replace(stats, modules=tuple(modules))


def test_bad_trees_raise_config_error(stats):
    mods = list(stats.modules)
    orphan = dataclasses.replace(mods[3], parent="nowhere")
    with pytest.raises(ConfigError, match="nowhere"):
        ModuleTree(_with_modules(stats, mods[:3] + [orphan] + mods[4:]))
    with pytest.raises(ConfigError, match="twice"):
        ModuleTree(_with_modules(stats, mods + [mods[1]]))
    with pytest.raises(ConfigError, match="pre-order"):
        ModuleTree(_with_modules(stats, [mods[0], mods[3], mods[2]] + mods[4:]))  # blk.a before blk
    with pytest.raises(ConfigError, match="root"):
        ModuleTree(_with_modules(stats, mods + [dataclasses.replace(mods[1], fqn="other", parent=None)]))
    with pytest.raises(ConfigError, match="no modules"):
        ModuleTree(_with_modules(stats, []))


@pytest.mark.parametrize("stats", [None, {}, "stats"])
def test_module_tree_needs_model_stats(stats):
    with pytest.raises(ConfigError, match="ModelStats"):
        ModuleTree(stats)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _nested_dropout() -> nn.Module:
    inner = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128))
    return nn.Sequential(nn.Linear(64, 128), inner, nn.Linear(128, 32))


def _memtracker_module_info(mk) -> dict[str, dict[str, int]]:
    """The memory fields ``ilp_utils.aggregate_stats`` computes, from PyTorch's MemTracker entered around two
    steps on CPU fakes (model and input made before it, as PyTorch's ILP test does), by its formulas."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    with FakeTensorMode():
        m, x = mk(), torch.randn(16, 64)
        mt = MemTracker()
        mt.track_external(m)
        with mt:
            for i in range(2):  # second step, as sacplan records
                if i:
                    mt.reset_mod_stats()
                m(x).float().mean().backward()
                m.zero_grad(set_to_none=True)
    dev = torch.device("cpu")
    out = {}
    for ms in mt.memory_tracking.values():
        g = lambda s, t: ms.snapshots[s][-1][dev][t]  # noqa: E731
        out[ms.mod_fqn] = {
            "param_per_module": ms.parameter_mem,
            "grad_per_module": ms.parameter_mem,
            "grad_total": g(_ModState.PRE_BW, _MemRefType.GRAD),
            "act_fw_per_module": max(
                0, g(_ModState.POST_FW, _MemRefType.ACT) - g(_ModState.PRE_FW, _MemRefType.ACT) - ms.output_mem
            ),
            "act_bw_per_module": max(0, g(_ModState.PEAK_BW, _MemRefType.ACT)),
            "act_grad_per_module": g(_ModState.PEAK_BW, _MemRefType.TEMP) - g(_ModState.PRE_BW, _MemRefType.TEMP),
            "act_total": g(_ModState.POST_FW, _MemRefType.ACT),
            "input_per_module": ms.input_mem,
            "output_per_module": ms.output_mem,
        }
    return out


@pytest.mark.parametrize("mk", [_mlp, _nested_dropout], ids=["mlp", "nested_dropout"])
def test_module_info_fields_match_memtracker_on_cpu_fakes(mk):
    """PyTorch's MemTracker on CPU fakes of the same model (CPU kernels on both sides): every memory field of
    ``ModuleInfo`` as ``ilp_utils.aggregate_stats`` defines it, for every module including the root, to the byte.
    (Runtimes and trade-off fits come from different estimators and are not compared.)"""
    st = collect(mk, (torch.randn(16, 64),), device=CPU, optimizer=False)
    ours = {m["fqn"]: m for m in ModuleTree(st).to_torch_module_info()["mod_stats"]}
    ref = _memtracker_module_info(mk)
    assert set(ref) == set(ours)
    for fqn, fields in ref.items():
        assert {k: ours[fqn][k] for k in fields} == fields, fqn


def test_module_info_memory_fields_by_hand():
    """The MLP's fields derived by hand (fp32, batch 16): the example input is not the step's allocation, so
    the root and the first Linear have ``input_per_module`` 0 (MemTracker never tracks it); the second Linear's
    input is the ReLU output, 16*128*4 = 8192; the root's ``act_total`` is the ReLU output (the Linear before
    it is freed: ReLU saves its result) plus the model output 16*32*4 = 2048, which MemTracker counts as ACT."""
    st = collect(_mlp, (torch.randn(16, 64),), device=CPU, optimizer=False)
    info = {m["fqn"]: m for m in ModuleTree(st).to_torch_module_info()["mod_stats"]}
    assert st.module("").input_bytes == 16 * 64 * 4  # sacplan's own figure still counts the example input
    assert [info[f]["input_per_module"] for f in ("Sequential", "Sequential.0", "Sequential.2")] == [0, 0, 8192]
    assert info["Sequential"]["output_per_module"] == 2048
    assert info["Sequential"]["act_total"] == 8192 + 2048
    assert info["Sequential"]["act_fw_per_module"] == 8192  # full checkpointing frees the ReLU output
    assert info["Sequential"]["param_per_module"] == (64 * 128 + 128 + 128 * 32 + 32) * 4
