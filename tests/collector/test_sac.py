"""Per-op SAC facts: random, in-place, view, saved-by-autograd flags, early-stop recompute, attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.models.llama import Llama, LLAMA_PRESETS, example_tokens, next_token_loss


class Block(nn.Module):
    """fc1 -> relu_ (in place) -> view -> fc2 -> + 1.

    Forward ops (x (4, 16) does not require grad):
      0 t        W1ᵀ (view; not saved: x needs no grad, so addmm keeps only x for W1's grad)
      1 addmm    h = b1 + x W1ᵀ                  (its storage is then modified and saved by relu_)
      2 relu_    in place on op 1's output        (saves its result = op 1's storage)
      3 view     (4, 32) view of that storage     (saved: fc2's addmm keeps it as mat1)
      4 t        W2ᵀ (view; saved: mat2 is needed for the grad of h)
      5 addmm    y = b2 + h W2ᵀ  -> packs mat1 and mat2 *before* it runs: the last pack happens here
      6 add      y + 1 (saves nothing; the module output)
    Early-stop recomputation therefore runs ops 0..4 and stops at op 5: recompute_stop = 5.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x), inplace=True)
        h = h.view(-1, 32)
        return self.fc2(h) + 1.0


@pytest.fixture(scope="module")
def block_stats():
    return collect(Block(), (torch.randn(4, 16),), device=CPU)


def test_block_ops_and_flags(block_stats):
    ops = block_stats.module("").ops
    assert [o.name for o in ops] == [
        "aten.t.default",
        "aten.addmm.default",
        "aten.relu_.default",
        "aten.view.default",
        "aten.t.default",
        "aten.addmm.default",
        "aten.add.Tensor",
    ]
    assert [o.occurrence for o in ops] == [0, 0, 0, 0, 1, 1, 0]
    assert [o.is_view for o in ops] == [True, False, False, True, True, False, False]
    assert [o.inplace_of for o in ops] == [None, None, 1, None, None, None, None]
    assert [o.saved_by_autograd for o in ops] == [False, True, True, True, True, False, False]
    assert [o.is_output for o in ops] == [False, False, False, False, False, False, True]
    assert [o.out_bytes for o in ops] == [0, 4 * 32 * 4, 0, 0, 0, 4 * 16 * 4, 4 * 16 * 4]
    assert not any(o.is_random for o in ops)
    # The output costs nothing extra to save only when the output itself is kept; here it is not.
    assert ops[6].save_cost_bytes == ops[6].out_bytes
    assert all(o.save_cost_bytes == 0 for o in ops if o.is_view)


def test_block_recompute_stop(block_stats):
    root = block_stats.module("")
    assert root.recompute_stop == 5
    # the relu_ output (= fc1's storage, 512 B) is the only activation kept beyond the output
    assert root.act_bytes == (4 * 32 * 4,)
    # fc2's addmm (index 5) and the add (6) are past the stop: full recompute costs ops 0..4 only
    expected_ms = sum(o.runtime_ms for o in root.ops[:5])
    assert root.tradeoff.full_recompute_ms == pytest.approx(expected_ms)


def test_leaf_recompute_stop_and_inplace_of_outside_tensor(nested_cpu):
    # nn.ReLU(inplace=True) modifies its input, which was made outside it: inplace_of is itself (index 0).
    act = nested_cpu.module("act")
    assert [(o.name, o.inplace_of, o.is_output) for o in act.ops] == [("aten.relu_.default", 0, True)]
    assert act.recompute_stop == 1  # relu_ saves its result after it runs
    # Linear: t (view) then addmm, which packs its input x before running -> stop at 1
    assert nested_cpu.module("pre").recompute_stop == 1


def test_inplace_relu_points_at_the_op_it_modifies(nested_cpu):
    ops = nested_cpu.module("").ops
    relu_ = [o for o in ops if o.name == "aten.relu_.default"]
    assert len(relu_) == 1
    head = ops[relu_[0].inplace_of]
    assert head.name == "aten.addmm.default" and head.occurrence == 4  # the second call of `shared`
    assert head.index == relu_[0].index - 1


def test_dropout_ops_are_random_and_grouped(nested_cpu):
    drop = nested_cpu.module("drop")
    random = [o for o in drop.ops if o.is_random]
    assert random, "dropout must be flagged random"
    assert {o.name for o in random} <= {"aten.bernoulli_.float", "aten.native_dropout.default"}
    # the host decomposes dropout into empty_like, bernoulli_ (in place), div_ (in place), mul
    for o in drop.ops:
        if o.name in ("aten.bernoulli_.float", "aten.div_.Scalar"):
            assert o.inplace_of == 0 and drop.ops[0].name == "aten.empty_like.default"
    # the mask is saved for backward
    assert any(o.saved_by_autograd for o in random)


