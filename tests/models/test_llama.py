"""Llama presets: parameter counts by hand, CPU training step, meta/fake building, KV cache, dropout."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from sacplan.errors import ConfigError
from sacplan.models import MODELS, ModelPreset, get_model, list_models
from sacplan.models.llama import LLAMA_PRESETS, Llama, LlamaConfig, TransformerBlock, rotary_table


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared parameters are counted once


def build_meta(name: str, **overrides) -> Llama:
    with torch.device("meta"):
        return get_model(name).build(**overrides)


# -- configs and parameter counts --------------------------------------------------------------------------


def test_llama_7b_parameter_count_by_hand():
    # Llama 2 7B: D=4096, F=11008, V=32000, 32 layers, untied output.
    #   per layer: 4 * D^2 (wq wk wv wo) + 3 * D * F (w1 w2 w3) + 2 * D (norms)
    #            = 67,108,864 + 135,266,304 + 8,192 = 202,383,360
    #   32 layers = 6,476,267,520; embeddings + output = 2 * 32000 * 4096 = 262,144,000; final norm 4096
    model = build_meta("llama-7b")
    assert n_params(model) == 6_738_415_616


def test_llama_tiny_parameter_count_by_hand():
    # D=64, H=4 (hd 16), KV=2, F = 32 * ceil(int(2 * 256 / 3) / 32) = 32 * ceil(170 / 32) = 192, V=256
    #   per layer: wq 64*64 + wk 64*32 + wv 64*32 + wo 64*64 = 12,288; ffn 3*64*192 = 36,864; norms 128
    #            = 49,280; 2 layers = 98,560; embeddings + output 2 * 256 * 64 = 32,768; final norm 64
    cfg = LLAMA_PRESETS["llama-tiny"]
    assert cfg.ffn_hidden_dim == 192 and cfg.kv_heads == 2 and cfg.head_dim == 16
    assert n_params(get_model("llama-tiny").build()) == 131_392


def test_llama_1b_tied_parameter_count_by_hand():
    # Llama 3.2 1B: D=2048, KV dim 8 * 64 = 512, F=8192, V=128256, 16 layers, output tied to embedding.
    #   per layer: 2 * 2048^2 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048 = 60,821,504
    #   16 layers = 973,144,064; embedding (once) 262,668,288; final norm 2048
    assert n_params(build_meta("llama-1b")) == 1_235_814_400


def test_larger_presets_parameter_counts():
    # Published figures: Llama 3 8B 8,030,261,248; Llama 2 13B 13,015,864,320; Llama 3 70B 70,553,706,496.
    assert n_params(build_meta("llama-8b")) == 8_030_261_248
    assert n_params(build_meta("llama-13b")) == 13_015_864_320
    assert n_params(build_meta("llama-70b")) == 70_553_706_496


def test_hidden_dim_rule_reproduces_llama_2():
    # 4 * 4096 = 16384 -> int(2/3 * 16384) = 10922 -> next multiple of 256 = 11008
    assert LlamaConfig(dim=4096, n_heads=32).ffn_hidden_dim == 11_008
    assert LlamaConfig(dim=5120, n_heads=40).ffn_hidden_dim == 13_824
    assert LLAMA_PRESETS["llama-7b"].ffn_hidden_dim == 11_008


def test_with_changes_fields_and_rejects_unknown_ones():
    cfg = LLAMA_PRESETS["llama-7b"].with_(n_layers=2)
    assert cfg.n_layers == 2 and cfg.dim == 4096
    assert LLAMA_PRESETS["llama-7b"].n_layers == 32
    with pytest.raises(ConfigError, match="unknown LlamaConfig field"):
        LLAMA_PRESETS["llama-7b"].with_(layers=2)


@pytest.mark.parametrize(
    "bad",
    [
        dict(dim=100, n_heads=3),
        dict(dim=64, n_heads=4, n_kv_heads=3),
        dict(positions="alibi"),
        dict(dropout=1.0),
        dict(n_layers=0),
        dict(dim=12, n_heads=4),  # head dim 3 is odd: no rotary
    ],
)
def test_invalid_configs_raise(bad):
    with pytest.raises(ConfigError):
        LlamaConfig(**bad)


def test_config_is_frozen_and_keyword_only():
    cfg = LLAMA_PRESETS["llama-tiny"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        LlamaConfig(256, 64)  # type: ignore[misc]


# -- structure ----------------------------------------------------------------------------------------------


def test_module_layout_and_names():
    model = get_model("llama-tiny").build()
    assert isinstance(model.tok_embeddings, torch.nn.Embedding)
    assert model.pos_embeddings is None
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2
    block = model.layers[0]
    assert isinstance(block, TransformerBlock)
    names = {n for n, _ in block.named_modules()}
    assert {"attention_norm", "attention", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
            "ffn_norm", "feed_forward", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"} <= names
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    # the rotary table is a buffer, not saved in the state dict
    assert "rope_cache" in dict(model.named_buffers())
    assert "rope_cache" not in model.state_dict()


def test_tied_embeddings_share_one_parameter():
    model = get_model("llama-tiny").build(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert n_params(model) == 131_392 - 256 * 64
    untied = get_model("llama-tiny").build()
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_rmsnorm_matches_formula_and_keeps_dtype():
    model = get_model("llama-tiny").build(dtype=torch.bfloat16)
    norm = model.norm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16) * norm.weight
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


def test_rotary_table_values():
    table = rotary_table(8, 4, 10_000.0)
    assert table.shape == (8, 2, 2)
    # position 3, pair 1: angle 3 * 10000^(-2/4) = 0.03
    torch.testing.assert_close(table[3, 1], torch.tensor([math.cos(0.03), math.sin(0.03)]))


# -- running ------------------------------------------------------------------------------------------------


def test_tiny_forward_backward_on_cpu():
    preset = get_model("llama-tiny")
    torch.manual_seed(0)
    model = preset.build()
    inputs = preset.example_inputs(2, 64)
    logits = model(*inputs)
    assert logits.shape == (2, 64, 256)
    loss = preset.loss_fn(logits, inputs)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # fresh init: about log(V) = 5.55
    assert 4.5 < loss.item() < 6.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_next_token_loss_is_shifted_cross_entropy():
    preset = get_model("llama-tiny")
    model = preset.build()
    (tokens,) = preset.example_inputs(2, 16)
    logits = model(tokens)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 256).float(), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(preset.loss_fn(logits, (tokens,)), expected)
    torch.testing.assert_close(preset.loss_fn(logits, tokens), expected)


def test_causal_outputs_do_not_depend_on_later_tokens():
    preset = get_model("llama-tiny")
    model = preset.build().eval()
    (tokens,) = preset.example_inputs(1, 12)
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8])
    assert not torch.allclose(model(tokens)[:, 8:], model(changed)[:, 8:])


def test_bf16_build_runs():
    preset = get_model("llama-tiny")
    model = preset.build(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rope_cache.dtype == torch.float32
    torch.testing.assert_close(model.rope_cache, rotary_table(128, 16, 10_000.0), rtol=0, atol=0)
    logits = model(*preset.example_inputs(1, 8))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(preset.loss_fn(logits, preset.example_inputs(1, 8)))


def test_learned_positions():
    preset = get_model("llama-tiny")
    model = preset.build(positions="learned")
    assert model.rope_cache is None
    assert model.pos_embeddings.weight.shape == (128, 64)
    assert n_params(model) == 131_392 + 128 * 64
    logits = model(*preset.example_inputs(2, 10))
    assert logits.shape == (2, 10, 256)


def test_too_long_sequence_is_refused():
    model = get_model("llama-tiny").build()
    with pytest.raises(ConfigError, match="max_seq_len"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_dropout_path_runs_and_is_off_in_eval():
    preset = get_model("llama-tiny")
    torch.manual_seed(0)
    model = preset.build(dropout=0.2)
    plain = preset.build()
    plain.load_state_dict(model.state_dict())
    inputs = preset.example_inputs(2, 16)
    model.train()
    a, b = model(*inputs), model(*inputs)
    assert not torch.allclose(a, b)  # different dropout masks
    preset.loss_fn(a, inputs).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    plain.eval()
    torch.testing.assert_close(model(*inputs), plain(*inputs))


# -- meta device and fake tensors -------------------------------------------------------------------------


def test_llama_70b_on_meta_allocates_nothing():
    """(How fast it builds is a benchmark figure, benchmarks/collect_scaling.py, not a timed unit test: the
    1 s assertion here failed under load.)"""
    model = build_meta("llama-70b")
    assert sum(p.numel() for p in model.parameters()) > 60e9
    assert all(t.is_meta for t in model.parameters())
    assert all(t.is_meta for t in model.buffers())


def test_llama_7b_meta_to_empty_fake_forward_backward():
    preset = get_model("llama-7b")
    model = build_meta("llama-7b")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        inputs = preset.example_inputs(1, 16)
        logits = model(*inputs)
        assert isinstance(logits, FakeTensor)
        assert logits.shape == (1, 16, 32_000)
        loss = preset.loss_fn(logits, inputs)
        loss.backward()
        assert model.layers[31].feed_forward.w2.weight.grad.shape == (4096, 11_008)


def test_meta_build_then_init_weights_gives_a_working_model():
    preset = get_model("llama-tiny")
    model = build_meta("llama-tiny")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    torch.testing.assert_close(model.rope_cache, rotary_table(128, 16, 10_000.0))
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert 0.015 < model.output.weight.std().item() < 0.025
    inputs = preset.example_inputs(2, 16)
    loss = preset.loss_fn(model(*inputs), inputs)
    # N(0, 0.02) weights give near-uniform predictions: loss close to log(256) = 5.545
    assert abs(loss.item() - 5.545) < 0.05


# -- KV cache ------------------------------------------------------------------------------------------------


def test_kv_cache_toggles_and_matches_full_forward():
    preset = get_model("llama-tiny")
    torch.manual_seed(0)
    model = preset.build(use_kv_cache=True).eval()
    assert model.caching
    (tokens,) = preset.example_inputs(1, 10)
    with torch.no_grad():
        model.disable_kv_cache()
        assert not model.caching
        full = model(tokens)
        assert all(layer.attention.cache_k is None for layer in model.layers)

        model.enable_kv_cache()
        first = model(tokens[:, :6])  # prefill 6 tokens
        assert model.layers[0].attention.cache_k.shape == (1, 2, 6, 16)  # (B, KV, past, hd)
        second = model(tokens[:, 6:9])  # 3 more with a 6-token past
        third = model(tokens[:, 9:])  # one decoding step
        torch.testing.assert_close(torch.cat((first, second, third), dim=1), full, rtol=1e-4, atol=1e-5)
        assert model.layers[1].attention.cache_len == 10

        model.reset_kv_cache()
        assert model.caching and model.layers[0].attention.cache_len == 0
        model.disable_kv_cache()
        assert not model.caching
        assert all(layer.attention.cache_k is None and layer.attention.cache_v is None for layer in model.layers)
        torch.testing.assert_close(model(tokens), full)


def test_kv_cache_is_off_by_default_and_not_in_state_dict():
    model = get_model("llama-tiny").build(use_kv_cache=True)
    assert not get_model("llama-tiny").build().caching
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert not any("cache" in k for k in model.state_dict())


def test_kv_cache_refuses_to_run_past_max_seq_len():
    model = get_model("llama-tiny").build(use_kv_cache=True)
    with torch.no_grad():
        model(torch.zeros(1, 100, dtype=torch.long))
        with pytest.raises(ConfigError):
            model(torch.zeros(1, 29, dtype=torch.long))


# -- registry -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["llama-7b", "Llama-7B", "llama_7b", "LLAMA 7B", "llama7b", "llama2-7b"])
def test_get_model_is_forgiving(alias):
    assert get_model(alias) is MODELS["llama-7b"]


def test_get_model_passes_presets_through():
    assert get_model(MODELS["llama-8b"]) is MODELS["llama-8b"]
    assert get_model("llama3-70b").name == "llama-70b"


def test_unknown_model_lists_names_and_suggestions():
    with pytest.raises(ConfigError) as info:
        get_model("llama-7bb")
    msg = str(info.value)
    assert "Did you mean 'llama-7b'" in msg
    for name in MODELS:
        assert name in msg


def test_list_models_and_presets():
    names = [p.name for p in list_models()]
    assert names == list(MODELS)
    assert {"llama-tiny", "llama-small", "llama-1b", "llama-7b", "llama-8b", "llama-13b", "llama-70b",
            "cnn-tiny", "cnn-small"} == set(names)
    assert all(isinstance(p, ModelPreset) and p.description for p in list_models())


def test_default_inputs():
    assert MODELS["llama-tiny"].default_seq == 64
    assert MODELS["llama-small"].default_seq == 512  # min(max_seq_len=512, 2048)
    assert MODELS["llama-7b"].default_seq == 2048  # min(4096, 2048)
    (tokens,) = MODELS["llama-tiny"].example_inputs(3, None)
    assert tokens.shape == (3, 64) and tokens.dtype == torch.long
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256
    assert torch.equal(tokens, MODELS["llama-tiny"].example_inputs(3, None)[0])  # deterministic
    (meta_tokens,) = MODELS["llama-8b"].example_inputs(1, 4096, device="meta")
    assert meta_tokens.is_meta and meta_tokens.shape == (1, 4096)
    with pytest.raises(ConfigError):
        MODELS["llama-tiny"].example_inputs(1, 129)


def test_build_overrides_and_device():
    model = get_model("llama-7b").build(device="meta", n_layers=2)
    assert len(model.layers) == 2 and model.output.weight.is_meta
    with pytest.raises(ConfigError):
        get_model("llama-7b").build(device="meta", not_a_field=1)
