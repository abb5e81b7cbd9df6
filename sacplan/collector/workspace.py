"""Kernel workspaces: memory a kernel allocates for itself while it runs (not an op output).

Dispatch-level tracking sees op outputs only. Some kernels also allocate scratch buffers through the same
allocator for the duration of the call, which raise the peak (``torch.profiler``'s allocator events and
``torch.cuda.max_memory_allocated`` see them). :func:`workspace_bytes` gives them per op and target; the
recorder adds them to the current segment's peak as transient ``temp`` bytes.

* Host CPU target (``DeviceSpec.name == "CPU"``, used to validate on this host): the workspace of the ops in
  :data:`WORKSPACE_OPS` is *measured*: the op runs once on random tensors of the same shapes and strides under
  ``torch.profiler`` (allocator events), and the peak above its outputs is cached per op signature — the same way
  benchmark mode times ops on the device it plans for. oneDNN convolutions reorder inputs, weights and outputs into
  blocked layouts; layer norm copies non-contiguous inputs (and bf16 ones to fp32); ``_safe_softmax`` (the math
  attention path) builds boolean masks; fused RMS norm keeps an input-sized temporary; the CPU flash attention
  kernels keep per-thread blocks of scores and fp32 accumulators (their size follows the intra-op thread count,
  measured with the current one); exact GELU's backward keeps two input-sized temporaries when the output
  gradient is not laid out as the input (a conv block's activation before a transpose: measured 3x the output); the losses of one op (MSE, smooth L1, Huber, BCE with logits) keep the
  unreduced loss in input-sized temporaries; matrix products copy an operand BLAS cannot read in place (a stride-0 gradient
  expanded from a ``sum`` / ``mean``; only such signatures are measured, and every bf16 / fp16 one: without a
  native reduced-precision GEMM the CPU kernel computes through fp32 copies of its operands and result, measured
  1.6-3.6x the bf16 output on a 64 x 64 ``mm``); reductions of bf16 / fp16 tensors (a ``mean`` keeps an fp32
  copy of its input) are measured too. (CTC loss backward follows its rule below.) Signatures whose tensors exceed :data:`MEASURE_CAP_BYTES` fall back to the CUDA rules below.

* CUDA targets, derived from the kernels' sources: layer norm (forward and backward) runs on
  ``expect_contiguous()`` copies of a non-contiguous input / output gradient; ``_safe_softmax`` is composite
  (``softmax``, then ``eq(-inf)`` → a bool tensor of the input's size and ``all(dim)`` → one bool per row,
  both live while it runs). cuDNN batch norm backward copies an output gradient not laid out as the input
  (its own cuDNN workspace is not modelled). MSE / smooth L1 / Huber (reduced) keep one input-sized temporary, BCE with logits
  two (one unreduced), BCE and soft margin (reduced) a 0-d mean (measured on an H200). CTC loss backward (CPU and CUDA) allocates ``log_beta``, the size of the saved
  ``log_alpha``. Reductions (``sum``, ``mean``, ``amax``...) that split across thread blocks meet in a staging
  buffer (:mod:`sacplan.collector.reductions`, exact on an H200). cuDNN convolutions allocate the workspace
  of the algorithm its heuristics pick (up to 300 MiB measured in a ResNet-50 backward on an H200): not
  modelled (0). cuBLAS keeps one persistent workspace per thread and stream, a constant of the whole step
  (:attr:`~sacplan.devices.DeviceSpec.runtime_workspace_bytes`), not a per-op workspace.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._prims_common import suggest_memory_format
from torch.utils._pytree import tree_flatten, tree_unflatten

from sacplan.collector.fakekernels import loss_reduced, unreduced_loss_shape
from sacplan.collector.reductions import REDUCTION_OPS, reduction_staging_bytes
from sacplan.devices import DeviceSpec

aten = torch.ops.aten

_CONV_OPS = frozenset(
    {aten.convolution.default, aten._convolution.default, aten.mkldnn_convolution.default, aten.convolution_backward.default}
)
#: layer norm forward / backward: the tensor arguments the kernel makes contiguous (input; output gradient, input)
_LAYER_NORM_ARGS = {aten.native_layer_norm.default: (0,), aten.native_layer_norm_backward.default: (0, 1)}
#: CTC loss backward (CPU and CUDA kernels alike): ``log_beta = empty_like(log_alpha)`` (argument 6), freed when
#: the kernel returns; from the source (and measured on the host: peak - output = log_alpha's bytes exactly),
#: never measured per call (the measurement's all-zero lengths would not be the step's).
_CTC_BACKWARD = frozenset({aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor})
WORKSPACE_OPS = _CONV_OPS | frozenset(_LAYER_NORM_ARGS) | _CTC_BACKWARD | frozenset(
    {aten._safe_softmax.default, aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default,
     aten._scaled_dot_product_flash_attention_for_cpu.default,
     aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
     aten.gelu_backward.default}
)
#: matrix products and their matrix operands: the CPU kernels copy an operand BLAS cannot read in place
#: (neither of its last two dimensions has stride 1, or a stride is 0, as in the gradient of ``sum`` / ``mean``
#: expanded over a ``Linear``'s output) into a contiguous temporary while they run
_MATMUL_ARGS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2),
                # the ``out=`` forms Inductor's generated code calls (``extern_kernels.mm(a, b, out=buf)``)
                aten.mm.out: (0, 1), aten.addmm.out: (1, 2), aten.bmm.out: (0, 1), aten.baddbmm.out: (1, 2)}
#: losses computed as one op that keep temporaries while they run (Loss.cpp, CPU and CUDA alike; CUDA figures
#: measured on an H200): mse / smooth L1 (reduced) compute the unreduced loss into a TensorIterator temporary
#: and reduce it into the result; huber (reduced) into ``empty_like(input)``; BCE with logits keeps
#: ``log_sigmoid(input)`` and ``(1 - target)`` (the output when unreduced; ``pos_weight``'s ``log_weight`` dies
#: before the latter is made); BCE / soft margin (reduced) keep a 0-d mean while they copy it into the output.
_SCRATCH_LOSSES = frozenset({
    aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
    aten.binary_cross_entropy_with_logits.default, aten.binary_cross_entropy.default, aten.soft_margin_loss.default,
})
#: cuDNN batch norm backward runs on ``grad_output.contiguous(input.suggest_memory_format())``
#: (aten/src/ATen/native/cudnn/BatchNorm.cpp): a copy while it runs when the gradient arrives in another layout
_CUDNN_BN_BACKWARD = aten.cudnn_batch_norm_backward.default
#: gloo's reduce-scatter of one flat tensor (``_reduce_scatter_base``: FSDP2's gradient reduce-scatter) reduces a
#: clone of its input, then copies this rank's chunk out of it: an input-sized transient on the host CPU, where
#: collectives run on gloo (seen on 2 gloo ranks as a split of a storage of the input's size and dtype made after
#: the collective, dead when it returns; up to 16% of a small model's per-rank peak with an fp32 reduce).
#: NCCL, on CUDA targets, reduces without such a copy.
_GLOO_REDUCE_SCATTER = getattr(getattr(torch.ops, "c10d", None), "_reduce_scatter_base_", None)
_GLOO_REDUCE_SCATTER = getattr(_GLOO_REDUCE_SCATTER, "default", None)
WORKSPACE_OPS = WORKSPACE_OPS | frozenset(_MATMUL_ARGS) | REDUCTION_OPS | _SCRATCH_LOSSES | {_CUDNN_BN_BACKWARD}
if _GLOO_REDUCE_SCATTER is not None:
    WORKSPACE_OPS = WORKSPACE_OPS | {_GLOO_REDUCE_SCATTER}
#: CPU workspaces are measured on real tensors only up to this many argument bytes (then the CUDA rules apply)
MEASURE_CAP_BYTES = 256 * 2**20
_CACHE: dict[Any, int] = {}


def workspace_bytes(spec: DeviceSpec, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Transient bytes ``func`` allocates beyond its outputs on ``spec`` (0 when not modelled)."""
    if func not in WORKSPACE_OPS:
        return 0
    host = spec.name == "CPU"
    if func is _GLOO_REDUCE_SCATTER:  # a collective: never run to be measured
        inp = args[1] if len(args) > 1 else None
        return spec.round_alloc(inp.untyped_storage().nbytes()) if host and isinstance(inp, torch.Tensor) else 0
    if func in REDUCTION_OPS and not (host and _reduced_precision(args)):
        return reduction_staging_bytes(spec, func, args, kwargs)  # from the CUDA kernel's configuration
    flat, tspec = tree_flatten((args, kwargs))
    if func in _MATMUL_ARGS and all(_blas_ready(args[i]) for i in _MATMUL_ARGS[func] if i < len(args)) \
            and not (host and _reduced_precision(args)):
        return 0  # the common case, not measured: BLAS reads both operands where they are
    if host and func not in _CTC_BACKWARD:
        size = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        if size <= MEASURE_CAP_BYTES:
            key = (func, tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in flat))
            if key not in _CACHE:
                _CACHE[key] = _measure_cpu(func, flat, tspec)
            return _CACHE[key]
    return kernel_scratch_bytes(spec, func, args, kwargs)


