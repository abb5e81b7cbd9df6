"""One test per row of sacplan.collector.kernels.KERNEL_TABLE: CUDA bytes derived by hand from the kernels' outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.collector import collect
from sacplan.collector.kernels import EFFICIENT, FLASH, KERNEL_TABLE, MATH, sdpa_backend
from sacplan.devices import CPU, get_device

H100_EXACT = get_device("h100").replace(alloc_round_bytes=1)  # CUDA kernels, sizes without rounding


def _r(n: int) -> int:
    """CUDA caching allocator: every block a multiple of 512 B."""
    return -(-n // 512) * 512


class _DropoutNet(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(d, d), nn.Dropout(0.1), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.a(x)))


def test_table_has_one_row_per_op() -> None:
    ops = [r.op for r in KERNEL_TABLE]
    assert len(ops) == len(set(ops)) and all(r.routing for r in KERNEL_TABLE)


def test_dropout_saves_a_bool_mask_on_cuda() -> None:
    """GPT dims (batch 8, seq 1024, dim 768): CUDA's native_dropout keeps a bool mask, 1 B/elem; the CPU 4 B."""
    b, s, d = 8, 1024, 768
    x = torch.empty(b, s, d)
    gpu = collect(lambda: _DropoutNet(d), (x,), device="h100", optimizer=False)
    cpu = collect(lambda: _DropoutNet(d), (x,), device=CPU, optimizer=False)
    n = b * s * d  # 6,291,456 elements: a multiple of 512, so rounding adds nothing
    assert gpu.module("drop").act_bytes[0] == n  # the bool mask (its output is b's saved input, counted there)
    assert cpu.module("drop").act_bytes[0] == 4 * n
    assert cpu.module("drop").act_bytes[0] - gpu.module("drop").act_bytes[0] == 18_874_368
    gpu_ops = [o.name for o in gpu.module("drop").ops]
    assert gpu_ops == ["aten.native_dropout.default"]  # the op CUDA runs: one random op, keys as on the GPU
    assert "aten.bernoulli_.float" in [o.name for o in cpu.module("drop").ops]  # CPU target unchanged


def test_native_dropout_same_on_both() -> None:
    with FakeTensorMode():
        out, mask = torch.ops.aten.native_dropout(torch.empty(4, 8), 0.5, True)
    assert mask.dtype == torch.bool and mask.nbytes == 32  # 1 B/elem, as CUDA's


@pytest.mark.parametrize(
    ("dtype", "mask", "head", "want"),
    [
        (torch.bfloat16, False, 64, FLASH),
        (torch.float16, False, 256, FLASH),
        (torch.bfloat16, False, 512, EFFICIENT),  # flash takes head dim <= 256
        (torch.bfloat16, True, 64, EFFICIENT),  # flash takes no attn_mask
        (torch.float32, False, 64, EFFICIENT),  # flash takes fp16/bf16 only
        (torch.float32, False, 20, MATH),  # not a multiple of 8: no fused kernel
    ],
)
def test_sdpa_backend_choice(dtype: torch.dtype, mask: bool, head: int, want: str) -> None:
    q = torch.empty(2, 4, 16, head, dtype=dtype, device="meta")
    m = torch.empty(1, 4, 16, 16, dtype=dtype, device="meta") if mask else None
    assert sdpa_backend(q, q, q, m, 0.1) == want


class _Attn(nn.Module):
    def __init__(self, d: int, heads: int, dtype: torch.dtype, bias: bool = False, s: int = 0) -> None:
        super().__init__()
        self.h, self.dtype = heads, dtype
        self.proj = nn.Linear(d, 3 * d)
        self.bias = nn.Parameter(torch.zeros(1, heads, s, s)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.proj(x).to(self.dtype).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=0.1)
        return o.float()


def _kernel(stats):
    return next(o for o in stats.ops if "scaled_dot_product" in o.name)


def test_flash_saves_out_lse_and_rng_state() -> None:
    """bf16, B=2, H=4, S=100, D=64: out 2·4·100·64·2 B + lse (B,H,S) fp32 + rng state (2 × uint64) + empty."""
    b, h, s, hd = 2, 4, 100, 64
    x = torch.empty(b, s, h * hd)
    st = collect(lambda: _Attn(h * hd, h, torch.bfloat16), (x,), device="h100", optimizer=False).modules[0]
    k = _kernel(st)
    assert k.name == "aten._scaled_dot_product_flash_attention.default" and k.is_random
    assert k.out_bytes == _r(b * h * s * hd * 2) + _r(b * h * s * 4) + _r(16) + _r(8)


def test_efficient_pads_lse_and_counts_bias_gradient() -> None:
    """fp32 with a learned bias that requires grad (T5): memory-efficient kernel, lse padded to 32, bias grad.

    B=2, H=4, S=100, D=64: out 2·4·100·64·4 B, lse (B, H, ceil(100/32)·32 = 128) fp32, seed and offset
    int64 scalars (one block each), and the bias gradient (1, H, S, S) fp32 returned by its backward.
    """
    b, h, s, hd = 2, 4, 100, 64
    x = torch.empty(b, s, h * hd)
    stats = collect(lambda: _Attn(h * hd, h, torch.float32, bias=True, s=s), (x,), device="h100", optimizer=False)
    k = _kernel(stats.modules[0])
    assert k.name == "aten._scaled_dot_product_efficient_attention.default"
    assert k.out_bytes == _r(b * h * s * hd * 4) + _r(b * h * 128 * 4) + 2 * 512
    # parameter gradients: proj (weight + bias) and the position bias's (1, H, S, S) fp32 gradient
    d = h * hd
    assert stats.grad_bytes == _r(3 * d * d * 4) + _r(3 * d * 4) + _r(h * s * s * 4)


