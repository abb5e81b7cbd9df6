"""The long tail of architectures (issue 24.3): families the first thirteen conformance models lack.

State-space models on their pure-PyTorch scan (transformers' Mamba / Mamba2 without the CUDA kernels), more
Mixture-of-Experts routers (Qwen2-MoE with a shared expert, OLMoE, Switch's capacity-bounded top-1), an
encoder-decoder audio model (Whisper), hierarchical shifted-window vision transformers (Swin, transformers and
timm), efficient-attention vision transformers (DeiT's distilled ViT, EfficientFormer), mobile CNNs with
in-place activations and squeeze-excitation (MobileNetV3, EfficientNet), a modern BERT (ModernBERT: alternating
local / global attention, rotary, gated MLP) and dual-tower contrastive models (CLIP, SigLIP). Each is its
library's default architecture at a tiny size, built from a config object (no weights), dropout on where the
model has it. Returns ``name -> (build, inputs, loss, library)``; test_conformance.py wraps them in its ``Case``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

Spec = tuple[Callable[[], nn.Module], Callable[[], Any], "Callable[..., torch.Tensor] | None", str]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _ids(vocab: int = 128, batch: int = 4, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=_gen())


def _lm_inputs() -> dict:
    ids = _ids()
    return {"input_ids": ids, "labels": ids}


def _scan_inputs() -> dict:  # the pure-PyTorch scan is a Python loop over the sequence: 16 steps keep it quick
    ids = _ids(seq=16)
    return {"input_ids": ids, "labels": ids}


def _images(batch: int = 8, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=_gen())


def _hf_image_inputs() -> dict:
    return {"pixel_values": _images(), "labels": torch.arange(8) % 10}


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


def _xent(out: Any, inputs: Any) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)  # DeiT's distilled head in training: (class, distillation)
    return sum(nn.functional.cross_entropy(o, torch.arange(o.shape[0]) % 10) for o in outs) / len(outs)


def _batched_experts(cfg: Any) -> Any:
    # transformers' default experts kernel (aten._grouped_mm) has a bf16-only fake kernel in torch and the eager
    # loop has data-dependent shapes: sacplan's CollectionError names both and this remedy
    cfg._experts_implementation = "batched_mm"
    return cfg


# ------------------------------------------------------------------------------------------ state-space models
def _mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                                        conv_kernel=4, use_mambapy=False))


def _mamba2() -> nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    return Mamba2ForCausalLM(Mamba2Config(vocab_size=128, hidden_size=64, num_heads=8, head_dim=16, state_size=8,
                                          n_groups=1, expand=2, num_hidden_layers=2, chunk_size=8, conv_kernel=4))


# ------------------------------------------------------------------------------------------ MoE routers
def _qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(_batched_experts(Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)))


def _olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM(_batched_experts(OlmoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        attention_dropout=0.1)))


def _switch() -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        decoder_start_token_id=0, dropout_rate=0.1))


# ------------------------------------------------------------------------------------------ audio
def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=128, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        dropout=0.1, attention_dropout=0.1))


def _whisper_inputs() -> dict:
    g = _gen()
    labels = torch.randint(3, 128, (4, 16), generator=g)
    return {"input_features": torch.randn(4, 16, 64, generator=g), "labels": labels}


# ------------------------------------------------------------------------------------------ vision transformers
def _hf_swin() -> nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    return SwinForImageClassification(SwinConfig(image_size=32, patch_size=2, embed_dim=32, depths=[2, 2],
                                                 num_heads=[2, 4], window_size=4, mlp_ratio=2.0, num_labels=10,
                                                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                                 drop_path_rate=0.1))


def _timm_swin() -> nn.Module:
    from timm.models.swin_transformer import SwinTransformer

    return SwinTransformer(img_size=32, patch_size=2, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
                           mlp_ratio=2.0, num_classes=10, drop_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1,
                           drop_path_rate=0.1)


def _timm_deit() -> nn.Module:
    from timm.models.deit import VisionTransformerDistilled

    return VisionTransformerDistilled(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10,
                                      drop_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1)


def _timm_efficientformer() -> nn.Module:
    from timm.models.efficientformer import EfficientFormer

    return EfficientFormer(depths=(1, 1, 1, 2), embed_dims=(8, 16, 24, 32), num_vit=1, num_classes=10,
                           drop_rate=0.1, proj_drop_rate=0.1, drop_path_rate=0.1)


def _efficientformer_images() -> torch.Tensor:
    return _images(batch=2, size=224)  # its attention biases are fixed at a 7x7 map: 224 px after stride 32


# ------------------------------------------------------------------------------------------ mobile CNNs
def _tv_mobilenet_v3() -> nn.Module:
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(num_classes=10, width_mult=0.5)


def _timm_efficientnet() -> nn.Module:
    import timm

    return timm.create_model("tinynet_e", pretrained=False, num_classes=10, drop_rate=0.1)


# ------------------------------------------------------------------------------------------ encoders
def _modernbert() -> nn.Module:
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    return ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=64, local_attention=16, global_attn_every_n_layers=3, pad_token_id=0,
        attention_dropout=0.1, mlp_dropout=0.1))


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 attention_dropout=0.1)
    return CLIPModel(CLIPConfig(text_config=dict(vocab_size=128, max_position_embeddings=32, **tower),
                                vision_config=dict(image_size=32, patch_size=8, **tower), projection_dim=32))


def _siglip() -> nn.Module:
    from transformers import SiglipConfig, SiglipModel

    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 attention_dropout=0.1)
    return SiglipModel(SiglipConfig(text_config=dict(vocab_size=128, max_position_embeddings=32, **tower),
                                    vision_config=dict(image_size=32, patch_size=8, **tower)))


def _pair_inputs() -> dict:
    return {"input_ids": _ids(batch=8, seq=32), "pixel_values": _images(), "return_loss": True}


LONGTAIL: dict[str, Spec] = {
    "hf-mamba": (_mamba, _scan_inputs, _hf_loss, "transformers"),
    "hf-mamba2": (_mamba2, _scan_inputs, _hf_loss, "transformers"),
    "hf-qwen2-moe": (_qwen2_moe, _lm_inputs, _hf_loss, "transformers"),
    "hf-olmoe": (_olmoe, _lm_inputs, _hf_loss, "transformers"),
    "hf-switch": (_switch, _lm_inputs, _hf_loss, "transformers"),
    "hf-whisper": (_whisper, _whisper_inputs, _hf_loss, "transformers"),
    "hf-swin": (_hf_swin, _hf_image_inputs, _hf_loss, "transformers"),
    "timm-swin": (_timm_swin, _images, _xent, "timm"),
    "timm-deit": (_timm_deit, _images, _xent, "timm"),
    "timm-efficientformer": (_timm_efficientformer, _efficientformer_images, _xent, "timm"),
    "tv-mobilenet-v3": (_tv_mobilenet_v3, _images, _xent, "torchvision"),
    "timm-efficientnet": (_timm_efficientnet, _images, _xent, "timm"),
    "hf-modernbert": (_modernbert, _lm_inputs, _hf_loss, "transformers"),
    "hf-clip": (_clip, _pair_inputs, _hf_loss, "transformers"),
    "hf-siglip": (_siglip, _pair_inputs, _hf_loss, "transformers"),
}