def kernel_scratch_bytes(spec: DeviceSpec, func: Any, args: tuple, kwargs: dict | None = None) -> int:
    """Scratch bytes a CUDA kernel of ``func`` allocates from the caching allocator while it runs (see module doc)."""
    if func in _LAYER_NORM_ARGS:
        return sum(
            spec.round_alloc(t.numel() * t.element_size())
            for t in (args[i] for i in _LAYER_NORM_ARGS[func] if i < len(args))
            if isinstance(t, torch.Tensor) and not t.is_contiguous()
        )
    if func in _CTC_BACKWARD and len(args) > 6 and isinstance(args[6], torch.Tensor):
        log_alpha = args[6]
        return spec.round_alloc(log_alpha.numel() * log_alpha.element_size())
    if func is _CUDNN_BN_BACKWARD and len(args) > 1 and isinstance(args[0], torch.Tensor):
        x, grad = args[0], args[1]
        same = grad.is_contiguous(memory_format=suggest_memory_format(x))
        return 0 if same else spec.round_alloc(grad.numel() * grad.element_size())
    if func in _SCRATCH_LOSSES and len(args) > 1 and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor):
        return _loss_scratch_bytes(spec, func, args, kwargs or {})
    if func is aten._safe_softmax.default and args and isinstance(args[0], torch.Tensor):
        x = args[0]
        dim = int(args[1]) % max(1, x.dim()) if len(args) > 1 else x.dim() - 1
        rows = x.numel() // max(1, x.shape[dim]) if x.dim() else 1
        return spec.round_alloc(x.numel()) + spec.round_alloc(rows)
    return 0


