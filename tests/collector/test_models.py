"""collect() on the built-in models, odd module shapes, module orders, and the errors it raises."""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import CollectionError, ConfigError, UnknownDeviceError, UnsupportedModelError
from sacplan.models.llama import LLAMA_PRESETS, Llama, example_tokens, next_token_loss

PER_CALL = ("act_bytes", "act_grad_bytes", "fw_transient_bytes", "fw_ms", "bw_ms", "fw_flops", "bw_flops", "snapshots")


# ------------------------------------------------------------------------------------------ orders
def test_nested_module_orders(nested_cpu):
    s = nested_cpu
    assert s.fw_pre_order == ("", "pre", "blk", "blk.a", "blk.b", "shared", "shared", "act", "drop")
    assert s.fw_post_order == ("pre", "blk.a", "blk.b", "blk", "shared", "shared", "act", "drop", "")
    # A module whose output *is* its child's output (drop's is the root's, blk.b's is blk's) starts its
    # backward on the same gradient as the child; hooks on one tensor fire in registration order, so the
    # child (registered first, at its forward end) comes first -- as in PyTorch's ModTracker.
    assert s.bw_pre_order == ("drop", "", "act", "shared", "shared", "blk.b", "blk", "blk.a", "pre")
    # blk's and blk.a's backward both end with the gradient of blk's input (blk registered first).
    assert s.bw_post_order == ("drop", "act", "shared", "shared", "blk.b", "blk", "blk.a", "pre", "")


def test_orders_match_pytorch_mod_tracker(nested_model_cls, nested_cpu):
    """PyTorch's ModTracker on a real CPU step sees the same forward and backward orders."""
    from torch.distributed._tools.mod_tracker import ModTracker

    torch.manual_seed(0)
    model = nested_model_cls()
    tracker = ModTracker()
    seen: dict[str, list[str]] = {"fw_pre": [], "fw_post": [], "bw_pre": [], "bw_post": []}

    def name(m: nn.Module) -> str:
        return tracker._get_mod_name(m).partition(".")[2]  # ModTracker prefixes the root's class name

    tracker.register_user_hooks(
        pre_fw_hook=lambda m, i: seen["fw_pre"].append(name(m)),
        post_fw_hook=lambda m, i, o: seen["fw_post"].append(name(m)),
        pre_bw_hook=lambda m, g: seen["bw_pre"].append(name(m)),
        post_bw_hook=lambda m, g: seen["bw_post"].append(name(m)),
    )
    with tracker:
        model(torch.randn(4, 8)).mean().backward()
    assert tuple(seen["fw_pre"]) == nested_cpu.fw_pre_order
    assert tuple(seen["fw_post"]) == nested_cpu.fw_post_order
    assert tuple(seen["bw_pre"]) == nested_cpu.bw_pre_order
    # modules whose inputs need no gradient (the root, 'pre') end when the backward pass ends, in both
    assert tuple(seen["bw_post"]) == nested_cpu.bw_post_order


def test_module_called_twice(nested_cpu):
    shared = nested_cpu.module("shared")
    assert shared.calls == 2
    for field in PER_CALL:
        assert len(getattr(shared, field)) == 2, field
    assert shared.fw_flops == (2 * 4 * 8 * 8, 2 * 4 * 8 * 8)
    assert shared.param_bytes == (64 + 8) * 4  # counted once, whatever the calls
    for fqn in ("pre", "blk", "blk.a", "act", "drop", ""):
        assert nested_cpu.module(fqn).calls == 1
    assert [m.fqn for m in nested_cpu.modules] == ["", "pre", "blk", "blk.a", "blk.b", "shared", "act", "drop"]
    tree = {m.fqn: (m.parent, m.depth, m.is_leaf) for m in nested_cpu.modules}
    assert tree["blk.a"] == ("blk", 2, True) and tree["blk"] == ("", 1, False) and tree[""] == (None, 0, False)


# ------------------------------------------------------------------------------------------ shapes
def test_plain_sequential():
    m = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    s = collect(m, torch.randn(3, 4), device=CPU)  # a single tensor is accepted as the only input
    assert [x.fqn for x in s.modules] == ["", "0", "1", "2"]
    assert s.module("").module_type == "Sequential" and s.module("1").module_type == "GELU"
    assert s.param_bytes == (16 + 4 + 8 + 2) * 4


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return {"h": self.a(x), "aux": x.sum()}


class KwargsIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, *, scale=1.0):
        return self.a(x) * scale


class OddShapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = TupleOut()
        self.d = DictOut()
        self.k = KwargsIn()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        a, b = self.t(x)
        o = self.d(a)
        h = self.k(x=o["h"], scale=2.0)  # a tensor passed by keyword only
        return {"logits": self.head(h), "b": b}


