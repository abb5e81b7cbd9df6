"""PyTorch Lightning: plan selective activation checkpointing for the module a ``LightningModule`` trains.

    python examples/lightning_train.py                                # llama-small, plan for this host, 20 steps
    python examples/lightning_train.py --layers 2 --seq 64 --steps 3  # CI size

The plan is made for, and applied to, the ``nn.Module`` inside the ``LightningModule`` (``self.model``),
from one batch shaped as the ``DataLoader`` yields it and the same loss as ``training_step``; then
``Trainer.fit`` trains it as usual. Apply it before ``fit`` (or in ``configure_model``), before any
strategy wraps the module: ``apply_plan`` also accepts a DDP-wrapped or FSDP2-sharded model, and for those
the plan is made per rank (``world_size=N``). The target is the GPU you will train on (``--device h100``,
``sacplan devices``; default: this host, ``cpu``, or the CUDA card present).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import sacplan
from sacplan.apply import applied_plan
from sacplan.models import get_model
from sacplan.testing.torchvision_cpu import declare_torchvision_schemas

_KEEP = declare_torchvision_schemas()  # Lightning imports torchvision through torchmetrics when installed

import lightning as L  # noqa: E402


class LitLM(L.LightningModule):
    """Next-token prediction with any model mapping token ids (B, S) to logits (B, S, V)."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    @staticmethod
    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self.model(batch), batch)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default=None, help="target to plan for (default: this host's CUDA card, else cpu)")
    ap.add_argument("--budget-frac", type=float, default=0.5, help="0 = minimum feasible, 1 = no-checkpointing peak")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    target = args.device or (sacplan.devices.DeviceSpec.from_current_cuda() if cuda else "cpu")

    preset = get_model("llama-small")  # 4 layers, dim 256, vocab 1024 (sacplan's own Llama; any nn.Module works)
    torch.manual_seed(0)
    lit = LitLM(preset.build(n_layers=args.layers))
    ids = torch.randint(0, preset.config.vocab_size, (64 * args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(ids, batch_size=args.batch, shuffle=True)
    batch = next(iter(loader))  # one batch as training_step receives it

    # Plan for the inner module with training_step's loss; the budget between the minimum feasible and the peak.
    tree = sacplan.ModuleTree(sacplan.collect(lit.model, (batch,), device=target, loss_fn=lambda out, inp: LitLM.loss(out, inp[0])))
    lo, hi = sacplan.min_feasible_budget(tree), tree.stats.peak_bytes
    plan = sacplan.fit_to_budget(lit.model, (batch,), budget=int(lo + args.budget_frac * (hi - lo)), device=target,
                                 loss_fn=lambda out, inp: LitLM.loss(out, inp[0]), time_limit_s=20)
    print(plan.summary())

    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1)
    trainer.fit(lit, loader)
    assert applied_plan(lit.model) is plan  # Lightning trained the planned module itself
    print(f"trained {trainer.global_step} steps with the plan: loss {float(trainer.callback_metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
