"""CUDA reductions' staging buffers (sacplan.collector.reductions), against hand-derived configurations.

Every figure below was also read off ``torch.cuda.max_memory_allocated`` on an H200 (torch 2.11) around the
bias-gradient ``sum`` of a ViT-B/16 and a GPT-2 backward (benchmarks/cuda_probe.py; benchmarks/RESULTS.md,
"Real CUDA"): the op's peak above its start and its output.
"""

from __future__ import annotations

import pytest
import torch

from sacplan.collector.reductions import iterator_dims, reduction_staging_bytes
from sacplan.collector.workspace import workspace_bytes
from sacplan.devices import CPU, get_device

aten = torch.ops.aten
SEMAPHORES = 512  # 4 bytes per output block column, rounded up by the allocator


def _bias_grad(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> tuple:
    x = torch.empty(shape, dtype=dtype, device="meta")
    return (x, list(range(len(shape) - 1)))


def test_vit_bias_gradient_by_hand():
    # sum over (64, 197) rows of 768 bf16 features: a column reduction (the reduced dim is not the fastest), 4-wide
    # output vectors, 32x4 blocks, 6 block columns; 3152 values per thread; ctas = max(min(ceil(2112/6), ceil(3152/16)),
    # ceil(3152/256)) = 197 on 132 SMs x 16 blocks; buffer = 4 B (fp32 acc) x 768 x 197 x 32 x 4.
    assert reduction_staging_bytes(get_device("h200"), aten.sum.dim_IntList, _bias_grad((64, 197, 768)), {}) == 4 * 768 * 197 * 128 + SEMAPHORES


@pytest.mark.parametrize(
    ("shape", "ctas"),
    [((64, 197, 3072), 88), ((8, 1024, 3072), 88), ((8, 1024, 2304), 118), ((8, 1024, 768), 128)],
)
def test_measured_bias_gradients(shape, ctas):
    # 3072 features: 24 block columns, ceil(2112/24) = 88 < 197; 2304: 18 columns, 118; GPT-2's 768 over 8192 rows:
    # 2048 values per thread, ceil(2048/16) = 128 < 352.
    got = reduction_staging_bytes(get_device("h100"), aten.sum.dim_IntList, _bias_grad(shape), {})
    assert got == 4 * shape[-1] * ctas * 128 + SEMAPHORES


def test_fewer_sms_fewer_blocks():
    # A100: 108 SMs x 16 = 1728 blocks: ceil(1728/24) = 72 per column for 3072 features
    assert reduction_staging_bytes(get_device("a100-80gb"), aten.sum.dim_IntList, _bias_grad((64, 197, 3072)), {}) == 4 * 3072 * 72 * 128 + SEMAPHORES


def test_row_reductions_and_small_ones_need_no_staging():
    x = torch.empty(2, 2048, 2048, device="meta")
    h100 = get_device("h100")
    assert reduction_staging_bytes(h100, aten.mean.dim, (x, [-1], True), {}) == 0  # RMSNorm's mean: one block per row
    assert reduction_staging_bytes(h100, aten.sum.dim_IntList, _bias_grad((4, 16, 64)), {}) == 0  # few values per thread
    assert reduction_staging_bytes(h100, aten.sum.default, (x,), {}) < 64 * 1024  # a full sum meets in a few KiB


def test_host_cpu_and_workspace_entry_point():
    args = _bias_grad((64, 197, 768))
    assert reduction_staging_bytes(CPU, aten.sum.dim_IntList, args, {}) == 0
    h100 = get_device("h100")
    assert workspace_bytes(h100, aten.sum.dim_IntList, args, {}, None) == 4 * 768 * 197 * 128 + SEMAPHORES
    # the host never runs reductions to measure them
    assert workspace_bytes(CPU, aten.sum.dim_IntList, (torch.randn(64, 197, 768), [0, 1]), {}, None) == 0


def test_iterator_dims_reorders_and_coalesces():
    # (64, 197, 768) contiguous, reduce (0, 1): reduced dims first, coalesced into 12608 rows of stride 768
    assert iterator_dims([64, 197, 768], [197 * 768, 768, 1], {0, 1}) == [(12608, 768, True), (768, 1, False)]
    # reduce the last dim: it comes first (stride 1), the kept dims coalesce
    assert iterator_dims([2, 5, 7], [35, 7, 1], {2}) == [(7, 1, True), (10, 7, False)]