@pytest.fixture(scope="module")
def odd_stats():
    return collect(OddShapes, (torch.randn(4, 8),), device=CPU)


def test_tuple_dict_kwargs_outputs(odd_stats):
    s = odd_stats
    assert s.fw_pre_order == ("", "t", "t.a", "t.b", "d", "d.a", "k", "k.a", "head")
    assert s.module("t").output_bytes == 4 * 8 * 4 + 4 * 4 * 4
    assert s.module("d").output_bytes == 4 * 8 * 4 + 4  # dict of the (4, 8) tensor and a scalar
    assert s.module("").output_bytes == 4 * 2 * 4 + 4 * 4 * 4
    # default loss: both float outputs of the root get a gradient -> every module has a backward
    assert set(s.bw_pre_order) == {m.fqn for m in s.modules}


def test_keyword_tensor_inputs_count(odd_stats):
    """A module called with its tensor by keyword: the input counts and its backward ends on time."""
    k = odd_stats.module("k")
    assert k.input_bytes == 4 * 8 * 4
    post = odd_stats.bw_post_order
    assert post.index("k") == post.index("k.a") + 1
    # its backward is its own ops (the mul's and k.a's), not the rest of the step's backward
    assert k.bw_flops == odd_stats.module("k.a").bw_flops
    assert k.bw_ms[0] < odd_stats.module("k.a").bw_ms[0] + odd_stats.module("t").bw_ms[0]


def test_tied_embeddings_counted_once():
    cfg = LLAMA_PRESETS["llama-tiny"]
    tokens = example_tokens(2, 32, cfg.vocab_size)

    def run(tie: bool):
        c = cfg.with_(tie_embeddings=tie)
        return collect(lambda: Llama(c), (tokens,), loss_fn=lambda o, i: next_token_loss(o, i[0]), device=CPU)

    tied, untied = run(True), run(False)
    emb = cfg.vocab_size * cfg.dim * 4
    assert untied.param_bytes - tied.param_bytes == emb
    assert untied.grad_bytes - tied.grad_bytes == emb
    assert untied.optimizer_bytes - tied.optimizer_bytes == 2 * emb + 4  # two states and one step
    # each module that holds the shared weight reports it; the root counts it once
    assert tied.module("output").param_bytes == emb and tied.module("tok_embeddings").param_bytes == emb
    model = Llama(cfg.with_(tie_embeddings=True))
    assert tied.param_bytes == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "torch.bfloat16"), ("fp16", "torch.float16")])
def test_half_precision(dtype, name):
    fp32 = collect("llama-tiny", device=CPU)
    half = collect("llama-tiny", device=CPU, dtype=dtype)
    assert half.dtype == name and fp32.dtype == "torch.float32"
    rope = LLAMA_PRESETS["llama-tiny"].max_seq_len * LLAMA_PRESETS["llama-tiny"].head_dim // 2 * 2 * 4
    assert half.param_bytes * 2 == fp32.param_bytes
    assert half.module("").buffer_bytes == rope == fp32.module("").buffer_bytes  # the rotary table stays fp32
    assert half.optimizer_bytes < fp32.optimizer_bytes  # AdamW states follow the parameter dtype
    # activations of a Linear halve too
    w1 = "layers.0.feed_forward.w1"
    assert half.module(w1).output_bytes * 2 == fp32.module(w1).output_bytes


def test_cnn_preset():
    s = collect("cnn-tiny", device="h100")
    assert s.model_name == "cnn-tiny"
    # BatchNorm buffers: running mean/var and an int64 counter, each its own 512-byte block
    assert s.module("stem.1").buffer_bytes == 3 * 512
    ops = s.module("layers.0").ops
    relu_ = [o for o in ops if o.name == "aten.relu_.default"]
    assert len(relu_) == 2 and all(o.inplace_of is not None and o.inplace_of < o.index for o in relu_)
    assert any(o.is_random for o in s.module("dropout").ops)
    assert s.module("").tradeoff is not None
    # bf16: the example images come in bf16 too (a real device rejects fp32 images into bf16 convs)
    half = collect("cnn-tiny", device="h100", dtype="bf16")
    assert half.module("").input_bytes * 2 == s.module("").input_bytes
    assert half.module("stem.0").output_bytes * 2 == s.module("stem.0").output_bytes


