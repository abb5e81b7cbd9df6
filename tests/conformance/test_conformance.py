"""Third-party conformance: real architectures from transformers, timm, torchvision and torch.nn, built from
config objects at tiny sizes (no weights downloaded), dropout on where the model has it.

For each model: collect on fakes for this host -> solve at three budgets (near the minimum feasible, midway,
near the no-checkpointing peak) -> apply -> :func:`sacplan.validation.validate` on a real CPU step. Checks,
each its own test id per model and budget: predicted vs measured peak within 1%, recomputed FLOPs exact,
gradients bitwise equal; and per model: ``remove_plan`` restores the model exactly. Steps run without an
optimizer: at these sizes an AdamW step would hold the peak (parameters dominate), where checkpointing cannot
act; sizes are chosen so activations dominate (the optimizer's step is covered by tests/apply).

Known failures are listed in XFAIL (``xfail(strict=False)``) and XFAIL_STRICT with the measured figure and
cause (see benchmarks/RESULTS.md, "Conformance"). The long tail of architectures (issue 24.3) is in
``_longtail.py``; the slower of them run under ``-m slow`` only (SLOW_MODELS).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

from sacplan.apply import apply_plan, remove_plan
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.solver import min_feasible_budget, solve
from sacplan.units import Bytes
from sacplan.tree import ModuleTree
from sacplan.validation import validate
from tests.conformance._longtail import LONGTAIL


@dataclasses.dataclass(frozen=True)
class Case:
    """A model to check: ``build()`` a fresh model, ``inputs()`` its forward's arguments, ``loss``."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    loss: Callable[..., torch.Tensor] | None
    needs: str  # the library the model comes from (skipped when absent)


def _ids(vocab: int = 128, batch: int = 4, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def _lm_inputs() -> dict:
    ids = _ids()
    return {"input_ids": ids, "labels": ids}


def _images(batch: int = 8, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def _hf_image_inputs() -> dict:
    return {"pixel_values": _images(), "labels": torch.arange(8) % 10}


def _hf_loss(out: Any) -> torch.Tensor:  # the one-argument form users of transformers write
    return out.loss


def _xent(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return nn.functional.cross_entropy(out, torch.arange(8) % 10)


# ------------------------------------------------------------------------------------------ transformers
def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)
    return LlamaForCausalLM(cfg)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=64))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0, dropout_rate=0.1))


def _hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=128, num_labels=10,
                                               hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def _mixtral_config(experts: str | None = "batched_mm") -> Any:
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                        attention_dropout=0.1)
    if experts is not None:
        # transformers' default experts kernel (aten._grouped_mm) has a bf16-only fake kernel in torch, and the eager
        # per-expert loop has data-dependent shapes: sacplan's CollectionError names both and this remedy (below)
        cfg._experts_implementation = experts
    return cfg


def _mixtral() -> nn.Module:
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM(_mixtral_config())


# ------------------------------------------------------------------------------------------ torchvision / timm
def _tv_resnet() -> nn.Module:
    from torchvision.models import resnet18

    return resnet18(num_classes=10)


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                             dropout=0.1, attention_dropout=0.1, num_classes=10)


def _timm_resnet() -> nn.Module:
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(block=BasicBlock, layers=[1, 1, 1, 1], num_classes=10, drop_rate=0.1)


def _timm_vit() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10,
                             drop_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1)


# ------------------------------------------------------------------------------------------ torch.nn
def _nn_transformer() -> nn.Module:
    return nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=128,
                          dropout=0.1, batch_first=True)


def _nn_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _seq_pair() -> tuple:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 32, 64, generator=g), torch.randn(8, 24, 64, generator=g)


def _seq() -> torch.Tensor:
    return torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(0))