def _loss_scratch_bytes(spec: DeviceSpec, func: Any, args: tuple, kwargs: dict) -> int:
    """Temporaries of a loss of :data:`_SCRATCH_LOSSES` on CUDA (the reduction's staging not counted)."""
    reduced = loss_reduced(func, args, kwargs)
    x = args[0]
    if func in (aten.binary_cross_entropy.default, aten.soft_margin_loss.default):
        return spec.round_alloc(x.element_size()) if reduced else 0
    n = 1
    for d in unreduced_loss_shape(func, x, args[1]):
        n *= d
    one = spec.round_alloc(n * x.element_size())
    if func is aten.binary_cross_entropy_with_logits.default:
        return 2 * one if reduced else one
    return one if reduced else 0


@contextlib.contextmanager
def quiet_profiler_logs(prefix: str = "USDT:") -> Iterator[None]:
    """Drop the profiler's native ``USDT: ... profiler_start/stop`` lines from file descriptor 2.

    Kineto writes them from C++, past ``sys.stderr``. Everything else written to fd 2 meanwhile is passed
    on when the block ends.
    """
    import os
    import sys
    import tempfile

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable fd 2 (embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True) if not ln.startswith(prefix)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def profiled_cpu_peak(fn: Any) -> int:
    """Peak of the CPU allocator's running total while ``fn()`` runs (``torch.profiler`` memory events).

    Counts only the thread that ran the most ops (the caller's): collective back-ends such as gloo
    allocate scratch on worker threads. The result is relative to the bytes live when ``fn`` starts.
    """
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler_logs(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    threads = Counter(e.start_thread_id() for e in events if e.name() != "[memory]")
    main = threads.most_common(1)[0][0] if threads else None
    mem = sorted(
        (
            e for e in events
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
            and (main is None or e.start_thread_id() == main)
        ),
        key=lambda e: e.start_ns(),
    )
    cur = peak = 0
    for e in mem:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _measure_cpu(func: Any, flat: list, tspec: Any) -> int:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        real = [_real_like(t) if isinstance(t, torch.Tensor) else t for t in flat]
        args, kwargs = tree_unflatten(real, tspec)
        result: list[Any] = []
        try:
            peak = profiled_cpu_peak(lambda: result.append(func(*args, **kwargs)))
        except Exception:  # cannot run this signature here: no workspace modelled
            return 0
        given = {t.untyped_storage().data_ptr() for t in real if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_flatten(result[0])[0] if isinstance(t, torch.Tensor)]
        # an ``out=`` argument was allocated before the call: none of its bytes are the call's
        out_bytes = sum(t.untyped_storage().nbytes() for t in outs if t.untyped_storage().data_ptr() not in given)
        return max(0, peak - out_bytes)


def _reduced_precision(args: tuple) -> bool:
    """Whether a tensor argument is bf16 or fp16: the host CPU kernels of matrix products and reductions then
    compute through fp32 copies (measured, see the module docstring)."""
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) for t in args)


def _blas_ready(t: Any) -> bool:
    """Whether BLAS reads matrix ``t`` (its last two dimensions) in place: one stride 1, the other at least the
    leading dimension (a row- or column-major matrix, possibly transposed)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return True
    (r, c), (sr, sc) = t.shape[-2:], t.stride()[-2:]
    return (sc == 1 and sr >= max(1, c)) or (sr == 1 and sc >= max(1, r))


def _real_like(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor with ``t``'s shape, strides and dtype (random if floating, else zeros); overlapping
    strides (an ``expand``-ed gradient has stride 0) view one smaller storage, as ``t`` does."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.randn(span, dtype=t.dtype) if t.is_floating_point() else torch.zeros(span, dtype=t.dtype)
    return base.as_strided(t.shape, t.stride())
