"""Where a CUDA target's kernels save or allocate differently from the host's, and how collection routes them.

Collection runs on CPU fake tensors (fake ``cuda`` tensors fail for some ops on a CPU-only build), so every
op whose CUDA kernel keeps other tensors than its CPU kernel must be routed, on the host, to a kernel that
keeps what the target's does -- or be listed here with the residual it leaves. :data:`KERNEL_TABLE` is that
list, one row per op family, and the only place it is kept; ``tests/collector/test_kernels.py`` checks each
row against bytes derived by hand from the CUDA kernel's documented outputs.

Routing applies only to a CUDA target (``DeviceSpec.attention == "flash"``); a CPU target (validation on the
host) keeps the host's own kernels, so its op list and bytes are unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch._prims_common import suggest_memory_format

aten = torch.ops.aten

FLASH = "flash"
EFFICIENT = "efficient"
MATH = "math"


@dataclass(frozen=True)
class KernelRow:
    """One op whose CUDA kernel differs (or is checked not to differ) from its CPU kernel.

    Attributes:
        op: the op as users call it.
        cpu: what the host (CPU) kernel saves/allocates, per element or call.
        cuda: what the CUDA kernel saves/allocates.
        routing: what collection does for a CUDA target (``"same"``: the kernels keep the same bytes).
    """

    op: str
    cpu: str
    cuda: str
    routing: str


KERNEL_TABLE: tuple[KernelRow, ...] = (
    KernelRow(
        "F.dropout / nn.Dropout (training)",
        "decomposed: empty_like + bernoulli_ + div_ + mul; saves an input-dtype noise mask (4 B/elem in fp32)",
        "aten.native_dropout: output + bool mask (1 B/elem)",
        "routed to aten.native_dropout (the op CUDA runs), so the mask is bool and the SAC op list is the GPU's",
    ),
    KernelRow(
        "aten.native_dropout (fused blocks calling it directly)",
        "bool mask (1 B/elem)",
        "bool mask (1 B/elem)",
        "same",
    ),
    KernelRow(
        "SDPA, fp16/bf16, head dim <= 256 and % 8 == 0, no attn_mask (is_causal allowed), any dropout",
        "math path when dropout_p > 0 or a mask is given (s x s scores, probabilities, fp32/bool dropout mask)",
        "flash: out (B,H,S,D) + log-sum-exp (B,H,S) fp32 + RNG state (2 uint64 on device) + an empty tensor",
        "routed to aten._scaled_dot_product_flash_attention",
    ),
    KernelRow(
        "SDPA, fp32 / an attn_mask (also one that requires grad: T5's position bias) / head dim not flash's",
        "math path (s x s tensors) or the host flash kernel, which is not differentiable in attn_mask",
        "memory-efficient: out + log-sum-exp (B,H,ceil(S/32)*32) fp32 + seed/offset int64 scalars "
        "(host tensors when not capturing a CUDA graph); backward returns the bias gradient",
        "routed to aten._scaled_dot_product_efficient_attention with compute_log_sumexp = any input requires grad; "
        "the seed/offset scalars are counted as 2 device allocations (over-count: 2 x alloc_round_bytes per call)",
    ),
    KernelRow(
        "SDPA, head dim % 8 != 0 (fp16/bf16/fp32)",
        "math path",
        "math path (no fused kernel accepts it)",
        "host math path (same ops)",
    ),
    KernelRow(
        "SDPA on cuDNN",
        "-",
        "cuDNN: out + log-sum-exp (B,H,S,1) fp32 + seed/offset; PyTorch's default priority (flash, efficient, "
        "cuDNN, math) picks it only when the two above are disabled",
        "not routed: the default priority never reaches it for inputs flash or efficient accept",
    ),
    KernelRow(
        "F.batch_norm / nn.BatchNorm (training; >= 3-D fp32/fp64 input, or fp16 with fp32 weight; affine)",
        "_batch_norm_impl_index's native path: empty (0-byte reserve) + native_batch_norm; saves save_mean and "
        "save_invstd fp32 (C each); output contiguous (suggested format) whatever the input's strides",
        "cuDNN (the default when cudnn is enabled): aten.cudnn_batch_norm: out + save_mean + save_var fp32 (C each) "
        "+ a reserve buffer (0 bytes on fakes; cuDNN's persistent-mode reserve is not modelled)",
        "routed to aten.cudnn_batch_norm on input.contiguous(suggested format), as _batch_norm_impl_index calls it "
        "(a transposed input is copied and the copy saved; same saved bytes otherwise; the SAC op list and its "
        "names are the GPU's); bf16, 2-D input or no affine: host path, as CUDA (its own native kernel, whose "
        "output keeps the input's strides)",
    ),
    KernelRow(
        "flex_attention (torch.nn.attention.flex_attention), training",
        "no CPU backward (flex_attention refuses inputs that require grad on CPU)",
        "fused Triton kernel: out (B,Hq,L,Ev) + log-sum-exp (B,Hq,L) fp32; saves q, k, v, out, lse, block mask",
        "routed to the fused SDPA kernel sdpa_backend picks (sacplan/collector/flex.py): the same saved bytes "
        "(efficient: lse padded to 32 rows); dense-attention FLOPs; grouped K/V copied (the kernel reads them in place)",
    ),
    KernelRow(
        "F.ctc_loss (tensor or list lengths)",
        "lengths read on the host, int-list aten._ctc_loss: saves log_alpha (B,T,2*max target+1); backward "
        "allocates log_beta of the same size",
        "the same (cuDNN's CTC needs int32 targets on the host and blank 0; transformers disables cuDNN for it)",
        "same: fakes run the int-list path with the lengths' real values (sacplan/collector/realvalues.py)",
    ),
    KernelRow(
        "F.layer_norm (native_layer_norm)",
        "fp32 input: mean/rstd fp32 (M each); fp16/bf16 input: mean/rstd in the input dtype (2 B x M each)",
        "mean/rstd in fp32 (4 B x M each) for every input dtype",
        "same for fp32; fp16/bf16: not routed, under-counts 4 x M bytes per call (M = rows normalised) "
        "before allocator rounding",
    ),
    KernelRow(
        "F.rms_norm / nn.RMSNorm (weight dtype = input dtype)",
        "decomposed (aten._fused_rms_norm has no CPU kernel): [_to_copy] + pow + mean + add_ + rsqrt + mul + mul "
        "[+ _to_copy]; saves rstd fp32 (M) and x*rstd in fp32 (4 B/elem), plus the fp32 input copy for fp16/bf16",
        "aten._fused_rms_norm: out + rstd fp32 (M); backward saves the input, the weight and rstd",
        "for a CUDA target the host gets a CPU kernel for aten._fused_rms_norm (and its backward) while collecting, "
        "so rms_norm dispatches to it as on CUDA (see cuda_host_kernels)",
    ),
    KernelRow(
        "F.cross_entropy (log_softmax + nll_loss)",
        "log_softmax output (N x C, input dtype) saved; total_weight scalar",
        "the same tensors",
        "same",
    ),
    KernelRow(
        "embedding backward (embedding_dense_backward)",
        "grad weight (V x D) via index_add",
        "grad weight (V x D) plus transient sort buffers (int64 indices, freed inside the kernel)",
        "same persistent bytes; CUDA's in-kernel sort temporaries are not modelled (transient, N x 16 B)",
    ),
    KernelRow(
        "AdamW foreach (the CUDA default)",
        "foreach=True on fakes allocates the same lists (e.g. _foreach_sqrt: one param-sized temporary list)",
        "the same lists",
        "same (collection's default optimizer passes foreach=True)",
    ),
    KernelRow(
        "AdamW state['step'] (capturable=False, fused=False)",
        "a 0-dim fp32 tensor per parameter on the host",
        "a 0-dim fp32 host tensor per parameter: no device memory (on the device only when fused/capturable)",
        "not counted as device memory for a CUDA target",
    ),
)


def sdpa_backend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float
) -> str:
    """The SDPA kernel PyTorch's CUDA dispatcher picks (default priority flash → efficient → math).

    Returns ``"flash"``, ``"efficient"`` or ``"math"`` for 4-D inputs of a floating dtype.
    """
    head = query.shape[-1]
    same_head = key.shape[-1] == head and value.shape[-1] == head
    if (
        query.dtype in (torch.float16, torch.bfloat16)
        and attn_mask is None
        and same_head
        and head <= 256
        and head % 8 == 0
    ):
        return FLASH
    if query.dtype in (torch.float16, torch.bfloat16, torch.float32) and head % 8 == 0 and value.shape[-1] % 8 == 0:
        return EFFICIENT
    return MATH


def fused_sdpa(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """Run the target's fused kernel ``backend`` (``"flash"`` or ``"efficient"``) on host fakes; returns the output."""
    if backend == FLASH:
        return aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, return_debug_mask=False, scale=scale
        )[0]
    needs_grad = any(t is not None and t.requires_grad for t in (query, key, value, attn_mask)) and torch.is_grad_enabled()
    if attn_mask is not None:
        # CUDA's SDPA expands the mask to (B, H, L, S) as a view (its last dim is padded to a multiple of 16
        # first when it is not one: a copy; mirrored here).
        s_k = key.shape[-2]
        if s_k % 16:
            pad = 16 - s_k % 16
            attn_mask = torch.nn.functional.pad(attn_mask, (0, pad))[..., :s_k]
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], s_k)
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
    )[0]