def test_layer_norm_half_residual() -> None:
    """bf16 LayerNorm: CUDA keeps fp32 mean/rstd (4 B × M each); host fakes keep bf16 (2 B): 4·M under-count."""
    m = 8
    with FakeTensorMode():
        _, mean, rstd = torch.ops.aten.native_layer_norm(torch.empty(m, 16, dtype=torch.bfloat16), [16], None, None, 1e-5)
        _, mean32, _ = torch.ops.aten.native_layer_norm(torch.empty(m, 16), [16], None, None, 1e-5)
    cuda_bytes = 2 * m * 4
    assert cuda_bytes - (mean.nbytes + rstd.nbytes) == 4 * m
    assert mean32.dtype == torch.float32  # fp32 input: same as CUDA


class _Same(nn.Module):
    """Embedding → RMSNorm → LM head; cross-entropy loss: embedding and cross-entropy keep the same on both
    kernels, RMSNorm does not (CUDA runs one fused kernel, the host a decomposition)."""

    def __init__(self, v: int, d: int) -> None:
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(v, d), nn.RMSNorm(d), nn.Linear(d, v, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)))


def test_rmsnorm_fused_on_cuda_embedding_cross_entropy_same_on_both() -> None:
    v, d, b, s = 64, 32, 2, 16
    ids = torch.zeros(b, s, dtype=torch.long)
    loss = lambda out, args: F.cross_entropy(out.flatten(0, 1), args[0].flatten())  # noqa: E731
    gpu = collect(lambda: _Same(v, d), (ids,), device=H100_EXACT, loss_fn=loss, optimizer=False)
    cpu = collect(lambda: _Same(v, d), (ids,), device=CPU, loss_fn=loss, optimizer=False)
    for fqn in ("emb", "head"):
        g, c = gpu.module(fqn), cpu.module(fqn)
        assert (g.act_bytes, [o.name for o in g.ops]) == (c.act_bytes, [o.name for o in c.ops]), fqn
    # CUDA: one _fused_rms_norm; its backward saves the input (the embedding's output, allocated before the
    # module) and rstd (b·s fp32): the module itself keeps only rstd
    assert [o.name for o in gpu.module("norm").ops] == ["aten._fused_rms_norm.default"]
    assert gpu.module("norm").act_bytes[0] == b * s * 4
    # host decomposition: the weight multiply also saves x·rstd (b·s·d fp32)
    assert "aten.rsqrt.default" in [o.name for o in cpu.module("norm").ops]
    assert cpu.module("norm").act_bytes[0] == b * s * d * 4 + b * s * 4
    # whole model: embedding output (saved by RMSNorm) + rstd + RMSNorm output (saved by the head)
    assert gpu.module("").act_bytes[0] == 2 * b * s * d * 4 + b * s * 4 == 8320
    assert cpu.module("").act_bytes[0] - gpu.module("").act_bytes[0] == b * s * d * 4
    assert gpu.grad_bytes == cpu.grad_bytes == (v * d + d + v * d) * 4  # embedding grad: dense (V × D)


class _ConvBN(nn.Module):
    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def test_batch_norm_runs_cudnn_on_cuda_with_the_same_bytes() -> None:
    """Training BatchNorm2d (C = 8, fp32): cuDNN keeps save_mean + save_var, the host save_mean + save_invstd:
    2 x 8 x 4 = 64 B either way; only the op (and so the SAC op list) differs."""
    x = torch.zeros(2, 3, 16, 16)
    gpu = collect(_ConvBN, (x,), device=H100_EXACT, optimizer=False)
    cpu = collect(_ConvBN, (x,), device=CPU, optimizer=False)
    assert [o.name for o in gpu.module("bn").ops] == ["aten.add_.Tensor", "aten.cudnn_batch_norm.default"]
    assert [o.name for o in cpu.module("bn").ops] == [
        "aten.add_.Tensor", "aten.empty.memory_format", "aten.native_batch_norm.default"
    ]
    assert gpu.module("bn").act_bytes == cpu.module("bn").act_bytes == (2 * 8 * 4,)


@pytest.mark.parametrize("case", ["bf16", "no affine"])
def test_batch_norm_cudnn_declines_stay_native_on_cuda(case: str) -> None:
    """cuDNN is not used for a bf16 input or without weight and bias: CUDA runs its native kernel, as the host."""
    mk = (lambda: _ConvBN().to(torch.bfloat16)) if case == "bf16" else (lambda: _ConvBN(affine=False))
    x = torch.zeros(2, 3, 16, 16, dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    gpu = collect(mk, (x,), device=H100_EXACT, optimizer=False)
    assert "aten.native_batch_norm.default" in [o.name for o in gpu.module("bn").ops]


def test_batch_norm_with_one_value_per_channel_still_raises_for_cuda() -> None:
    """Routing keeps F.batch_norm's own check: training on one value per channel is an error on every device."""
    from sacplan.errors import CollectionError

    with pytest.raises(CollectionError, match="more than 1 value per channel"):
        collect(lambda: nn.BatchNorm2d(8), (torch.zeros(1, 8, 1, 1),), device="h100", optimizer=False)


def test_adamw_step_lives_on_the_host_for_cuda() -> None:
    """AdamW (foreach, not capturable): 2 fp32 states per parameter on the device; step scalars on the host."""
    d = 128
    x = torch.empty(4, d)
    gpu = collect(lambda: nn.Linear(d, d), (x,), device="h100")
    cpu = collect(lambda: nn.Linear(d, d), (x,), device=CPU)
    assert gpu.optimizer_bytes == 2 * (_r(d * d * 4) + _r(d * 4))
    assert cpu.optimizer_bytes == 2 * (d * d * 4 + d * 4) + 2 * 4  # the host counts its own step tensors