class ThirdParty(nn.Module):
    """A 'third-party' model whose constructor initialises on real data.

    Built for real, the orthogonal init of a 32768² fp32 weight (4 GiB) would take a QR decomposition of
    minutes; the numpy table is fine anywhere. Built through a factory, it runs on the meta device where
    both are free.
    """

    def __init__(self, n: int = 32768) -> None:
        super().__init__()
        self.proj = nn.Linear(n, n, bias=False)
        nn.init.orthogonal_(self.proj.weight)
        table = np.cos(np.linspace(0.0, np.pi, n, dtype=np.float32))
        self.register_buffer("table", torch.from_numpy(table))
        self.head = nn.Linear(n, 4)

    def forward(self, x):
        return self.head(self.proj(x) * self.table)


def test_third_party_init_never_runs_on_real_data():
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    s = collect(ThirdParty, (torch.randn(2, 32768),), device="h100")
    assert time.perf_counter() - t0 < 60  # ~1 s; the real init (a 4 GiB QR) takes minutes. Wide: a loaded host
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown_kib < 1024 * 1024  # far less than the 4 GiB weight (ru_maxrss is in KiB on Linux)
    assert s.module("proj").param_bytes == 32768 * 32768 * 4
    assert s.module("").buffer_bytes == 32768 * 4


class NeedsCpu(nn.Module):
    """Its constructor copies a table to the CPU: impossible from meta, a no-op on fake CPU tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(8).cpu())
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_factory_that_fails_on_meta_works_in_fake_mode():
    with pytest.raises(NotImplementedError):
        with torch.device("meta"):
            NeedsCpu()
    s = collect(NeedsCpu, (torch.randn(2, 8),), device=CPU)
    assert s.module("").buffer_bytes == 32 and s.param_bytes == (64 + 8) * 4


def test_factory_that_reads_weights_raises_collection_error():
    def factory():
        lin = nn.Linear(4, 4)
        if lin.weight.abs().max().item() > 10:  # data-dependent init
            nn.init.zeros_(lin.weight)
        return lin

    with pytest.raises(CollectionError, match="factory failed on the meta device"):
        collect(factory, (torch.randn(2, 4),), device=CPU)


class ItemInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h * 2 if h.sum().item() > 0 else h


class CallsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.bad = ItemInForward()

    def forward(self, x):
        return self.bad(self.pre(x))


def test_item_in_forward_names_the_module():
    with pytest.raises(CollectionError, match=r"in module 'bad' \(CallsItem\.bad: ItemInForward\)") as info:
        collect(CallsItem(), (torch.randn(2, 8),), device=CPU)
    assert ".item()" in str(info.value)


def test_bad_arguments():
    with pytest.raises(UnknownDeviceError, match="H100"):
        collect(nn.Linear(2, 2), (torch.randn(1, 2),), device="h1000")
    with pytest.raises(ConfigError, match="inputs are required"):
        collect(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="dtype"):
        collect(nn.Linear(2, 2), (torch.randn(1, 2),), dtype="int3")
    with pytest.raises(ConfigError):
        collect("llama-tiniest")
    with pytest.raises(UnsupportedModelError, match="no module forward ran"):
        collect(nn.Linear(2, 2), (torch.randn(1, 2),), train_step=lambda m, i, o: None)


def test_custom_train_step_and_real_module_copy():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    w = model[0].weight.detach().clone()

    def step(m, inputs, opt):
        loss = m(*inputs).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    s = collect(model, (torch.randn(5, 8),), device=CPU, train_step=step)
    assert s.module("").act_bytes[0] > 0 and s.optimizer_bytes == 2 * s.param_bytes + 4 * 4
    assert torch.equal(model[0].weight, w) and model[0].weight.device.type == "cpu"  # the real model is untouched


def test_llama_7b_collects_fast_and_small():
    """Llama-2-7B shape, seq 4096, batch 1, bf16 for an H100: seconds and little host memory."""
    t0 = time.perf_counter()
    s = collect("llama-7b", batch=1, seq=4096, dtype="bf16", device="h100")
    seconds = time.perf_counter() - t0
    # root, tok_embeddings, 32 x (block, attention_norm, attention, wq, wk, wv, wo, ffn_norm, feed_forward,
    # w1, w2, w3), norm, output
    assert len(s.modules) == 1 + 1 + 32 * 12 + 2
    assert s.param_bytes == 6_738_415_616 * 2
    assert s.param_bytes == pytest.approx(6.74e9 * 2, rel=1e-3)
    assert s.dtype == "torch.bfloat16" and s.input_shapes == ((1, 4096),)
    assert seconds < 90, seconds  # 4-8 s quiet; wide slack for a loaded 2-core host (no load-sensitive bound)
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert peak_rss_gib < 24, peak_rss_gib
    assert s.meta["collect_seconds"] <= seconds + 0.01
