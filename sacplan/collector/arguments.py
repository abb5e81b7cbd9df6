"""Normalising :func:`sacplan.collect`'s arguments, and its defaults for the optimizer and the loss."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten

from sacplan.errors import ConfigError, UnsupportedModelError

#: ``params -> Optimizer``: how :func:`sacplan.collect` is told which optimizer to build.
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with ``foreach=True`` (what CUDA uses by default): 2 fp32-sized states per parameter."""
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def default_loss(output: Any, inputs: tuple) -> torch.Tensor:
    """Mean of every floating-point output tensor, in fp32 (a stand-in with a full-size gradient)."""
    flat, _ = tree_flatten(output)
    terms = [t.float().mean() for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not terms:
        raise UnsupportedModelError(
            "the model's output has no floating-point tensor to take a loss of: pass loss_fn=... or train_step=..."
        )
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or its name (``"bf16"``, ``"fp16"``, ``"fp32"`` and aliases); None stays
    None; anything else: ConfigError naming the accepted names."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
        "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    }
    key = str(dtype).lower().replace("torch.", "")
    if key not in names:
        raise ConfigError(f"unknown dtype {dtype!r}: use bf16, fp16 or fp32")
    return names[key]


def optimizer_factory(optimizer: OptimizerFactory | None | bool) -> OptimizerFactory | None:
    """The factory to build the optimizer with: ``optimizer`` itself, :func:`default_optimizer` for ``None`` or
    ``True``, ``None`` (no optimizer step) for ``False``; anything else: ConfigError saying what is accepted."""
    if optimizer is True:
        optimizer = None
    if not (optimizer is None or optimizer is False or callable(optimizer)):
        raise ConfigError(
            f"optimizer must be a factory params -> torch.optim.Optimizer (e.g. lambda p: torch.optim.Adam(p)), None "
            f"for AdamW, or False for no optimizer step; got {optimizer!r:.60}"
        )
    return None if optimizer is False else (optimizer or default_optimizer)
