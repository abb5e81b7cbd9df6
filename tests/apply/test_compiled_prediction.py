"""The prediction for compiled steps: the bounds used where regions cannot be traced (sacplan.compiled_layout,
sacplan.compiled_saves), compile_model's frame, and validate(compile=True) end to end.

The fast tests check each rule on its own; the compiled validations (Inductor on CPU, a tiny conv net and a tiny
MLP, ~1 min each on 2 cores) check the prediction (sacplan.compiled_partition) against the allocator: measured <=
predicted, within 3%."""

from __future__ import annotations

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch import nn

import sacplan
import sacplan.evaluate
from sacplan.alternatives import plan_from_choices
from sacplan.compiled_layout import layout_optimized, region_convolutions, replay_layout
from sacplan.compiled_saves import enclosed_positions, with_compiled_saves
from sacplan.compiling import compile_model
from sacplan.stats import OpStat


class Block(nn.Module):
    """A ResNet basic block without downsampling."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def convnet(c: int = 64, n: int = 2) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *[Block(c) for _ in range(n)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(c, 10))


def mlp(n: int = 3, d: int = 64) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)])


def test_layout_rule_follows_inductor():
    assert not layout_optimized([], "cpu")  # no convolution: nothing to lay out
    assert layout_optimized([((64, 64, 3, 3), 1)], "cpu") == torch.backends.mkldnn.is_available()
    assert layout_optimized([((128, 64, 3, 3), 1)], "cuda")
    assert not layout_optimized([((128, 64, 3, 3), 1), ((64, 32, 3, 3), 2)], "cuda")  # grouped, >1 channel per group
    assert layout_optimized([((128, 1, 3, 3), 128)], "cuda")  # depthwise is fine
    assert not layout_optimized([((64, 128, 3, 3), 1)], "cuda")  # in >= 2 * out
    assert not layout_optimized([((32, 64, 3, 3), 1), ((64, 64, 1, 1), 1)], "cuda")  # all small
    with inductor_config.patch(layout_optimization=False):
        assert not layout_optimized([((64, 64, 3, 3), 1)], "cpu")
    with inductor_config.patch(force_layout_optimization=True):
        assert layout_optimized([((64, 128, 3, 3), 1)], "cuda")


def test_region_convolutions():
    m = convnet(c=16)
    assert region_convolutions(m, ["1", "2"]) == [((16, 16, 3, 3), 1)] * 4
    assert len(region_convolutions(m, [""])) == 5


def test_replayed_layout_keeps_the_math_and_the_names():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    ref, rep = convnet(c=16), convnet(c=16)
    rep.load_state_dict(ref.state_dict())
    replay_layout(rep, ["1", "2"])
    assert [k for k, _ in ref.named_parameters()] == [k for k, _ in rep.named_parameters()]
    ref(x).sum().backward()
    out = rep(x)
    out.sum().backward()
    assert out.is_contiguous()
    for (n, a), b in zip(ref.named_parameters(), rep.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5), n
        assert b.grad.stride() == b.stride(), n  # gradients come back in the parameter's layout


def test_replayed_layout_holds_the_weight_copies_until_backward():
    """The fake step of the replayed model keeps a channels-last copy of each block's conv weights from the
    forward to the backward: its peak (in block 2's backward) is above the eager step's by at least block 1's two
    copies and one of block 2's."""
    x = torch.randn(2, 3, 8, 8)
    eager = sacplan.collect(lambda: convnet(c=64), (x,), device="cpu", optimizer=False)
    replayed = sacplan.collect(lambda: replay_layout(convnet(c=64), ["1", "2"]), (x,), device="cpu", optimizer=False)
    weight = 64 * 64 * 9 * 4
    assert replayed.peak_bytes - eager.peak_bytes >= 3 * weight


def test_compiled_saves_count_the_normalized_input_of_a_saved_layer_norm():
    """Inside compiled regions a saved layer norm also keeps its normalized input (counted as its output once
    more), except as a module's first op on an input the step made (the normalized input replaces that input)."""
    x = torch.randn(32, 64)
    stats = sacplan.collect(mlp, (x,), device="cpu", optimizer=False)
    out = with_compiled_saves(stats, ["0", "1"])
    ln = "aten.native_layer_norm.default"

    def cost(s, fqn):
        return next(o.save_cost_bytes for o in s.module(fqn).ops if o.name == ln)

    assert cost(out, "0") == 2 * cost(stats, "0") > 0  # on the model's input, kept anyway
    assert cost(out, "1") == cost(stats, "1")  # replaces block 1's input
    assert cost(out, "2") == cost(stats, "2")  # not compiled
    # the model encloses the compiled blocks (their ops always saved there), block 2 neither is one nor encloses one
    assert all(a.ops == b.ops for a, b in zip(stats.modules, out.modules) if a.fqn.startswith("2"))


def test_compiled_saves_keep_weight_copies_and_batch_norms():
    x = torch.randn(2, 3, 8, 8)
    stats = with_compiled_saves(sacplan.collect(lambda: replay_layout(convnet(c=16), ["1"]), (x,), device="cpu",
                                                optimizer=False), ["1"], layout_replayed=True)
    ops = stats.module("1").ops
    forced = [o.name for o in ops if -1 in o.tied_to]
    assert forced.count("aten._to_copy.default") == 2  # the two weight copies
    assert forced.count("aten.native_batch_norm.default") == 2
    assert forced.count("aten.convolution.default") == 2  # the batch norms' inputs
    full = sacplan.evaluate.module_outcome(stats.module("1"), None)
    assert full.saved_keys >= {(o.name, 0) for o in ops if -1 in o.tied_to}


class GeluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


class GeluStack(nn.Module):
    """Two blocks with an op of its own between them (a sigmoid)."""

    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1 = GeluBlock(), GeluBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b1(torch.sigmoid(self.b0(x)))


def test_a_module_enclosing_compiled_regions_always_saves_their_ops():
    """A checkpoint around compiled blocks discards nothing of theirs in the bound (sacplan/compiled_saves.py).
    On (4, 16) fp32 activations (256 B each): the stack "1" runs t, addmm, gelu (b0), its own sigmoid, then t,
    addmm, gelu (b1): every op but the sigmoid (position 3) ran in a compiled block. Its act_bytes, 768 B (b0's
    addmm output, which gelu saves; the sigmoid output, which sigmoid and b1's linear save; b1's addmm output),
    lose the blocks' save costs: 256 + 256 (b0's addmm and gelu) + 256 (b1's addmm) + 0 (b1's gelu is the stack's
    output) = 768 B, so fully checkpointing the stack frees nothing; the blocks themselves are unchanged."""
    stats = sacplan.collect(lambda: nn.Sequential(nn.Linear(16, 16), GeluStack(), nn.Linear(16, 1)),
                            (torch.randn(4, 16),), device="cpu", optimizer=False)
    assert stats.module("1").act_bytes == (768,)
    assert [o.save_cost_bytes for o in stats.module("1").ops] == [0, 256, 256, 256, 0, 256, 0]
    out = with_compiled_saves(stats, ["1.b0", "1.b1"])
    stack = out.module("1")
    assert [p for p, o in enumerate(stack.ops) if -1 in o.tied_to] == [0, 1, 2, 4, 5, 6]
    assert stack.act_bytes == (0,)
    assert sacplan.evaluate.module_outcome(stack, None).discard_bytes == (0,)
    for fqn in ("1.b0", "1.b1", "0", "2"):
        assert out.module(fqn) == stats.module(fqn)


def test_enclosed_positions_takes_each_run_in_order():
    """Runs of an enclosed module's op sequence are found in order, the longest sequence first; ops that match
    none (an own op, a partial run) stay free."""
    def op(i: int, name: str, nbytes: int = 256) -> OpStat:
        return OpStat(index=i, name=name, occurrence=0, out_bytes=nbytes, runtime_ms=0.0, flops=0)

    mm, relu, add = "aten.mm.default", "aten.relu.default", "aten.add.Tensor"
    block = (op(0, mm), op(1, relu))
    longer = (op(0, mm), op(1, relu), op(2, add))
    ops = tuple(op(i, n) for i, n in enumerate([add, mm, relu, add, mm, relu, mm, mm]))
    assert enclosed_positions(ops, [block]) == {1, 2, 4, 5}
    assert enclosed_positions(ops, [block, longer]) == {1, 2, 3, 4, 5}
    assert enclosed_positions(ops, [(op(0, mm, 512), op(1, relu))]) == set()  # other sizes: not that module
    assert enclosed_positions(ops, []) == set()


def test_compile_model_compiles_pytorchs_own_blocks():
    """Module.compile() leaves a module whose forward is PyTorch's (nn.Sequential) eager: Dynamo does not start
    tracing in torch.nn. compile_model compiles it through a frame of its own, keeping module names."""
    m = mlp(n=2, d=8)
    names = [k for k, _ in m.named_parameters()]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_model(m, "blocks", ["0", "1"], backend="eager").startswith("2 repeated blocks")
    m(torch.randn(4, 8)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert [k for k, _ in m.named_parameters()] == names


def _check(r) -> None:
    """Measured <= predicted, within 3%, without and with the plan."""
    assert -0.03 <= r.baseline_peak_error <= 0, r.summary()
    assert -0.03 <= r.peak_error <= 0, r.summary()


def test_compiled_convnet_stays_under_the_prediction():
    """Inductor runs a CPU graph with convolutions channels-last: the weight copies its blocks save (+~25% here)
    are in the compiled step, and so in its prediction (the regions compiled on fakes,
    sacplan.compiled_partition). With block 1 fully checkpointed, the compiled block still saves its batch norms
    (they write running statistics) and their inputs; the prediction was exact when measured (2026-11-26)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    tree = sacplan.ModuleTree(sacplan.collect(convnet, (x,), device="cpu", optimizer=False))
    plan = plan_from_choices(tree, {"1": None}, "block 1 fully checkpointed")
    r = sacplan.validate(convnet, (x,), plan, compile=True, optimizer=False, timed_steps=0)
    assert "2 repeated blocks compiled" in r.compiled
    eager = sacplan.validate(convnet, (x,), plan, optimizer=False, timed_steps=0)
    assert r.predicted_baseline_peak_bytes > eager.predicted_baseline_peak_bytes + 4 * 64 * 64 * 9 * 4 // 2
    assert r.baseline.peak_bytes > eager.baseline.peak_bytes * 1.2  # what compile changes here: the copies
    _check(r)


def test_compiled_mlp_with_saved_layer_norms_stays_under_the_prediction():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    tree = sacplan.ModuleTree(sacplan.collect(mlp, (x,), device="cpu"))
    ln = frozenset({("aten.native_layer_norm.default", 0)})
    plan = plan_from_choices(tree, {"0": ln, "1": ln}, "layer norms saved")
    assert all(d.saved_ops for d in plan.decisions)
    r = sacplan.validate(mlp, (x,), plan, compile=True, timed_steps=0)
    assert "3 repeated blocks compiled" in r.compiled
    _check(r)
    assert r.planned.peak_bytes < r.baseline.peak_bytes
