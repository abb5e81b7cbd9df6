"""Kernel scratch (workspace) bytes per op: CUDA rules derived by hand, CPU figures measured on this host."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.collector.workspace import kernel_scratch_bytes, workspace_bytes
from sacplan.devices import CPU, get_device

aten = torch.ops.aten
H100_EXACT = get_device("h100").replace(alloc_round_bytes=1)
H100 = get_device("h100")


def _nc(*shape: int) -> torch.Tensor:
    """A non-contiguous tensor of ``shape`` (a transposed view of a contiguous one)."""
    return torch.empty(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


def test_layer_norm_copies_a_non_contiguous_input() -> None:
    x, w, b = _nc(8, 17, 64), torch.empty(64), torch.empty(64)
    assert not x.is_contiguous()
    args = (x, [64], w, b, 1e-5)
    assert kernel_scratch_bytes(H100_EXACT, aten.native_layer_norm.default, args) == 8 * 17 * 64 * 4
    # The CUDA allocator rounds the copy to 512 B blocks: 34,816 B is already a multiple.
    assert kernel_scratch_bytes(H100, aten.native_layer_norm.default, args) == 34_816
    contiguous = (x.contiguous(), [64], w, b, 1e-5)
    assert kernel_scratch_bytes(H100_EXACT, aten.native_layer_norm.default, contiguous) == 0


def test_layer_norm_backward_copies_grad_and_input() -> None:
    g, x = _nc(8, 17, 64), _nc(8, 17, 64)
    mean, rstd = torch.empty(8, 17, 1), torch.empty(8, 17, 1)
    args = (g, x, [64], mean, rstd, torch.empty(64), torch.empty(64), [True, True, True])
    assert kernel_scratch_bytes(H100_EXACT, aten.native_layer_norm_backward.default, args) == 2 * 8 * 17 * 64 * 4
    args_one = (g.contiguous(),) + args[1:]
    assert kernel_scratch_bytes(H100_EXACT, aten.native_layer_norm_backward.default, args_one) == 8 * 17 * 64 * 4


def test_safe_softmax_builds_two_bool_masks() -> None:
    """softmax, then eq(-inf) (one bool per element) and all(dim) (one bool per row)."""
    x = torch.empty(4, 4, 64, 64)
    assert kernel_scratch_bytes(H100_EXACT, aten._safe_softmax.default, (x, -1)) == 4 * 4 * 64 * 64 + 4 * 4 * 64
    # rounded: 65,536 B and 1,024 B, both multiples of 512
    assert kernel_scratch_bytes(H100, aten._safe_softmax.default, (x, -1)) == 65_536 + 1_024
    assert kernel_scratch_bytes(H100_EXACT, aten._safe_softmax.default, (x, 2)) == 4 * 4 * 64 * 64 + 4 * 4 * 64


def test_other_ops_have_no_scratch() -> None:
    x = torch.empty(8, 64)
    assert kernel_scratch_bytes(H100_EXACT, aten.mm.default, (x, x.t())) == 0
    assert workspace_bytes(H100_EXACT, aten.relu.default, (x,), {}, x) == 0


def test_cpu_layer_norm_workspace_is_measured() -> None:
    """On the host the scratch is measured on real tensors of the same shapes and strides (from fakes too)."""
    with FakeTensorMode():
        x, w, b = _nc(8, 17, 64), torch.empty(64), torch.empty(64)
        out = torch.ops.aten.native_layer_norm.default(x, [64], w, b, 1e-5)
    assert workspace_bytes(CPU, aten.native_layer_norm.default, (x, [64], w, b, 1e-5), {}, out) == 34_816


def test_cpu_matmul_copies_an_expanded_operand() -> None:
    """The gradient of ``sum`` / ``mean`` reaches a ``Linear`` expanded (stride 0): the CPU ``mm`` copies it into a
    contiguous temporary (64 x 16 fp32 = 4,096 B, measured); operands BLAS reads in place are not measured."""
    with FakeTensorMode():
        w = torch.empty(16, 16)
        g = torch.empty(()).expand(64, 16)
        out = aten.mm.default(g, w)
        ws = workspace_bytes(CPU, aten.mm.default, (g, w), {}, out)
        plain = workspace_bytes(CPU, aten.mm.default, (g.contiguous(), w.t()), {}, out)
    assert ws == 64 * 16 * 4
    assert plain == 0


def test_cpu_flash_attention_workspace_is_measured() -> None:
    """The CPU flash attention kernels allocate per-thread score blocks and accumulators beyond their outputs
    (a one-layer attention model's unplanned peak was 2.7% over the prediction without them)."""
    with FakeTensorMode():
        q = torch.empty(2, 2, 16, 16)
        out = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)
        ws = workspace_bytes(CPU, aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {}, out)
    assert ws > 0


def test_cpu_gelu_backward_with_a_transposed_gradient_keeps_two_temporaries() -> None:
    """Exact GELU's CPU backward, its output gradient laid out otherwise than its input (a conv block's activation
    before ``transpose``), keeps two input-sized temporaries (measured: peak 3x the output); laid out alike, none.
    Without it a conv1d → GELU model under ``mse_loss`` was +2.34% over (tests/fuzz/test_regressions.py)."""
    with FakeTensorMode():
        x = torch.empty(4, 64, 64)
        g = _nc(4, 64, 64)
        out = aten.gelu_backward.default(g, x)
        ws = workspace_bytes(CPU, aten.gelu_backward.default, (g, x), {}, out)
        alike = workspace_bytes(CPU, aten.gelu_backward.default, (x, x), {}, out)
    assert ws == 2 * 4 * 64 * 64 * 4
    assert alike == 0
    assert kernel_scratch_bytes(H100, aten.gelu_backward.default, (g, x)) == 0  # CUDA: one TensorIterator kernel


def test_gloo_reduce_scatter_reduces_a_copy_of_its_input_on_the_host() -> None:
    """gloo's ``_reduce_scatter_base`` (FSDP2's gradient reduce-scatter on CPU) reduces a clone of its input: an
    input-sized transient on the host (128 fp32 = 512 B; bf16 256 B); NCCL on a CUDA target none. Without it a
    bf16-parameter / fp32-reduce FSDP2 step on 2 gloo ranks was 25% under (tests/fuzz/test_fuzz_mesh.py)."""
    rs = torch.ops.c10d._reduce_scatter_base_.default
    for dtype, nbytes in ((torch.float32, 512), (torch.bfloat16, 256)):
        inp, out = torch.empty(128, dtype=dtype), torch.empty(64, dtype=dtype)
        assert workspace_bytes(CPU, rs, (out, inp, None, None, False, -1), {}, out) == nbytes
        assert workspace_bytes(H100, rs, (out, inp, None, None, False, -1), {}, out) == 0
