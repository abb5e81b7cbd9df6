"""For a CUDA target, every recorded forward op is one CUDA's aten dispatch would run, not a host-only
decomposition (sacplan.collector.kernels routes those): a small transformer block on an H100 target.

What CUDA runs, by op family (PyTorch's dispatch on a CUDA tensor, training mode):
nn.Dropout -> ``at::dropout`` takes the fused path (``native_dropout``: output + bool mask) for CUDA tensors;
the host's ``_dropout_impl`` (``empty_like`` + ``bernoulli_`` + ``div_`` + ``mul``) never runs there.
SDPA -> flash (fp16/bf16, head dim <= 256 and % 8 == 0, no mask) or memory-efficient (fp32); never the math
path (``_safe_softmax``, s x s scores) nor the host's ``_scaled_dot_product_flash_attention_for_cpu``.
nn.RMSNorm -> ``_fused_rms_norm`` (CUDA kernel; on the host it is only a decomposition: pow/mean/rsqrt/mul).
LayerNorm -> ``native_layer_norm``; GELU -> ``gelu``; softmax -> ``_softmax``; embedding -> ``embedding``;
cross-entropy -> ``_log_softmax`` + ``nll_loss_forward``; Linear on 3-D input -> view + t + addmm + view
(``at::linear`` folds the batch dims the same way on every device).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU

B, S, D, H, V = 2, 32, 64, 4, 128  # head dim 16: flash-eligible in bf16

#: ops of the host's own decompositions that a CUDA device never runs for these modules
HOST_ONLY_OPS = frozenset(
    {
        "aten.bernoulli_.float",  # dropout's host decomposition
        "aten.bernoulli.p",
        "aten.empty_like.default",
        "aten.div_.Scalar",
        "aten._safe_softmax.default",  # SDPA's math path
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten.pow.Tensor_Scalar",  # RMSNorm's host decomposition
        "aten.rsqrt.default",
    }
)


def _r(n: int) -> int:
    """CUDA caching allocator: every block a multiple of 512 B."""
    return -(-n // 512) * 512


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(B, S, D))


class CrossEntropy(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TinyLM(nn.Module):
    """Embedding -> LayerNorm -> attention (dropout) -> Dropout -> RMSNorm -> Linear -> softmax gate -> GELU
    -> Linear -> Dropout -> LM head -> cross-entropy, all inside the model so every op is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.attn, self.drop1 = nn.Embedding(V, D), nn.LayerNorm(D), Attention(), nn.Dropout(0.1)
        self.norm = nn.RMSNorm(D)
        self.fc1, self.gate, self.act = nn.Linear(D, 4 * D), nn.Softmax(dim=-1), nn.GELU()
        self.fc2 = nn.Linear(4 * D, D)
        self.drop2, self.head, self.loss = nn.Dropout(0.1), nn.Linear(D, V), CrossEntropy()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.drop1(self.attn(self.ln(x)))
        x = x + self.drop2(self.fc2(self.act(self.gate(self.fc1(self.norm(x))))))
        return self.loss(self.head(x), ids)


LINEAR = ["aten.view.default", "aten.t.default", "aten.addmm.default", "aten.view.default"]


def _collect(dtype: torch.dtype, device="h100"):
    ids = torch.zeros(B, S, dtype=torch.long)
    return collect(lambda: TinyLM().to(dtype), (ids,), device=device, loss_fn=lambda out, args: out, optimizer=False)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def h100(request):
    return request.param, _collect(request.param)


def test_no_host_only_op_for_a_cuda_target(h100) -> None:
    _, stats = h100
    recorded = {o.name for m in stats.modules for o in m.ops}
    assert recorded & HOST_ONLY_OPS == set()


def test_each_module_runs_the_cuda_kernels(h100) -> None:
    dtype, stats = h100
    ops = {m.fqn: [o.name for o in m.ops] for m in stats.modules}
    assert ops["emb"] == ["aten.embedding.default"]
    assert ops["ln"] == ["aten.native_layer_norm.default"]
    assert ops["norm"] == ["aten._fused_rms_norm.default"]
    assert ops["drop1"] == ops["drop2"] == ["aten.native_dropout.default"]
    assert ops["gate"] == ["aten._softmax.default"]
    assert ops["act"] == ["aten.gelu.default"]
    for fqn in ("attn.qkv", "attn.proj", "fc1", "fc2", "head"):
        assert ops[fqn] == LINEAR, fqn
    kernel = "flash" if dtype == torch.bfloat16 else "efficient"  # bf16: flash; fp32: memory-efficient
    kernel = f"_scaled_dot_product_{kernel}_attention"
    layout = set(LINEAR) | {"aten.permute.default", "aten.unbind.int", "aten.transpose.int"}
    assert [n for n in ops["attn"] if n not in layout] == [f"aten.{kernel}.default"]
    loss_ops = [n for n in ops["loss"] if n != "aten.view.default"]
    assert loss_ops == ["aten._log_softmax.default", "aten.nll_loss_forward.default"]
    # the random ops are the three dropouts (attention's inside its kernel), each one kernel as on the GPU
    assert [o.name for m in stats.modules if not m.fqn for o in m.ops if o.is_random] == [
        f"aten.{kernel}.default", "aten.native_dropout.default", "aten.native_dropout.default"
    ]