class _ScaledGelu(torch.autograd.Function):
    """A custom autograd Function saving its input (as fused activations in user code do)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return nn.functional.gelu(x) * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(nn.functional.gelu(xd) * 2, xd, g)
        return gx


class _CustomBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(64, 256), nn.Linear(256, 64), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(_ScaledGelu.apply(self.up(x))))


def _custom_fn() -> nn.Module:
    return nn.Sequential(*[_CustomBlock() for _ in range(3)], nn.LayerNorm(64))


CASES: dict[str, Case] = {
    "hf-llama-gqa": Case(_llama, _lm_inputs, _hf_loss, "transformers"),
    "hf-gpt2": Case(_gpt2, _lm_inputs, _hf_loss, "transformers"),
    "hf-bert": Case(_bert, _lm_inputs, _hf_loss, "transformers"),
    "hf-t5": Case(_t5, _lm_inputs, _hf_loss, "transformers"),
    "hf-vit": Case(_hf_vit, _hf_image_inputs, _hf_loss, "transformers"),
    "hf-mixtral-moe": Case(_mixtral, _lm_inputs, _hf_loss, "transformers"),
    "tv-resnet18": Case(_tv_resnet, _images, _xent, "torchvision"),
    "tv-vit": Case(_tv_vit, _images, _xent, "torchvision"),
    "timm-resnet": Case(_timm_resnet, _images, _xent, "timm"),
    "timm-vit": Case(_timm_vit, _images, _xent, "timm"),
    "nn-transformer": Case(_nn_transformer, _seq_pair, None, "torch"),
    "nn-encoder": Case(_nn_encoder, _seq, None, "torch"),
    "custom-function": Case(_custom_fn, _seq, None, "torch"),
    **{name: Case(*spec) for name, spec in LONGTAIL.items()},  # issue 24.3: the long tail of architectures
}
BUDGETS = ("near-min", "midway", "near-peak")

#: Budgets run by default; the other two are ``slow`` (each validation is two real steps, profiled and traced).
DEFAULT_BUDGETS = ("midway",)

#: Known failures, ``(model, budget or None for all, check) -> reason`` (see benchmarks/RESULTS.md "Conformance").
XFAIL: dict[tuple[str, str | None, str], str] = {
    ("timm-swin", "near-min", "peak"): (
        "over-predicted, the safe direction: -1.47% (predicted 6.24 MiB, CPU allocator 6.15, sacplan's tracker on "
        "the real tensors 6.11) with the plan that checkpoints patch_embed, both stages' attention and MLPs and "
        "layers.1.downsample; the predicted peak is a forward event inside layers.1, where the downsample's input "
        "(262,144 B), held by its checkpoint, is counted twice: the unplanned step keeps it too until layers.1 "
        "returns (benchmarks/RESULTS.md note 5; plan-dependent: another plan at this budget validated within 1%)"),
    **{("hf-switch", None, check): (
        "collection (issue 24.4): Switch's experts pick their tokens with nonzero() / where() from a routing that "
        "depends on the weights (no dense experts setting to switch to); the CollectionError names the experts "
        "module, aten.nonzero and that remedy. Its router's Module.to() inside forward collects since "
        "sacplan.collector.moduleto")
       for check in ("peak", "flops", "grads", "remove")},
}

#: Known failures that must keep failing until their fix lands (``xfail(strict=True)``). Empty since main's
#: in-place safety rule (issue 24.1): MobileNetV3's Hardswish(inplace=True) and EfficientNet's SiLU(inplace=True)
#: cells failed before it (gradients off by 0.0455; a backward RuntimeError) and pass with it.
XFAIL_STRICT: dict[tuple[str, str | None, str], str] = {}

#: Models whose own step is bitwise reproducible only on one thread: their batched experts kernel splits its
#: reductions by thread count (two unplanned steps differ by up to 4.7e-10 on 2 threads, by 0 on one). They are
#: validated with ``torch.set_num_threads(1)``, so their gradients are checked bitwise like every other model's.
ONE_THREAD = frozenset({"hf-mixtral-moe", "hf-qwen2-moe", "hf-olmoe"})

#: Models whose every cell is ``slow``: each real step takes seconds on this CPU (a Python loop over the sequence
#: in the state-space scans, per-expert batched matmuls, 224 px images), so the default suite stays in its time.
SLOW_MODELS = frozenset({"hf-mamba", "hf-mamba2", "hf-qwen2-moe", "hf-olmoe", "hf-switch", "hf-whisper", "hf-swin",
                         "timm-swin", "timm-efficientformer", "tv-mobilenet-v3", "hf-siglip"})


def _case(name: str) -> Case:
    case = CASES[name]
    if case.needs != "torch" and importlib.util.find_spec(case.needs) is None:
        pytest.skip(f"{case.needs} is not installed (pip install sacplan[conformance])")
    return case


_SETUPS: dict[str, Any] = {}
_PLANS: dict[tuple[str, str], Any] = {}
_REPORTS: dict[tuple[str, str], Any] = {}


def _setup(name: str) -> tuple[Case, ModuleTree, dict[str, int]]:
    """Collect once per model: the tree and the three budgets (bytes)."""
    if name not in _SETUPS:
        case = _case(name)
        torch.manual_seed(0)
        tree = ModuleTree(collect(case.build, case.inputs(), device=CPU, loss_fn=case.loss, optimizer=False))
        lo, hi = min_feasible_budget(tree), tree.stats.peak_bytes
        # Bytes: a plain int below 1 MiB would be read as GiB (sacplan.units.parse_budget)
        budgets = {k: Bytes(v) for k, v in
                   {"near-min": lo + (hi - lo) // 50, "midway": (lo + hi) // 2, "near-peak": hi - (hi - lo) // 20}.items()}
        _SETUPS[name] = (case, tree, budgets)
    return _SETUPS[name]


def _plan(name: str, budget: str) -> Any:
    """The plan at one budget (solved on first use). A 2% gap and a 10 s limit bound each solve (a proven
    optimum for the 32-module Llama took 45-70 s with HiGHS here); any feasible plan is a valid subject."""
    if (name, budget) not in _PLANS:
        _, tree, budgets = _setup(name)
        _PLANS[name, budget] = solve(tree, budgets[budget], gap_rel=0.02, time_limit_s=10)
    return _PLANS[name, budget]


def _report(name: str, budget: str) -> Any:
    if (name, budget) not in _REPORTS:
        case = _setup(name)[0]
        threads = torch.get_num_threads()
        if name in ONE_THREAD:
            torch.set_num_threads(1)
        try:
            _REPORTS[name, budget] = validate(case.build, case.inputs, _plan(name, budget), loss_fn=case.loss,
                                              optimizer=False, device="cpu")
        finally:
            torch.set_num_threads(threads)
    return _REPORTS[name, budget]


def _params(check: str) -> list[Any]:
    out = []
    for name in CASES:
        for b in BUDGETS:
            reason = XFAIL.get((name, b, check)) or XFAIL.get((name, None, check))
            marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
            strict = XFAIL_STRICT.get((name, b, check)) or XFAIL_STRICT.get((name, None, check))
            marks += [pytest.mark.xfail(strict=True, reason=strict)] if strict else []
            if b not in DEFAULT_BUDGETS or name in SLOW_MODELS:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(name, b, marks=marks, id=f"{name}-{b}"))
    return out


@pytest.fixture(scope="module", autouse=True)
def _free_module_cache():
    yield
    _SETUPS.clear()
    _PLANS.clear()
    _REPORTS.clear()


@pytest.mark.parametrize("name,budget", _params("peak"))
def test_peak_within_1pct(name: str, budget: str) -> None:
    rep = _report(name, budget)
    assert abs(rep.peak_error) <= 0.01, rep.summary()


@pytest.mark.parametrize("name,budget", _params("flops"))
def test_recomputed_flops_exact(name: str, budget: str) -> None:
    rep = _report(name, budget)
    assert rep.measured_recompute_flops == rep.predicted_recompute_flops, rep.summary()


@pytest.mark.parametrize("name,budget", _params("grads"))
def test_gradients_bitwise(name: str, budget: str) -> None:
    rep = _report(name, budget)
    assert rep.grads_bitwise_equal, rep.summary()


def _state(model: nn.Module) -> list[Any]:
    cfgs = [vars(m.config).copy() for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "__dict__")]
    return [sorted((n, sorted(m.__dict__)) for n, m in model.named_modules()), cfgs]


def _remove_params() -> list[Any]:
    out = []
    for name in CASES:
        reason = XFAIL.get((name, None, "remove"))
        marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
        out.append(pytest.param(name, marks=marks + ([pytest.mark.slow] if name in SLOW_MODELS else []), id=name))
    return out


@pytest.mark.parametrize("name", _remove_params())
def test_remove_plan_restores_model(name: str) -> None:
    case = _setup(name)[0]
    torch.manual_seed(0)
    model = case.build().train()
    before, sd = _state(model), {k: v.clone() for k, v in model.state_dict().items()}
    for plan in [_plan(name, b) for b in DEFAULT_BUDGETS]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Hugging Face: "turns its key/value cache off" (tested in tests/apply)
            apply_plan(model, plan)
        remove_plan(model)
    assert _state(model) == before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())


@pytest.mark.parametrize("experts,needle", [(None, "aten._grouped_mm"), ("eager", "aten.nonzero")])
def test_moe_kernels_fakes_cannot_run_are_named_with_the_remedy(experts: str | None, needle: str) -> None:
    """transformers' default experts kernel and its eager loop cannot run on fake fp32 tensors: the error names
    the module, the op and the setting that works (the suite's Mixtral uses it)."""
    from sacplan.errors import CollectionError

    _case("hf-mixtral-moe")  # skips without transformers

    def build() -> nn.Module:
        from transformers import MixtralForCausalLM

        cfg = _mixtral_config(None)
        if experts is not None:
            cfg._experts_implementation = experts
        return MixtralForCausalLM(cfg)

    with pytest.raises(CollectionError) as err:
        collect(build, _lm_inputs(), device=CPU, loss_fn=_hf_loss, optimizer=False)
    msg = str(err.value)
    assert "model.layers.0.mlp.experts" in msg and needle in msg and "_experts_implementation = 'batched_mm'" in msg