def native_dropout(x: torch.Tensor, p: float, training: bool, inplace: bool) -> torch.Tensor:
    """``F.dropout`` as CUDA runs it: ``aten.native_dropout`` (bool mask) in training, identity otherwise."""
    if not training or p == 0.0:
        return x
    out = aten.native_dropout(x, p, True)[0]
    if inplace:
        return x.copy_(out)
    return out



def _bind(names: tuple[str, ...], defaults: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A functional's arguments by name: ``defaults``, then the positional ``args`` in ``names`` order, then
    ``kwargs``."""
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound

def route_dropout(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)`` when ``func`` is a dropout call to route to ``native_dropout``; else ``(False, None)``."""
    if func is torch.nn.functional.dropout:
        names = ("input", "p", "training", "inplace")
        defaults = {"p": 0.5, "training": True, "inplace": False}
    elif func is torch.dropout or func is torch.dropout_:
        names = ("input", "p", "train")
        defaults = {}
    else:
        return False, None
    bound = _bind(names, defaults, args, kwargs)
    x = bound["input"]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return False, None
    training = bool(bound.get("training", bound.get("train", True)))
    inplace = bool(bound.get("inplace", False)) or func is torch.dropout_
    return True, native_dropout(x, float(bound["p"]), training, inplace)


#: ``(op, its backward)``: ops CUDA runs as one kernel whose host build has only a decomposition
#: (CompositeImplicitAutograd) -- on the host the op's callers decompose instead of reaching it.
HOST_DECOMPOSED_OPS = (("_fused_rms_norm", "_fused_rms_norm_backward"),)

_host_kernels_depth = 0
_host_kernels_lib: Any = None


@contextlib.contextmanager
def cuda_host_kernels() -> Iterator[None]:
    """Give the host a CPU kernel for each op of :data:`HOST_DECOMPOSED_OPS` while the block runs.

    With a kernel of its own the op stops decomposing: ``torch.rms_norm`` reaches ``aten._fused_rms_norm`` and
    autograd records ``FusedRmsNormBackward0`` (saving input, weight and rstd), as on a CUDA device; fake
    tensors run the op's meta kernel. The CPU kernels compute with PyTorch's own decompositions (so real host
    tensors still get correct values). Registrations are removed on exit (re-entrant); an op the host already
    has a CPU kernel for is left alone.
    """
    global _host_kernels_depth, _host_kernels_lib
    from torch._decomp import decomposition_table

    if _host_kernels_depth == 0:
        lib = torch.library.Library("aten", "IMPL")
        try:
            for fw, bw in HOST_DECOMPOSED_OPS:
                if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{fw}", "CPU"):
                    continue
                fw_op, bw_op = getattr(aten, fw).default, getattr(aten, bw).default
                lib.impl(fw, fw_op.decompose, "CPU")
                lib.impl(bw, decomposition_table[bw_op], "CPU")
        except BaseException:
            lib._destroy()
            raise
        _host_kernels_lib = lib
    _host_kernels_depth += 1
    try:
        yield
    finally:
        _host_kernels_depth -= 1
        if _host_kernels_depth == 0:
            _host_kernels_lib._destroy()
            _host_kernels_lib = None


def cudnn_batch_norm_applies(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
) -> bool:
    """Whether CUDA's ``_batch_norm_impl_index`` would pick cuDNN for a training batch norm of these tensors.

    Its conditions: no bf16 input or weight, fp16 input only with an fp32 weight, weight and bias given,
    running statistics both given (or both absent), at least 3-D input, batch <= 880801 and fewer than
    2**31 - 1 elements, and ``torch.backends.cudnn.enabled``. Only training is routed (eval saves nothing).
    """
    if not training or weight is None or bias is None or x.dim() < 3:
        return False
    if (running_mean is None) != (running_var is None):
        return False
    if torch.bfloat16 in (x.dtype, weight.dtype) or (x.dtype == torch.float16 and weight.dtype != torch.float32):
        return False
    if x.dtype not in (torch.float16, torch.float32, torch.float64):
        return False
    return x.shape[0] <= 880801 and x.numel() < 2**31 - 1 and torch.backends.cudnn.enabled


def route_batch_norm(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, output)`` when ``func`` is a batch norm CUDA would run with cuDNN (``aten.cudnn_batch_norm``)."""
    if func is torch.nn.functional.batch_norm:
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        defaults: dict[str, Any] = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    elif func is torch.batch_norm:
        names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled")
        defaults = {}
    else:
        return False, None
    b = _bind(names, defaults, args, kwargs)
    x = b["input"]
    if not isinstance(x, torch.Tensor) or not b.get("cudnn_enabled", True):
        return False, None
    weight, bias, mean, var = b["weight"], b["bias"], b["running_mean"], b["running_var"]
    if not cudnn_batch_norm_applies(x, weight, bias, mean, var, bool(b["training"])):
        return False, None
    eps = float(b["eps"])
    per_channel = x.numel() // max(1, x.shape[1])
    if eps <= 0.0 or per_channel <= 1:
        return False, None  # F.batch_norm's own checks raise the error (eps, one value per channel)
    momentum = float(b["momentum"]) if b["momentum"] is not None else 0.0
    # ``_batch_norm_impl_index`` hands cuDNN ``input.contiguous(input.suggest_memory_format())`` (cuDNN checks
    # it): a copy of a transposed input, saved for the backward in its place (an ``aten.clone`` on an H200)
    x = x.contiguous(memory_format=suggest_memory_format(x))
    return True, aten.cudnn_batch_norm(x, weight, bias, mean, var, True, momentum, eps)[0]


def host_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Optimizer state a CUDA target keeps on the host: ``state["step"]`` of groups neither fused nor capturable.

    ``torch.optim`` (Adam, AdamW, ...) creates ``step`` as a CPU scalar tensor unless the group has
    ``capturable=True`` or ``fused=True``; those steps cost the device nothing.
    """
    out = []
    for group in opt.param_groups:
        if group.get("capturable") or group.get("fused"):
            continue
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                out.append(step)
    return out
