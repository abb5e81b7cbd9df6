"""Make attention on the host save what the *target's* fused kernel saves.

On a CPU host, ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (or some masks) falls back to the
math path, which saves s×s scores, probabilities and a dropout mask — on a long sequence that is most of
the model's activation memory, and it is not what a GPU's flash / memory-efficient / cuDNN kernel keeps
(output + log-sum-exp + RNG state). When the target's ``DeviceSpec.attention == "flash"``, this
``TorchFunctionMode`` routes every SDPA call to the fused kernel the target's dispatcher would pick (flash or
memory-efficient, see :data:`sacplan.collector.kernels.KERNEL_TABLE`; dropout goes to ``native_dropout``, a
cuDNN-eligible training batch norm to ``cudnn_batch_norm``), so
memory, FLOPs and saved tensors are those of a fused kernel; a call with dropout is flagged random (its
dropout happens inside the kernel on the target, so recomputation must replay the same RNG state).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from sacplan.collector.kernels import MATH, fused_sdpa, route_batch_norm, route_dropout, sdpa_backend

aten = torch.ops.aten


class FusedAttentionMode(TorchFunctionMode):
    """Rewrites ``F.scaled_dot_product_attention`` to the host's flash kernel (see module docstring).

    Args:
        on_dropout: called before a rewritten call that had ``dropout_p > 0`` (the recorder flags the
            kernel random).
    """

    def __init__(self, on_dropout: Callable[[], None]) -> None:
        super().__init__()
        self.on_dropout = on_dropout

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        for route in (route_dropout, route_batch_norm):
            routed, result = route(func, args, kwargs)
            if routed:
                return result
        return func(*args, **kwargs)

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if query.dim() != 4 or query.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                **({"enable_gqa": enable_gqa} if enable_gqa else {}),
            )
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            # Fused GPU kernels read grouped K/V in place; the host kernel needs them expanded. The expanded
            # copies are made here as views + one copy, the closest the host can get.
            rep = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(rep, dim=-3)
            value = value.repeat_interleave(rep, dim=-3)
        if dropout_p > 0:
            self.on_dropout()
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, -math.inf)
        backend = sdpa_backend(query, key, value, attn_mask, dropout_p)
        if backend == MATH:
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
            )
        return fused_sdpa(backend, query, key, value, attn_mask, dropout_p, is_causal, scale)
