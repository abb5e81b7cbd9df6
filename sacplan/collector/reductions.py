"""Staging memory of PyTorch's CUDA reductions (``sum``, ``mean``, ``amax`` ...): bytes allocated while they run.

``gpu_reduce_kernel`` (ATen/native/cuda/Reduce.cuh) splits a long reduction across thread blocks when each
thread would otherwise sum too many values; the blocks then meet in a global-memory staging buffer of
``sizeof(acc) × outputs × blocks per output`` bytes — times ``block.x × output vector width`` when the reduced
dimension is not the fastest-moving one. That is the case of every bias gradient: ``grad.sum((0, 1))`` over a
(batch, tokens, features) gradient keeps the features (contiguous) and reduces the rows, and allocates
``4 × features × blocks × 32 × 4`` bytes. Measured on an H200: a ViT-B/16 step (batch 64) allocates 73.9 MiB
for each 768-feature bias gradient and 132.0 MiB for each 3072-feature one, exactly what
:func:`reduction_staging_bytes` gives; at the step's peak that was 1.7% of it (benchmarks/RESULTS.md).

The configuration is computed as ``setReduceConfig`` does, from the op's input shape and strides after
TensorIterator's reordering (reduced dimensions first, then ascending strides) and coalescing, and the
device's SM count and resident threads per SM (:class:`~sacplan.devices.DeviceSpec`). Inputs over 2**31
elements (split into 32-bit-indexed pieces by the kernel) are not modelled.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sacplan.devices import DeviceSpec

aten = torch.ops.aten

#: reductions whose CUDA kernel accumulates in fp32 (fp64 for double and integer inputs), and those that
#: accumulate in the input's own type
ACC_REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.nansum.default})
SELF_REDUCTIONS = frozenset({aten.amax.default, aten.amin.default})
REDUCTION_OPS = ACC_REDUCTIONS | SELF_REDUCTIONS
_WARP = 32
_MAX_THREADS = 512
_VEC = 4  # vt0 = input_vec_size of gpu_reduce_kernel's defaults
_MIN_VALUES, _MAX_VALUES = 16, 256


def reduction_staging_bytes(spec: DeviceSpec, func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes ``func``'s CUDA reduction kernel allocates while it runs on ``spec`` (0: none, or not modelled)."""
    if not spec.sm_count or func not in REDUCTION_OPS or not args or not isinstance(args[0], torch.Tensor):
        return 0
    x = args[0]
    if x.numel() == 0 or x.numel() >= 2**31 or x.is_complex():
        return 0
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    reduced = _reduced_dims(x.dim(), dims)
    acc = x.element_size() if func in SELF_REDUCTIONS else (8 if x.dtype in (torch.float64,) or not x.is_floating_point() else 4)
    it = iterator_dims(list(x.shape), list(x.stride()), reduced)
    buffer, semaphores = staging_bytes(it, acc, x.storage_offset(), spec.sm_count, spec.max_threads_per_sm)
    return spec.round_alloc(buffer) + spec.round_alloc(semaphores) if buffer else 0


def _reduced_dims(ndim: int, dims: Any) -> set[int]:
    if dims is None or (isinstance(dims, Sequence) and len(dims) == 0):
        return set(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return {int(d) % max(1, ndim) for d in dims}


def iterator_dims(shape: list[int], strides: list[int], reduced: set[int]) -> list[tuple[int, int, bool]]:
    """(size, input stride in elements, reduced) per TensorIterator dimension, fastest first, after its
    reordering (reduced dimensions first, each group by ascending input stride) and coalescing."""
    dims = [(shape[d], strides[d], d in reduced) for d in range(len(shape)) if shape[d] != 1]
    dims.sort(key=lambda t: (not t[2], t[1]))
    out: list[tuple[int, int, bool]] = []
    for size, stride, red in dims:
        if out and out[-1][2] == red and out[-1][0] * out[-1][1] == stride:
            out[-1] = (out[-1][0] * size, out[-1][1], red)
        else:
            out.append((size, stride, red))
    return out


def staging_bytes(it: list[tuple[int, int, bool]], acc: int, offset: int, sms: int, threads_per_sm: int) -> tuple[int, int]:
    """(staging buffer, semaphore) bytes of ``setReduceConfig`` for the iterator ``it`` (0, 0: no global reduce)."""
    n_red = sum(1 for _, _, r in it if r)
    num_outputs = 1
    for size, _, red in it:
        if not red:
            num_outputs *= size
    numel = 1
    for size, _, _ in it:
        numel *= size
    if not it or num_outputs == 0:
        return 0, 0
    inputs = numel // num_outputs
    fastest = n_red == len(it) or it[0][1] < it[n_red][1]
    stride0 = it[0][1] if fastest else it[n_red][1]
    dim0, dim1 = (inputs, num_outputs) if fastest else (num_outputs, inputs)
    vec = 1
    if stride0 == 1:
        if fastest and dim0 >= 128 and n_red == 1:
            dim0 //= _VEC
        elif not fastest:
            vec = _output_vec_size(it, n_red, offset)
            dim0 //= vec
    width, height = _block(dim0, dim1, _MAX_THREADS // vec)
    step_in = step_out = 1
    if fastest:
        step_in *= width
    else:
        step_out *= width
    warps_split = -(-inputs // step_in) >= min(height * 16, _MAX_VALUES)
    if not warps_split:
        return 0, 0
    step_in *= height
    grid_x = -(-(num_outputs // vec) // step_out)
    target = sms * (threads_per_sm // (width * height))
    per_thread = -(-inputs // step_in)
    if per_thread < _MAX_VALUES or grid_x > target:
        return 0, 0
    ctas = max(min(-(-target // grid_x), -(-per_thread // _MIN_VALUES)), -(-per_thread // _MAX_VALUES))
    if ctas <= 1:
        return 0, 0
    size = acc * num_outputs * ctas * (1 if fastest else width * vec)
    return size, 4 * grid_x


def _output_vec_size(it: list[tuple[int, int, bool]], n_red: int, offset: int) -> int:
    vec = 4
    for n in [offset, it[n_red][0]] + [stride for j, (_, stride, _) in enumerate(it) if j != n_red]:
        while n % vec:
            vec //= 2
    return vec


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _block(dim0: int, dim1: int, max_threads: int) -> tuple[int, int]:
    d0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(d0, _WARP)
    height = min(d1, max_threads // width)
    width = min(d0, max_threads // height)
    return width, height