def test_dropout_is_not_random_in_eval_or_with_p0():
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0))
    stats = collect(m, (torch.randn(2, 8),), device=CPU)
    assert not any(o.is_random for mod in stats.modules for o in mod.ops)


def test_views_are_flagged_with_no_bytes(nested_cpu):
    views = [o for m in nested_cpu.modules for o in m.ops if o.name in ("aten.t.default", "aten.view.default")]
    assert views and all(o.is_view and o.out_bytes == 0 and o.save_cost_bytes == 0 for o in views)


def test_saved_by_autograd_marks_kept_outputs(mlp_cpu):
    ops = mlp_cpu.module("").ops
    by = {(o.name, o.occurrence): o.saved_by_autograd for o in ops}
    # relu keeps its output; the first addmm's output is not kept (relu saves its result, not its input);
    # the final addmm's output is not saved by anything.
    assert by[("aten.relu.default", 0)] is True
    assert by[("aten.addmm.default", 0)] is False
    assert by[("aten.addmm.default", 1)] is False
    assert mlp_cpu.module("").recompute_stop == 4  # the second addmm packs relu's output and W2ᵀ first


# -------------------------------------------------------------------------------------------- attention
B, S, D, H = 1, 2048, 64, 4
HD = D // H


def _attention_module(device):
    """One Llama block (dim 64, 4 heads, MHA), dropout 0.1, sequence 2048, fp32: its attention's stats."""
    cfg = LLAMA_PRESETS["llama-tiny"].with_(n_layers=1, n_kv_heads=None, dropout=0.1, max_seq_len=S)
    stats = collect(
        lambda: Llama(cfg),
        (example_tokens(B, S, cfg.vocab_size),),
        loss_fn=lambda out, inp: next_token_loss(out, inp[0]),
        device=device,
    )
    return stats.module("layers.0.attention")


@pytest.fixture(scope="module")
def attn_h100():
    return _attention_module("h100")


@pytest.fixture(scope="module")
def attn_cpu():
    return _attention_module(CPU)


def test_target_attention_saves_no_score_matrix(attn_h100):
    """On an H100 target SDPA is a fused kernel: it keeps q, k, v, out and the log-sum-exp, no s×s matrix."""
    scores = B * H * S * S * 4  # one fp32 s×s matrix per head: 64 MiB
    act = attn_h100.act_bytes[0]
    assert act < scores / 20
    bsd = B * S * D * 4  # one (B, S, D) fp32 tensor: 512 KiB
    lse = B * H * S * 4  # log-sum-exp (B, H, S) fp32
    # rotated q and k (made by apply_rotary), v (wv's output), the memory-efficient kernel's output + lse
    # (CUDA runs it for fp32) + its seed/offset int64 scalars (one 512 B allocation each), and the output
    # dropout's mask (CUDA's native_dropout: bool, 1 B/elem)
    assert act == 3 * bsd + (bsd + lse + 2 * 512) + bsd // 4
    kernel = [o for o in attn_h100.ops if "scaled_dot_product" in o.name]
    assert len(kernel) == 1
    k = kernel[0]
    assert k.name == "aten._scaled_dot_product_efficient_attention.default"
    assert k.is_random  # dropout_p > 0 runs inside the target's kernel
    assert k.out_bytes == bsd + lse + 2 * 512 and k.saved_by_autograd
    # random ops: the kernel and the output dropout (CUDA's native_dropout), decided together
    assert {o.name for o in attn_h100.ops if o.is_random} == {k.name, "aten.native_dropout.default"}


def test_host_math_attention_keeps_score_matrices(attn_cpu, attn_h100):
    """The same model collected for the CPU host (math path with dropout) keeps s×s matrices.

    Softmax output, dropout noise and the dropped probabilities (3 fp32 s×s per head) are saved: why the
    target device, not the host, must decide what attention saves.
    """
    scores = B * H * S * S * 4
    act = attn_cpu.act_bytes[0]
    assert act >= 3 * scores
    assert act > 50 * attn_h100.act_bytes[0]
    assert not any("flash_attention" in o.name for o in attn_cpu.ops)
    bern = [o for o in attn_cpu.ops if o.name == "aten.bernoulli_.float"]
    assert len(bern) == 2 and all(o.is_random for o in bern)  # on the probabilities and on the output