def test_cuda_saved_bytes_by_hand(h100) -> None:
    """Dropout keeps its bool mask (B*S*D bytes: 4096, 8 blocks of 512); RMSNorm keeps rstd (B*S fp32: 256 B,
    one 512-B block), its input being the residual stream allocated before it."""
    _, stats = h100
    assert stats.module("drop1").act_bytes == stats.module("drop2").act_bytes == (_r(B * S * D),) == (4096,)
    assert stats.module("norm").act_bytes == (_r(B * S * 4),) == (512,)


def test_cpu_target_keeps_the_host_kernels() -> None:
    """The CPU target (validation on the host) is unchanged: host decompositions, fp32 noise masks."""
    stats = _collect(torch.float32, CPU)
    ops = {m.fqn: [o.name for o in m.ops] for m in stats.modules}
    assert "aten.bernoulli_.float" in ops["drop1"]
    assert "aten.rsqrt.default" in ops["norm"]
    assert stats.module("drop1").act_bytes == (B * S * D * 4,)  # the fp32 noise mask
    assert stats.module("norm").act_bytes == (B * S * D * 4 + B * S * 4,)  # x*rstd (fp32) + rstd


class _MixedNorm(nn.Module):
    """A bf16 activation into an fp32-weight RMSNorm: ``rms_norm`` declines the fused kernel on every device
    (dtype mismatch) and runs its composite, CUDA included."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_with_mismatched_weight_dtype_stays_composite_on_cuda() -> None:
    stats = collect(_MixedNorm, (torch.zeros(B, S, D),), device="h100", optimizer=False)
    ops = [o.name for o in stats.module("norm").ops]
    assert "aten._fused_rms_norm.default" not in ops and "aten.rsqrt.default" in ops


def test_host_kernels_are_reentrant_and_removed() -> None:
    from sacplan.collector.kernels import cuda_host_kernels

    has = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CPU")  # noqa: E731
    assert not has()
    with cuda_host_kernels():
        with cuda_host_kernels():
            assert has()
        assert has()
        x, w = torch.randn(4, D), torch.randn(D)  # real host tensors: the kernel computes PyTorch's values
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        torch.testing.assert_close(torch.rms_norm(x, (D,), w, 1e-6), want)
    assert not has()


#: dense ops the host build can only decompose although another backend has a kernel (and autograd formula)
#: for them, that collection deliberately leaves decomposed: CUDA runs the same composite as the host
NOT_CUDA_KERNELS = {"aten::max_pool2d": "MPS kernel only; CUDA decomposes to max_pool2d_with_indices, as the host"}


def test_every_op_cuda_runs_fused_but_the_host_decomposes_is_routed() -> None:
    """From the dispatcher: an op with an autograd formula (``Autograd`` kernel) that dense host tensors
    nevertheless run through ``CompositeImplicitAutograd`` (no kernel of their own) is an op some device build
    runs as one kernel. Each must be routed (``HOST_DECOMPOSED_OPS``) or known not to be a CUDA kernel; a new
    PyTorch adding one fails here until it is classified in sacplan.collector.kernels."""
    from sacplan.collector.kernels import HOST_DECOMPOSED_OPS

    dense = ("CPU", "NestedTensorCPU", "NestedTensorHPU", "MkldnnCPU", "SparseCPU", "QuantizedCPU")
    found = set()
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or name.endswith("_backward") or "_backward." in name:
            continue  # backward kernels are not recorded forward ops
        dump = torch._C._dispatch_dump(name)
        if "CompositeImplicitAutograd[alias]" not in dump or "\nAutograd[alias]:" not in dump:
            continue
        table = torch._C._dispatch_dump_table(name).splitlines()
        direct = {ln.split(":")[0] for ln in table if ln.rstrip().endswith("[kernel]")}
        if not direct & set(dense):  # no host kernel for any tensor kind: the formula is for another device
            found.add(name)
    assert found == {f"aten::{fw}" for fw, _ in HOST_DECOMPOSED_OPS} | set(NOT_CUDA_KERNELS)
