"""Plan, apply and prove selective activation checkpointing for a timm VisionTransformer (no weights).

    python examples/timm_vit.py                           # tiny ViT, plan for this CPU, validate
    python examples/timm_vit.py --depth 6 --dim 192 --target h100 --no-validate

timm imports torchvision; with PyPI torchvision beside a CPU torch wheel its compiled ops do not load, so
this script declares the op schemas torchvision's fake registrations expect
(:mod:`sacplan.testing.torchvision_cpu`, as the tests do) when they are missing.
"""

from __future__ import annotations

import argparse

import torch

import sacplan
from sacplan.testing.torchvision_cpu import declare_torchvision_schemas


_LIBS = declare_torchvision_schemas()  # the README's install: torchvision beside a CPU torch


def main() -> None:
    from timm.models.vision_transformer import VisionTransformer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--budget-frac", type=float, default=0.5)
    ap.add_argument("--no-validate", action="store_true")
    args = ap.parse_args()

    def model_fn() -> torch.nn.Module:
        return VisionTransformer(img_size=args.image, patch_size=8, embed_dim=args.dim, depth=args.depth, num_heads=4,
                                 num_classes=10, drop_rate=0.1, proj_drop_rate=0.1, attn_drop_rate=0.1)

    def inputs_fn() -> torch.Tensor:
        return torch.randn(args.batch, 3, args.image, args.image, generator=torch.Generator().manual_seed(0))

    labels = torch.arange(args.batch) % 10

    def loss_fn(logits, inputs):  # two arguments: (output, inputs)
        return torch.nn.functional.cross_entropy(logits, labels)

    stats = sacplan.collect(model_fn, inputs_fn(), device=args.target, loss_fn=loss_fn)
    tree = sacplan.ModuleTree(stats)
    lo, hi = sacplan.min_feasible_budget(tree), stats.peak_bytes
    plan = sacplan.solve(tree, int(lo + args.budget_frac * (hi - lo)), time_limit_s=10)  # best plan found in 10 s
    print(plan.summary())

    model = sacplan.apply_plan(model_fn().train(), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        loss = loss_fn(model(inputs_fn()), None)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")

    if args.target == "cpu" and not args.no_validate:
        print(sacplan.validate(model_fn, inputs_fn, plan, loss_fn=loss_fn, device="cpu").summary())


if __name__ == "__main__":
    main()
