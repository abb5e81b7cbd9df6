"""Built-in demo models: one registry of named presets.

    preset = get_model("llama-7b")
    with torch.device("meta"):                      # nothing is allocated
        model = preset.build(dtype=torch.bfloat16, n_layers=4)
    inputs = preset.example_inputs(batch=1, seq=2048, device="meta")
    loss = preset.loss_fn(model(*inputs), inputs)

Presets: ``llama-tiny``, ``llama-small``, ``llama-1b``, ``llama-7b``, ``llama-8b``, ``llama-13b``,
``llama-70b`` (:mod:`sacplan.models.llama`) and ``cnn-tiny``, ``cnn-small`` (:mod:`sacplan.models.cnn`).
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sacplan.errors import ConfigError
from sacplan.models.cnn import CNN_PRESETS, CNNConfig, SmallCNN, classification_loss, example_images
from sacplan.models.llama import LLAMA_PRESETS, Llama, LlamaConfig, example_tokens, next_token_loss

__all__ = [
    "MODELS",
    "ModelPreset",
    "get_model",
    "list_models",
    "Llama",
    "LlamaConfig",
    "LLAMA_PRESETS",
    "SmallCNN",
    "CNNConfig",
    "CNN_PRESETS",
]


@dataclass(frozen=True)
class ModelPreset:
    """A named model configuration with the inputs and loss of a (fake) training step.

    Attributes:
        name: registry name, e.g. ``"llama-7b"``.
        description: one line for people.
        config: the frozen config (:class:`LlamaConfig` or :class:`CNNConfig`).
        factory: builds the module from a config.
        default_batch: batch size used when none is given.
        default_seq: sequence length used when none is given (``None`` for image models).
    """

    name: str
    description: str
    config: Any
    factory: Callable[[Any], nn.Module]
    default_batch: int
    default_seq: int | None = None

    def build(
        self, dtype: torch.dtype | None = None, *, device: torch.device | str | None = None, **overrides: Any
    ) -> nn.Module:
        """The model, with config fields changed by ``overrides`` (e.g. ``n_layers=2``).

        It is built on ``device`` when given, else on the current default device, so
        ``with torch.device("meta"): preset.build()`` allocates nothing. ``dtype`` casts the floating
        point parameters and buffers (Llama's rotary table stays float32).

        Raises:
            ConfigError: an override names no config field or gives an invalid value.
        """
        config = self.config.with_(**overrides) if overrides else self.config
        ctx = torch.device(device) if device is not None else contextlib.nullcontext()
        with ctx:
            model = self.factory(config)
        if dtype is not None:
            model = model.to(dtype=dtype)
            if isinstance(model, Llama):
                model.reset_buffers()  # keep the rotary table in float32, as Llama does
        return model

    def example_inputs(
        self,
        batch: int | None = None,
        seq: int | None = None,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, ...]:
        """Deterministic positional inputs of ``model(*inputs)``.

        Llama: token ids ``(batch, seq)`` int64, ``seq`` defaulting to :attr:`default_seq`. CNN: images
        ``(batch, 3, R, R)`` in ``dtype`` (float32 by default); ``seq`` is ignored.
        """
        batch = self.default_batch if batch is None else int(batch)
        if batch <= 0:
            raise ConfigError(f"batch must be positive, got {batch}")
        if isinstance(self.config, LlamaConfig):
            seq = self.default_seq if seq is None else int(seq)
            if not 0 < seq <= self.config.max_seq_len:
                raise ConfigError(f"{self.name}: seq must lie in 1..{self.config.max_seq_len}, got {seq}")
            return (example_tokens(batch, seq, self.config.vocab_size, device),)
        return (example_images(batch, self.config.image_size, device, dtype),)

    def loss_fn(self, output: Tensor, inputs: Tensor | tuple[Tensor, ...]) -> Tensor:
        """Scalar training loss of ``output = model(*inputs)``.

        Llama: next-token cross-entropy against the input tokens shifted by one. CNN: cross-entropy
        against fixed labels ``arange(B) % num_classes``.
        """
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        if isinstance(self.config, LlamaConfig):
            return next_token_loss(output, first)
        return classification_loss(output, first)


def _llama(name: str, description: str, batch: int, seq: int | None = None) -> ModelPreset:
    config = LLAMA_PRESETS[name]
    return ModelPreset(name, description, config, Llama, batch, seq or min(config.max_seq_len, 2048))


def _cnn(name: str, description: str, batch: int) -> ModelPreset:
    return ModelPreset(name, description, CNN_PRESETS[name], SmallCNN, batch, None)


MODELS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _llama("llama-tiny", "2-layer Llama (dim 64, GQA 4/2 heads, vocab 256) for tests", batch=2, seq=64),
        _llama("llama-small", "4-layer Llama (dim 256, vocab 1024) for laptop examples", batch=4),
        # batch 3 x 8192 tokens: the default `sacplan plan` job (no-AC peak ~84 GiB in bf16, over 80% of an H100)
        _llama("llama-1b", "Llama 3.2 1B shape (16 layers, dim 2048, GQA 32/8, tied embeddings)", batch=3, seq=8192),
        _llama("llama-7b", "Llama 2 7B shape (32 layers, dim 4096, 6.74B parameters)", batch=1),
        _llama("llama-8b", "Llama 3 8B shape (32 layers, dim 4096, GQA 32/8, vocab 128256)", batch=1),
        _llama("llama-13b", "Llama 2 13B shape (40 layers, dim 5120)", batch=1),
        _llama("llama-70b", "Llama 3 70B shape (80 layers, dim 8192, GQA 64/8)", batch=1),
        _cnn("cnn-tiny", "ResNet-style CNN, 2 stages (8, 16 channels), 32x32 images, for tests", batch=8),
        _cnn("cnn-small", "ResNet-18-like CNN, 4 stages (32..256 channels), 64x64 images", batch=32),
    )
}

_ALIASES = {
    "llama2-7b": "llama-7b",
    "llama2-13b": "llama-13b",
    "llama3-8b": "llama-8b",
    "llama3.1-8b": "llama-8b",
    "llama3-70b": "llama-70b",
    "llama3.1-70b": "llama-70b",
    "llama3.2-1b": "llama-1b",
    "tiny": "llama-tiny",
    "resnet-tiny": "cnn-tiny",
}


def _norm(name: str) -> str:
    s = name.lower()
    for ch in "-_ .":
        s = s.replace(ch, "")
    return s


def _lookup_table() -> dict[str, str]:
    table = {_norm(name): name for name in MODELS}
    table.update({_norm(alias): name for alias, name in _ALIASES.items()})
    return table


def get_model(name: str | ModelPreset) -> ModelPreset:
    """The preset of a name, matched case-insensitively ignoring ``-``, ``_``, ``.`` and spaces.

    A :class:`ModelPreset` is returned unchanged.

    Raises:
        ConfigError: unknown name; the message lists the known names and the closest matches.
    """
    if isinstance(name, ModelPreset):
        return name
    table = _lookup_table()
    key = table.get(_norm(str(name)))
    if key is not None:
        return MODELS[key]
    close = difflib.get_close_matches(_norm(str(name)), list(table), n=3, cutoff=0.5)
    suggestions = list(dict.fromkeys(table[c] for c in close))
    hint = f" Did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    raise ConfigError(f"unknown model {name!r}.{hint} Known models: {', '.join(MODELS)}.")


def list_models() -> list[ModelPreset]:
    """Every preset of :data:`MODELS`, in registry order."""
    return list(MODELS.values())
