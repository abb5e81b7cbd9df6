"""Third-party models at their large configs, planned on fake tensors for an H100.

Each model is built from its library's config object on the meta device (no weights, no real memory),
collected for one training step (bf16 except ResNet-50's fp32 default is kept bf16 too; AdamW foreach; the
library's own loss where it has one: ``labels``), then:

* ``no-AC``: predicted peak without checkpointing; ``peak at``: where that peak sits (phase / module);
* ``min feasible``: :func:`sacplan.solver.min_feasible_budget`;
* a plan at the budget midway between the two, solved with a time limit: solve seconds, status / gap, the
  recompute ms it adds per step (H100 roofline).

A model whose collection or solve fails gets its error in the table (e.g. T5's learned position bias before
the CUDA-target attention routing lands).

    python3 benchmarks/conformance.py                       # all models, writes nothing
    python3 benchmarks/conformance.py --only llama-7b gpt2-xl
    python3 benchmarks/conformance.py --write              # also replace the section in benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

GiB = 2**30
SECTION = "## Conformance: large configs on fakes (H100)"


def _declare_torchvision_ops() -> None:
    """PyPI torchvision's compiled ops do not load beside the CPU torch wheel; its models are pure Python and
    its fake registrations only need these schemas."""
    import torch

    if hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define(
        "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
        "int sampling_ratio, bool aligned) -> Tensor"
    )
    _declare_torchvision_ops.lib = lib  # type: ignore[attr-defined]


def _hf(cls_name: str, cfg_name: str, **cfg: Any) -> Callable[[], Any]:
    def build() -> Any:
        import transformers

        c = getattr(transformers, cfg_name)(**cfg)
        c._attn_implementation = "sdpa"
        return getattr(transformers, cls_name)(c)

    return build


def _models() -> dict[str, dict[str, Any]]:
    """name -> build (factory), inputs (factory, called in fake mode), loss (model, args) -> scalar, label."""
    import torch

    def lm(vocab: int, batch: int, seq: int) -> dict[str, Any]:
        return dict(
            inputs=lambda: (torch.randint(0, vocab, (batch, seq)),),
            loss=lambda m, a: m(input_ids=a[0], labels=a[0]).loss,
            shape=f"batch {batch}, seq {seq}",
        )

    def image(batch: int, classes: int, hf: bool) -> dict[str, Any]:
        def loss(m: Any, a: tuple) -> Any:
            if hf:
                return m(pixel_values=a[0], labels=a[1]).loss
            return torch.nn.functional.cross_entropy(m(a[0]).float(), a[1])

        return dict(
            inputs=lambda: (torch.randn(batch, 3, 224, 224, dtype=torch.bfloat16), torch.randint(0, classes, (batch,))),
            loss=loss,
            shape=f"batch {batch}, 224x224",
        )

    def timm_vit() -> Any:
        import timm

        return timm.create_model("vit_large_patch16_224", pretrained=False)

    def tv_resnet() -> Any:
        _declare_torchvision_ops()
        import torchvision

        return torchvision.models.resnet50()

    llama = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    mistral = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, sliding_window=None,
                   use_cache=False)
    qwen2 = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096, use_cache=False)
    return {
        "llama-7b": dict(build=_hf("LlamaForCausalLM", "LlamaConfig", **llama), **lm(32000, 1, 4096)),
        "mistral-7b": dict(build=_hf("MistralForCausalLM", "MistralConfig", **mistral), **lm(32000, 1, 4096)),
        "qwen2-7b": dict(build=_hf("Qwen2ForCausalLM", "Qwen2Config", **qwen2), **lm(152064, 1, 4096)),
        "gpt2-xl": dict(build=_hf("GPT2LMHeadModel", "GPT2Config", n_embd=1600, n_layer=48, n_head=25,
                                  n_positions=1024, use_cache=False), **lm(50257, 8, 1024)),
        "bert-large": dict(build=_hf("BertForMaskedLM", "BertConfig", hidden_size=1024, num_hidden_layers=24,
                                     num_attention_heads=16, intermediate_size=4096), **lm(30522, 32, 512)),
        "vit-l (transformers)": dict(build=_hf("ViTForImageClassification", "ViTConfig", hidden_size=1024,
                                               num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                                               num_labels=1000), **image(64, 1000, True)),
        "vit-l (timm)": dict(build=timm_vit, **image(64, 1000, False)),
        "t5-large": dict(build=_hf("T5ForConditionalGeneration", "T5Config", d_model=1024, d_ff=4096, d_kv=64,
                                   num_layers=24, num_heads=16, use_cache=False, decoder_start_token_id=0), **lm(32128, 8, 512)),
        "resnet-50 (torchvision)": dict(build=tv_resnet, **image(64, 1000, False)),
    }


def run_one(name: str, spec: dict[str, Any], time_limit: float) -> dict[str, Any]:
    import torch

    from sacplan.collector import collect
    from sacplan.solver import baseline_peak, min_feasible_budget, solve
    from sacplan.tree import ModuleTree

    row: dict[str, Any] = {"model": name, "shape": spec["shape"]}
    loss = spec["loss"]

    def step(model: Any, args: tuple, opt: Any) -> None:
        loss(model, args).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    try:
        stats = collect(spec["build"], spec["inputs"], device="h100", dtype=torch.bfloat16, train_step=step, model_name=name)
    except Exception as e:  # recorded, not fatal: the table says which models fail and why
        row["error"] = f"collect: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    row["collect_s"] = time.perf_counter() - t0
    tree = ModuleTree(stats)
    base = baseline_peak(tree)
    row["no_ac_gib"] = base / GiB
    row["peak_at"] = f"{stats.peak_phase}/{stats.peak_module or '<top>'}"
    try:
        lo = min_feasible_budget(tree)
        row["min_gib"] = lo / GiB
        budget = lo + (base - lo) // 2
        t1 = time.perf_counter()
        plan = solve(tree, max(budget, lo), time_limit_s=time_limit)
        row["solve_s"] = time.perf_counter() - t1
        row["budget_gib"] = budget / GiB
        row["status"] = plan.status + (f" {100 * plan.gap:.3f}%" if plan.gap == plan.gap and plan.gap > 0 else "")
        row["recompute_ms"] = plan.recompute_ms
        row["ckpt"] = sum(1 for d in plan.decisions if getattr(d, "checkpoint", True))
    except Exception as e:
        row["error"] = f"solve: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("model", "shape", "collect s", "no-AC GiB", "peak at", "min feasible GiB", "budget GiB", "solve s",
            "status / gap", "ckpt modules", "recompute ms")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        def f(k: str, fmt: str) -> str:
            return format(r[k], fmt) if k in r else "–"

        cells = [r["model"], r["shape"], f("collect_s", ".1f"), f("no_ac_gib", ".2f"), r.get("peak_at", "–"),
                 f("min_gib", ".2f"), f("budget_gib", ".2f"), f("solve_s", ".1f"), r.get("status", "–"),
                 str(r.get("ckpt", "–")), f("recompute_ms", ".1f")]
        if "error" in r:
            cells[-3] = "FAILED: " + r["error"].replace("|", "/")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_results(text: str, path: str) -> None:
    old = open(path).read() if os.path.exists(path) else ""
    if SECTION in old:
        start = old.index(SECTION)
        nxt = old.find("\n## ", start + len(SECTION))
        old = old[:start] + (old[nxt + 1 :] if nxt >= 0 else "")
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(old.rstrip("\n") + "\n\n" + text + "\n")
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="model names to run (default: all)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per plan, s (default 60)")
    ap.add_argument("--write", action="store_true", help="replace the section in benchmarks/RESULTS.md")
    args = ap.parse_args()
    _declare_torchvision_ops()
    models = _models()
    names = args.only or list(models)
    rows = []
    t0 = time.perf_counter()
    import torch

    def section() -> str:
        return (
            f"{SECTION} — `python3 benchmarks/conformance.py --write` ({time.perf_counter() - t0:.0f} s so far, torch "
        f"{torch.__version__}, this 2-core CPU host)\n\n"
        "Built from config objects on meta, one fake bf16 step with AdamW (foreach) and the library's loss "
        "(`labels`), for an H100. Plan: budget midway between the minimum feasible and the no-AC peak, solver "
        f"time limit {args.time_limit:g} s. `peak at`: where the no-AC peak sits (phase/module; `other` = "
        "optimizer step).\n\n" + table(rows)
        )

    for n in names:
        r = run_one(n, models[n], args.time_limit)
        rows.append(r)
        print(r, flush=True)
        if args.write:  # after every model: a run cut short still leaves its rows
            write_results(section(), os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    print(section())


if __name__ == "__main__":
    sys.exit(main())
