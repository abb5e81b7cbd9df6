"""Plan, apply and prove selective activation checkpointing for a Hugging Face Llama (built from a config).

    python examples/transformers_llama.py                 # tiny GQA Llama, plan for this CPU, validate
    python examples/transformers_llama.py --layers 4 --hidden 128 --target h100 --no-validate

The model is used as transformers users write it: keyword inputs (``input_ids`` / ``labels``) and the loss
the model computes itself (``loss_fn=lambda out: out.loss``). No weights are downloaded. ``apply_plan`` turns
the default ``config.use_cache=True`` off for training with one warning, as ``gradient_checkpointing_enable``
does. transformers imports torchvision when it is installed; beside a CPU torch wheel PyPI torchvision's
compiled ops do not load, so the op schemas its fake registrations expect are declared when missing
(:mod:`sacplan.testing.torchvision_cpu`).
"""

from __future__ import annotations

import argparse

import torch

import sacplan
from sacplan.testing.torchvision_cpu import declare_torchvision_schemas


_LIBS = declare_torchvision_schemas()  # the README's install: torchvision beside a CPU torch


from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402  (imports torchvision when installed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--target", default="cpu", help="device to plan for: cpu (this host) or a GPU name")
    ap.add_argument("--budget-frac", type=float, default=0.5, help="0 = minimum feasible, 1 = no-AC peak")
    ap.add_argument("--no-validate", action="store_true")
    args = ap.parse_args()

    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(64, args.seq), attention_dropout=0.1)

    def model_fn() -> LlamaForCausalLM:
        return LlamaForCausalLM(cfg)

    def inputs_fn() -> dict:
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids}

    def loss_fn(out):  # one argument: the ModelOutput
        return out.loss

    stats = sacplan.collect(model_fn, inputs_fn(), device=args.target, loss_fn=loss_fn)
    tree = sacplan.ModuleTree(stats)
    lo, hi = sacplan.min_feasible_budget(tree), stats.peak_bytes
    plan = sacplan.solve(tree, int(lo + args.budget_frac * (hi - lo)), time_limit_s=10)  # best plan found in 10 s
    print(plan.summary())

    model = model_fn().train()
    sacplan.apply_plan(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        loss = model(**inputs_fn()).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")

    if args.target == "cpu" and not args.no_validate:
        print(sacplan.validate(model_fn, inputs_fn, plan, loss_fn=loss_fn, device="cpu").summary())


if __name__ == "__main__":
    main()
