"""Collection runs the attention path a real Hugging Face step runs (no 4-D mask, no ``repeat_kv`` copies)."""

from __future__ import annotations

import pytest
import torch

from sacplan.collector import collect
from sacplan.collector.hf import training_cache_configs, training_without_cache, transformers_real_paths
from sacplan.devices import CPU


def _declare_torchvision_ops() -> None:
    """transformers imports torchvision when installed; its fake registrations need these schemas (the
    compiled torchvision ops do not load beside the CPU torch wheel)."""
    if hasattr(torch.ops, "torchvision") and hasattr(torch.ops.torchvision, "nms"):
        return
    try:
        lib = torch.library.Library("torchvision", "DEF")
    except RuntimeError:
        return
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define(
        "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
        "int sampling_ratio, bool aligned) -> Tensor"
    )
    _declare_torchvision_ops.lib = lib  # type: ignore[attr-defined]  # keep the library alive


_declare_torchvision_ops()
transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

SEQ, BATCH, VOCAB = 64, 2, 128


def _llama(use_cache: bool = False):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=use_cache,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _loss(out, args):
    return out.logits.float().mean()


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def test_gqa_decoder_collects_the_real_steps_kernels() -> None:
    ids = _ids()
    stats = collect(_llama, (ids,), device=CPU, optimizer=False, loss_fn=_loss)
    names = [o.name for o in stats.module("model.layers.0.self_attn").ops]
    # The real step: enable_gqa and is_causal, so neither K/V copies (repeat_kv = expand + clone) nor a mask.
    assert "aten.clone.default" not in names and "aten.expand.default" not in names
    assert names.count("aten._scaled_dot_product_flash_attention_for_cpu.default") == 1
    # And the recorded peak is the real step's, by sacplan's tracker on real tensors.
    from sacplan.collector.records import BUFFER, INPUT, PARAM
    from sacplan.collector.runtime import RuntimeModel
    from sacplan.collector.tracker import StepRecorder

    model = _llama()
    rec = StepRecorder(model, CPU, RuntimeModel(CPU))
    with rec:
        rec.register(list(model.parameters()), PARAM)
        rec.register(list(model.buffers()), BUFFER)
        rec.register((ids,), INPUT)
        rec.close_segment()
        rec.recording = True
        _loss(model(ids), (ids,)).backward()
        rec.close_segment("other")
    assert stats.peak_bytes == rec.step_peak


def test_patches_are_restored_even_when_the_step_fails() -> None:
    before = (mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa)
    with pytest.raises(RuntimeError):
        with transformers_real_paths((_ids(),)):
            assert mu._ignore_causal_mask_sdpa is not before[1]
            raise RuntimeError("boom")
    assert (mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa) == before


def test_a_real_padding_mask_keeps_the_4d_mask() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    dense = {"input_ids": _ids(), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    padded = {"input_ids": _ids(), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    padded["attention_mask"][0, -3:] = 0
    with FakeTensorMode():
        fake_mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    with transformers_real_paths(dense):
        assert mu._ignore_causal_mask_sdpa(fake_mask, SEQ, SEQ, 0, 0) is True
        assert mu._ignore_bidirectional_mask_sdpa(fake_mask, SEQ) is True
    with transformers_real_paths(padded):
        assert mu._ignore_causal_mask_sdpa(fake_mask, SEQ, SEQ, 0, 0) is False
        assert mu._ignore_bidirectional_mask_sdpa(fake_mask, SEQ) is False
    # Without the context the library treats the fake as a tracer: always the 4-D mask.
    assert mu._ignore_causal_mask_sdpa(fake_mask, SEQ, SEQ, 0, 0) is False


def test_training_cache_is_off_while_recording_and_restored() -> None:
    model = _llama(use_cache=True)
    assert [n for n, _ in training_cache_configs(model)] == ["<root>"]  # one config, shared by every module
    with pytest.raises(RuntimeError):
        with training_without_cache(model) as names:
            assert names == ["<root>"] and model.config.use_cache is False
            raise RuntimeError("boom")
    assert model.config.use_cache is True
    model.eval()  # inference keeps its cache: nothing to turn off
    assert training_cache_configs(model) == []


def test_default_config_collects_the_step_a_plan_runs() -> None:
    """With ``use_cache=True`` (the library default) the training step would build a K/V cache it never reads;
    the checkpointed step does not (checkpointing turns it off), so collection records it without."""
    ids = _ids()
    cached = collect(lambda: _llama(use_cache=True), (ids,), device=CPU, optimizer=False, loss_fn=_loss)
    plain = collect(lambda: _llama(use_cache=False), (ids,), device=CPU, optimizer=False, loss_fn=_loss)
    assert cached.peak_bytes == plain.peak_bytes
    assert [e.peak_bytes for e in cached.events] == [e.peak_bytes for e in plain.events]


def _wav2vec2_ctc(layerdrop: float = 0.0):
    cfg = transformers.Wav2Vec2Config(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=layerdrop, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(cfg)


def _speech() -> dict:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(1, 16, (2, 12), generator=g)
    labels[1, 9:] = -100  # padding, as a data collator pads labels
    return {"input_values": torch.randn(2, 1600, generator=g), "labels": labels}


def _wav2vec2_stats():
    return collect(_wav2vec2_ctc, _speech(), device=CPU, loss_fn=lambda out: out.loss, optimizer=False)


def test_wav2vec2_ctc_collects_with_the_real_labels() -> None:
    """Its forward reads ``labels.max()``, selects targets with a mask and calls ``ctc_loss`` with tensor lengths:
    answered from the real labels; the CTC op is the one a real step runs (int-list lengths)."""
    stats = _wav2vec2_stats()
    ctc = [o for o in stats.module("").ops if o.name.startswith("aten._ctc_loss")]
    t = stats.module("lm_head").output_bytes // (2 * 16 * 4)  # frames after the feature encoder
    assert [o.name for o in ctc] == ["aten._ctc_loss.default"]
    assert ctc[0].out_bytes == 2 * 4 + 2 * t * (2 * 12 + 1) * 4  # nll (B,) + log_alpha (B, T, 2 * 12 + 1) fp32


@pytest.mark.slow
def test_wav2vec2_ctc_prediction_is_its_real_cpu_step() -> None:
    from sacplan.solver import solve
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes
    from sacplan.validation import validate

    stats = _wav2vec2_stats()
    plan = solve(ModuleTree(stats), Bytes(stats.peak_bytes))
    rep = validate(_wav2vec2_ctc, _speech, plan, loss_fn=lambda out: out.loss, optimizer=False, device="cpu",
                   timed_steps=1)
    assert rep.baseline_peak_error == 0.0, rep.summary()


def test_wav2vec2_layerdrop_is_named_with_its_setting() -> None:
    from sacplan.errors import CollectionError

    with pytest.raises(CollectionError, match=r"wav2vec2\.encoder.*layerdrop = 0\.0"):
        collect(lambda: _wav2vec2_ctc(layerdrop=0.1), _speech(), device=CPU, loss_fn=lambda out: out.loss)
