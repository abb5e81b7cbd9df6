"""FlexAttention in the fake step: routed to what the GPU kernel saves (output + log-sum-exp), compiled mask
builders run eagerly (they crashed the process inside fake mode), a CPU target gets a CollectionError with the
remedy, and nothing patched outlives ``collect``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

fa = pytest.importorskip("torch.nn.attention.flex_attention")

from sacplan.collector import collect  # noqa: E402
from sacplan.devices import CPU  # noqa: E402
from sacplan.errors import CollectionError  # noqa: E402

B, H, S, DH = 2, 2, 128, 16


def _causal(b, h, q, kv):
    return q >= kv


class FlexBlock(nn.Module):
    """Attention through ``flex_attention`` with a causal block mask (built in the forward, or once outside)."""

    def __init__(self, mask=None) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * DH, 3 * H * DH)
        self.o = nn.Linear(H * DH, H * DH)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], S, 3, H, DH).permute(2, 0, 3, 1, 4)
        mask = self.mask if self.mask is not None else fa.create_block_mask(_causal, None, None, S, S, device="cpu")
        y = fa.flex_attention(q, k, v, block_mask=mask)
        return self.o(y.transpose(1, 2).reshape(x.shape[0], S, H * DH))


def _attention_op(stats):
    ops = [o for o in stats.module("").ops if "attention" in o.name]
    assert len(ops) == 1, [o.name for o in stats.module("").ops]
    return ops[0]


def test_compiled_mask_builder_and_flex_collect_without_crashing_the_process() -> None:
    """torchtitan's pattern (compiled create_block_mask and flex_attention) in a child process: a segfault there
    fails this test instead of the suite."""
    code = textwrap.dedent(f"""
        import torch
        from torch import nn
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        from sacplan.collector import collect
        build, flex = torch.compile(create_block_mask), torch.compile(flex_attention)
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear({H * DH}, {3 * H * DH})
            def forward(self, x):
                q, k, v = self.qkv(x).view({B}, {S}, 3, {H}, {DH}).permute(2, 0, 3, 1, 4)
                return flex(q, k, v, block_mask=build(lambda b, h, q, kv: q >= kv, None, None, {S}, {S}, device="cpu"))
        x = torch.randn({B}, {S}, {H * DH}, dtype=torch.bfloat16)
        stats = collect(M(), (x,), device="h100", dtype=torch.bfloat16)
        print(*[o.name for o in stats.module("").ops if "attention" in o.name])
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["aten._scaled_dot_product_flash_attention.default"]


def test_flex_saves_output_and_logsumexp_as_the_gpu_kernel() -> None:
    x = torch.randn(B, S, H * DH, dtype=torch.bfloat16)
    stats = collect(FlexBlock(), (x,), device="h100", dtype=torch.bfloat16, optimizer=False)
    op = _attention_op(stats)
    # bf16 output, fp32 log-sum-exp, philox seed and offset (two 8-byte tensors, a 512-byte H100 block each)
    out, lse, rng_state = B * H * S * DH * 2, B * H * S * 4, 2 * 512
    assert op.name == "aten._scaled_dot_product_flash_attention.default"
    assert op.out_bytes == out + lse + rng_state


def test_flex_with_a_mask_built_outside_in_fp32_takes_the_efficient_kernel() -> None:
    mask = fa.create_block_mask(_causal, None, None, S, S, device="cpu")
    stats = collect(FlexBlock(mask), (torch.randn(B, S, H * DH),), device="h100", optimizer=False)
    op = _attention_op(stats)
    assert op.name == "aten._scaled_dot_product_efficient_attention.default"
    # fp32 output + log-sum-exp padded to 32 rows (S = 128 is a multiple) + seed/offset (2 blocks of 512 B)
    assert op.out_bytes == B * H * S * DH * 4 + B * H * S * 4 + 2 * 512


def _flex_state() -> tuple:
    import torch._dynamo

    return (fa.flex_attention_hop, fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG,
            torch._dynamo.config.disable)


def test_a_cpu_target_names_the_module_the_op_and_the_remedy_and_restores_flex() -> None:
    before = _flex_state()
    with pytest.raises(CollectionError) as e:
        collect(FlexBlock(), (torch.randn(B, S, H * DH),), device=CPU)
    msg = str(e.value)
    assert "FlexOnCpuTarget" in msg and "no backward on CPU" in msg and "device='h100'" in msg and "expert" not in msg
    assert _flex_state() == before
    collect(FlexBlock(), (torch.randn(B, S, H * DH),), device="h100")
    assert _flex_state() == before
