"""Pipeline stages of the built-in Llama presets (for ``sacplan plan llama-70b --pp 4``).

Stage ``i`` of ``n`` holds a contiguous run of the preset's transformer blocks (split as evenly as possible, the
first stages taking one more when they do not divide), the first stage the token (and learned position)
embeddings, the last the final norm and the output projection — torchtitan's manual split. Under pipeline
parallelism the output projection cannot share the first stage's embedding weight, so tied embeddings are untied
(the last stage holds its own copy, as torchtitan's pipelined Llama does).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor, nn

from sacplan.errors import ConfigError, UnsupportedModelError
from sacplan.models.llama import LlamaConfig, RMSNorm, TransformerBlock, next_token_loss, rotary_table

__all__ = ["LlamaStage", "llama_stage_fns", "preset_pipeline"]


class LlamaStage(nn.Module):
    """Blocks ``first_layer .. first_layer + n_layers - 1`` of a Llama; token ids ``(B, S)`` in on the first
    stage, hidden states ``(B, S, D)`` between stages, logits ``(B, S, V)`` out of the last."""

    def __init__(self, config: LlamaConfig, first_layer: int, n_layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim) if first else None
        self.pos_embeddings = (
            nn.Embedding(config.max_seq_len, config.dim) if first and config.positions == "learned" else None
        )
        # keys are the global layer indices, so module names match the whole model's (layers.17.attention...)
        self.layers = nn.ModuleDict({str(first_layer + k): TransformerBlock(config) for k in range(n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps) if last else None
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False) if last else None
        rope = rotary_table(config.max_seq_len, config.head_dim, config.rope_theta) if config.positions == "rotary" else None
        self.register_buffer("rope_cache", rope, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h = x  # hidden states (B, S, D), or a sequence shard of them (sequence parallelism)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)  # (B, S, D)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():  # the attention takes the table's first S rows (apply_rotary)
            h = layer(h, self.rope_cache)  # (B, S, D); rope_cache (max_seq_len, hd/2, 2)
        if self.output is not None:
            return self.output(self.norm(h))  # (B, S, V)
        return h


def _build(config: LlamaConfig, first_layer: int, n_layers: int, first: bool, last: bool, dtype: torch.dtype | None) -> nn.Module:
    m = LlamaStage(config, first_layer, n_layers, first, last)
    if dtype is not None:
        m = m.to(dtype=dtype)
        if m.rope_cache is not None:  # the rotary table stays float32, as in the whole model
            m.rope_cache = rotary_table(config.max_seq_len, config.head_dim, config.rope_theta, device=m.rope_cache.device)
    return m


def llama_stage_fns(config: LlamaConfig, num_stages: int, dtype: torch.dtype | None = None) -> list[Callable[[], nn.Module]]:
    """``num_stages`` stage factories (picklable) splitting ``config``'s blocks (module docstring).

    Raises:
        ConfigError: more stages than blocks.
    """
    n = config.n_layers
    if num_stages > n:
        raise ConfigError(f"{num_stages} pipeline stages need at least {num_stages} layers, the model has {n}: "
                          "use at most as many stages as layers")
    sizes = [n // num_stages + (1 if i < n % num_stages else 0) for i in range(num_stages)]
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [functools.partial(_build, config, starts[i], sizes[i], i == 0, i == num_stages - 1, dtype)
            for i in range(num_stages)]


def preset_pipeline(preset: Any, num_stages: int, *, batch: int, seq: int | None, dtype: torch.dtype | None,
                    overrides: dict[str, Any] | None = None) -> tuple[list[Callable[[], nn.Module]], Tensor, Callable[..., Tensor]]:
    """``(stage_fns, tokens, loss_fn)`` for :func:`~sacplan.pipeline.collect_pipeline` of a Llama preset: the
    stages, the batch's token ids (also the target: next-token loss) and ``loss_fn(logits, tokens)``.

    Raises:
        UnsupportedModelError: not a Llama preset.
    """
    if not isinstance(preset.config, LlamaConfig):
        raise UnsupportedModelError(
            f"{preset.name}: pipeline stages are built for the Llama presets only; for another model pass your own "
            "stage modules to sacplan.collect_pipeline(stage_fns, inputs, ...)"
        )
    config = preset.config.with_(**overrides) if overrides else preset.config
    tokens = preset.example_inputs(batch, seq)[0]
    return llama_stage_fns(config, num_stages, dtype), tokens, next_token_loss
