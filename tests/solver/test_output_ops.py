"""Ops that make a checkpointed module's output: what saving them costs and what a full checkpoint recomputes.

The output op's output is kept anyway when the next module saves it, so saving it is free — but only for that
storage (attention's log-sum-exp beside its output is not), and a *full* checkpoint saves nothing: it re-runs
the output op too. Predicted recomputed FLOPs must equal ``FlopCounterMode``'s (a planned step minus a plain one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.evaluate import predict
from sacplan.solver.ops import module_options
from sacplan.tree import ModuleTree
from sacplan.validation import validate

B, H, S, D = 2, 4, 32, 16
E = H * D


class Attn(nn.Module):
    """q/k/v projections and fused attention; returns SDPA's output itself (no copy after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Mlp(nn.Module):
    """Two matmuls and a tanh, which makes the output and saves it for its backward (so recomputation reaches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, 2 * E) / 8)
        self.w2 = nn.Parameter(torch.randn(2 * E, E) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(x @ self.w1) @ self.w2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.mlp = Mlp()
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(x).transpose(1, 2).reshape(B, S, E)
        return self.out(self.mlp(a))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(B, S, E)


def _stats():
    return collect(_net, (_inputs(),), device=CPU, optimizer=False)


def test_attention_output_op_saves_its_logsumexp() -> None:
    ops = _stats().module("attn").ops
    sdpa = next(o for o in ops if "scaled_dot_product" in o.name)
    assert sdpa.is_output
    # out (B,H,S,D) fp32 is the module's output, kept by the next module; lse (B,H,S) fp32 is not.
    assert sdpa.out_bytes == B * H * S * D * 4 + B * H * S * 4
    assert sdpa.save_cost_bytes == B * H * S * 4


def test_full_checkpoint_recomputes_the_output_op() -> None:
    tree = ModuleTree(_stats())
    mlp = tree.node("mlp").stats
    tanh = next(o for o in mlp.ops if o.name == "aten.tanh.default")
    assert tanh.is_output and tanh.save_cost_bytes == 0 and tanh.index < mlp.recompute_stop and tanh.runtime_ms > 0
    rerun = [o for o in mlp.ops if o.index < mlp.recompute_stop]
    # A full checkpoint saves nothing: it re-runs every op up to the early stop, the free output op included.
    full = predict(tree, {"mlp": None})
    assert full.recompute_ms == sum(o.runtime_ms for o in rerun)
    assert full.recompute_flops == sum(o.flops for o in rerun)
    # The solver's options: the full discard names the free op instead, and recomputes everything else.
    t = mlp.tradeoff
    opts = module_options(mlp.ops, t.max_discard_bytes, t.full_recompute_ms, recompute_stop=mlp.recompute_stop)
    sel = opts.selection[opts.level_for(1.0)]
    assert opts.ratio[-1] == 1.0 and sel is not None and tanh.index in sel.saved
    assert sel.recompute_ms == sum(o.runtime_ms for o in rerun if o is not tanh)


def test_full_checkpoints_recompute_what_they_predict() -> None:
    from sacplan.plan import ModuleDecision, Plan

    decisions = tuple(ModuleDecision(fqn=f, saved_ops=None) for f in ("attn", "mlp"))  # full checkpoints
    plan = Plan(decisions=decisions, budget_bytes=1, predicted_peak_bytes=0, baseline_peak_bytes=0, recompute_ms=0.0,
                baseline_step_ms=0.0, status="hand-made", objective_ms=0.0, bound_ms=0.0, gap=0.0, solver="",
                build_s=0.0, solve_s=0.0, world_size=1, device_name="cpu", model_name="net", fingerprint="")
    report = validate(_net, _inputs, plan, optimizer=False)
    sdpa_flops = next(o.flops for o in _stats().module("attn").ops if "scaled_dot_product" in o.name)
    assert sdpa_flops > 0 and report.predicted_recompute_flops > sdpa_flops
    assert report.measured_recompute_flops == report.predicted_recompute_flops
    assert report.grads_bitwise_equal


def test_an_output_only_later_modules_read_is_never_saved() -> None:
    """``attn.qkv``'s output is read by the attention kernel's backward (outside ``attn.qkv``) and by none of its own:
    a cache holding it would keep it through ``attn.qkv``'s recomputation and backward, after the unplanned step has
    freed it, so no save list keeps it, not even one naming it. Outputs the module's own backward reads (``tanh``,
    attention's) stay free to save."""
    stats = _stats()
    qkv = next(o for o in stats.module("attn.qkv").ops if o.name == "aten.addmm.default")
    assert qkv.is_output and qkv.save_cost_bytes == 0 and qkv.output_kept_outside
    assert not any(o.output_kept_outside for f in ("attn", "mlp") for o in stats.module(f).ops)
    named = predict(ModuleTree(stats), {"attn.qkv": frozenset({("aten.addmm.default", 0)})})
    assert named.modules[0].saved_keys == frozenset()
