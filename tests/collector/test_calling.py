"""The user's model API: dict (keyword) inputs and one-argument loss functions in collect and validate."""

from __future__ import annotations

import torch
from torch import nn

from sacplan.collector import collect
from sacplan.collector.calling import as_loss
from sacplan.devices import CPU
from sacplan.plan import ModuleDecision
from sacplan.validation import validate


class KwModel(nn.Module):
    """Takes keyword arguments and returns a dict with a loss, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(self.block(self.emb(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def _inputs() -> dict:
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_loss_form_decided_by_signature():
    out, inputs = object(), (1,)
    assert as_loss(lambda o: (o, "one"))(out, inputs) == (out, "one")
    assert as_loss(lambda o, i: (o, i))(out, inputs) == (out, inputs)
    assert as_loss(lambda *a: a)(out, inputs) == (out, inputs)
    assert as_loss(lambda o, i=None: (o, i))(out, inputs) == (out, inputs)


def test_collect_kwargs_inputs_and_one_argument_loss():
    stats = collect(KwModel, _inputs(), device=CPU, loss_fn=lambda out: out["loss"], optimizer=False)
    # the loss is the model's own: the embedding and all three linears ran forward and backward
    assert {"emb", "block.0", "block.2", "head"} <= {m.fqn for m in stats.modules}
    two = collect(KwModel, _inputs(), device=CPU, loss_fn=lambda out, inputs: out["loss"], optimizer=False)
    assert stats.peak_bytes == two.peak_bytes


def test_validate_kwargs_inputs_and_one_argument_loss():
    from sacplan.plan import Plan

    plan = Plan(
        decisions=(ModuleDecision(fqn="block"),), budget_bytes=1, predicted_peak_bytes=1, baseline_peak_bytes=1,
        recompute_ms=0.0, baseline_step_ms=0.0, status="optimal", objective_ms=0.0, bound_ms=0.0, gap=0.0,
        solver="test", build_s=0.0, solve_s=0.0, world_size=1, device_name="cpu", model_name="test", fingerprint="",
    )
    rep = validate(KwModel, _inputs, plan, loss_fn=lambda out: out["loss"], device="cpu")
    assert rep.grads_bitwise_equal
    # block recomputes its first matmul (32 tokens x 16 -> 64) for GELU's input; its output is the region's
    # output, so the early-stopping recomputation never reaches the second matmul: 2*32*16*64 FLOPs
    assert rep.measured_recompute_flops == rep.predicted_recompute_flops == 2 * 32 * 16 * 64
