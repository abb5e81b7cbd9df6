"""Hugging Face ``Trainer``: plan selective activation checkpointing with ``fit_to_budget``, then train.

    python examples/hf_trainer.py                                   # 4-layer Llama, plan for this host, 20 steps
    python examples/hf_trainer.py --layers 2 --hidden 64 --seq 64 --steps 3 --budget-frac 0.5   # CI size

``fit_to_budget`` is used where ``model.gradient_checkpointing_enable()`` (or ``TrainingArguments(
gradient_checkpointing=True)``) would be: it runs one fake training step of the model on exactly the batch the
Trainer will feed it (``per_device_train_batch_size`` x sequence length, keyword inputs, the loss the model
computes from ``labels``), solves for the least recomputation that fits the budget on the target device, and
applies the plan to the model in place. Leave ``gradient_checkpointing`` off in ``TrainingArguments``: the plan
is the checkpointing. The Trainer then trains the planned model as usual (no weights are downloaded: the model
is built from a config).

The target is the GPU you will train on (``--device h100``, ``a10g``, ... as in ``sacplan devices``; default:
this host, ``cpu``, or the CUDA card present) and the budget is per device, in bytes or as ``--budget 20GiB``.
``--budget-frac`` instead places it between the minimum feasible budget (0) and the no-checkpointing peak (1),
which needs the model collected once more. On a CUDA host the measured peak of the training steps is printed
beside the plan's prediction.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import sacplan
from sacplan.apply import applied_plan
from sacplan.testing.torchvision_cpu import declare_torchvision_schemas

_KEEP = declare_torchvision_schemas()  # transformers imports torchvision when installed (see the README)

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    """``n`` sequences of ``seq`` random token ids, each its own labels (causal LM); no download."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def budget_between(model: torch.nn.Module, batch: dict, frac: float, device: object) -> int:
    """Bytes between the minimum feasible budget (``frac`` 0) and the no-checkpointing peak (1)."""
    tree = sacplan.ModuleTree(sacplan.collect(model, batch, device=device, loss_fn=lambda out: out.loss))
    lo, hi = sacplan.min_feasible_budget(tree), tree.stats.peak_bytes
    return int(lo + frac * (hi - lo))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default=None, help="target to plan for (default: this host's CUDA card, else cpu)")
    ap.add_argument("--budget", default=None, help="per-device budget, e.g. 20GiB (default: --budget-frac 0.5)")
    ap.add_argument("--budget-frac", type=float, default=0.5, help="0 = minimum feasible, 1 = no-checkpointing peak")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    target = args.device or (sacplan.devices.DeviceSpec.from_current_cuda() if cuda else "cpu")

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.seq, use_cache=False)  # training: no key/value cache
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    data = RandomTokens(64 * args.batch, args.seq, args.vocab)
    batch = {k: torch.stack([data[i][k] for i in range(args.batch)]) for k in ("input_ids", "labels")}  # what Trainer feeds

    budget = args.budget or budget_between(model, batch, args.budget_frac, target)
    plan = sacplan.fit_to_budget(model, batch, budget=budget, device=target, loss_fn=lambda out: out.loss,
                                 time_limit_s=20)
    print(plan.summary())

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-3,
            logging_steps=max(1, args.steps // 4), save_strategy="no", report_to="none", use_cpu=not cuda,
            disable_tqdm=True, dataloader_num_workers=0,  # gradient checkpointing left off: the plan is the checkpointing
        )
        trainer = Trainer(model=model, args=targs, train_dataset=data)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        result = trainer.train()
    assert applied_plan(model) is plan  # the Trainer trained the planned model itself
    print(f"trained {result.global_step} steps with the plan: final loss {result.training_loss:.4f}")
    if cuda:
        print(f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB measured, "
              f"{plan.predicted_peak_bytes / 2**30:.2f} GiB predicted")
    sacplan.remove_plan(model)  # back to the plain model (e.g. for generation with a cache)


if __name__ == "__main__":
    main()
