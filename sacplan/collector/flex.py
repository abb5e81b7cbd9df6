"""FlexAttention (``torch.nn.attention.flex_attention``) in the fake step: what the target GPU's kernel keeps.

On a CUDA device ``flex_attention`` runs a fused (Triton) kernel: its forward returns the output (B, Hq, L, Ev)
in the query dtype and the log-sum-exp (B, Hq, L) fp32, and autograd saves q, k, v, the output, the log-sum-exp
and the block mask's tensors (``FlexAttentionAutogradOp``); its backward makes dq, dk, dv. On the CPU host the
fake step cannot get there: ``flex_attention`` refuses inputs that require grad on CPU ("does not support
backward on CPU"), and it compiles the hop with ``torch.compile`` (a compiled ``create_block_mask``, torchtitan's
default, crashed the process inside fake mode).

:func:`flex_attention_routed` (active for the whole fake step) therefore

* turns compilation off (``torch._dynamo.config.disable``): compiled functions -- a compiled ``flex_attention``
  or ``create_block_mask`` -- run eagerly, so the block mask is built from the fake step's own ops;
* replaces, inside ``torch.nn.attention.flex_attention``, the device check and the flex hop by
  :func:`routed_flex_hop`, which runs the fused SDPA kernel the target has for these shapes (flash for fp16/bf16
  with equal head dims, else memory-efficient; :mod:`sacplan.collector.kernels`): the same saved tensors (q, k,
  v, output, log-sum-exp of (B, H, L) fp32 -- the efficient kernel pads it to a multiple of 32 rows) and
  gradients, and a runtime from the roofline of that kernel like every other attention op.

Residuals (stated, not hidden): the roofline counts dense attention FLOPs, so a sparse block mask (causal: about
half the blocks) is over-estimated in time, never in memory; grouped-query K/V are expanded with a copy
(``repeat_interleave``), as the SDPA routing does, where the GPU kernel reads them in place; the flex backward's
own scratch (a (B, Hq, L) fp32 ``delta``) is the fused SDPA backward's. Everything is restored on exit, also when
the step raises. A CPU *target* cannot train FlexAttention (no CPU backward): the call raises
:class:`FlexOnCpuTarget`, which names the remedy (collect for a CUDA target).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from sacplan.collector.kernels import FLASH, sdpa_backend

aten = torch.ops.aten

__all__ = ["FlexOnCpuTarget", "flex_attention_routed", "routed_flex_hop"]


class FlexOnCpuTarget(RuntimeError):
    """FlexAttention met in a fake step planned for a CPU target (it has no CPU backward)."""


def routed_flex_hop(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Any, block_mask: tuple, scale: float,
    kernel_options: Any, score_mod_other_buffers: tuple = (), mask_mod_other_buffers: tuple = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, max_scores)`` as the flex hop returns them, from the target's fused SDPA kernel.

    ``lse`` is the kernel's log-sum-exp (B, Hq, L) fp32 (a view of the efficient kernel's padded one);
    ``max_scores`` is empty (the hop returns it only when asked for, and then it is not saved for backward).
    """
    hq, hkv = query.shape[-3], key.shape[-3]
    if hkv != hq:  # grouped-query attention: the host kernels need expanded K/V (see module docstring)
        key = key.repeat_interleave(hq // hkv, dim=-3)
        value = value.repeat_interleave(hq // hkv, dim=-3)
    length = query.shape[-2]
    if sdpa_backend(query, key, value, None, 0.0) == FLASH:
        out, lse = aten._scaled_dot_product_flash_attention(query, key, value, 0.0, False, return_debug_mask=False,
                                                            scale=scale)[:2]
    else:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out, lse = aten._scaled_dot_product_efficient_attention(query, key, value, None, needs_grad, 0.0, False,
                                                                scale=scale)[:2]
        lse = lse[..., :length]
    return out, lse, torch.empty(0, dtype=torch.float32, device=query.device)


def _refuse_on_cpu_target(*args: Any, **kwargs: Any) -> Any:
    raise FlexOnCpuTarget(
        "FlexAttention has no backward on CPU, so a CPU step cannot train it (the fake step was planned for the "
        "CPU target)"
    )


_PATCHED = ("flex_attention_hop", "_validate_device", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")


@contextlib.contextmanager
def flex_attention_routed(cuda_target: bool) -> Iterator[None]:
    """While active, ``flex_attention`` on fakes runs :func:`routed_flex_hop` (a CUDA target) or raises
    :class:`FlexOnCpuTarget` (a CPU target), and compiled functions run eagerly (see the module docstring).

    A torch whose ``flex_attention`` module lacks the names patched here (other layouts) gets compilation off
    only; its flex calls then fail as before, with the error collection names.
    """
    import torch._dynamo

    try:
        import torch.nn.attention.flex_attention as fa
    except ImportError:  # pragma: no cover - torch without FlexAttention
        fa = None
    saved = {name: getattr(fa, name) for name in _PATCHED if fa is not None and hasattr(fa, name)}
    with torch._dynamo.config.patch(disable=True):
        try:
            if len(saved) == len(_PATCHED):
                fa.flex_attention_hop = routed_flex_hop if cuda_target else _refuse_on_cpu_target  # type: ignore[union-attr]
                fa._validate_device = lambda query, key, value: None  # type: ignore[union-attr]
                fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # type: ignore[union-attr]  # no torch.compile
            yield
        finally:
            for name, v in saved.items():
                setattr(fa, name, v)
