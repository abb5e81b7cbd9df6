"""How sacplan's SAC MILP scales with model depth, against PyTorch's reference ``sac_milp``.

Usage::

    python benchmarks/solver_scaling.py                       # N = 2, 8, 32, 80, 128 blocks; 90/70/50% budgets
    python benchmarks/solver_scaling.py --blocks 8,32 --ref-max-blocks 8
    python benchmarks/solver_scaling.py --collected           # also real trees from sacplan.collect
    python benchmarks/solver_scaling.py --issue14             # issue 14's cells (llama-small x48, README sweep, 8B ws8)
                                                              # (Llama-7B shape, planned for 8 FSDP ranks)
    python benchmarks/solver_scaling.py --user-trees          # issue 26's third-party trees (below)
    python benchmarks/solver_scaling.py --user-trees --only bert-large --cache /tmp/trees
    python benchmarks/solver_scaling.py --tiny-cnns --cache /tmp/cnn_trees   # issue 26.2's tiny conformance CNNs

``--user-trees``: the trees users bring (issue 26), collected on fakes for an H100 (bf16, AdamW) from the libraries'
config objects, planned at the budget midway between the minimum feasible and the no-AC peak: with the default
settings (deterministic work limit, 60 s safety net: seconds, status, gap, who proved it, the chain DP's work
units) and side by side main's path, ``SolverOptions(chain_dp=False)`` (the tree DP, then the MILP: seconds,
status, gap, nodes, what stopped it), and whether the two plans agree. Timings are wall seconds of this host.
Old against new code (issue 26.2's table in benchmarks/RESULTS.md): ``--no-old`` with the same ``--cache`` on each
checkout (``git archive <commit> | tar -x -C old/``, then ``PYTHONPATH=old``), one tree at a time (``--only``).

Trees: synthetic Llama-7B-shaped models (``sacplan/testing/llama_tree.py:llama_spec``; the per-module bytes and
milliseconds are derived in its docstring: hidden 4096, seq 4096, batch 1, bf16, flash attention, H100-SXM,
FSDP over 8 ranks) simulated without checkpointing into the same ``ModelStats`` that ``sacplan.collect``
produces. For every tree and budget (a fraction of the no-checkpointing peak) the table shows:

* ``sacplan``: :func:`sacplan.solver.solve` on the event-timeline model (build = model + heuristic incumbent,
  solve = branch-and-bound; ``total`` includes op-level realisation), status, gap, MILP objective;
* ``compat``: :func:`sacplan.solver.sac_milp` on PyTorch's ``Graph`` (``parse_module_info(tree.to_torch_module_info())``)
  -- PyTorch's memory model, solved to gap 1e-4 by sacplan's formulation;
* ``ref``: ``torch.distributed._tools.sac_ilp.sac_milp`` on the same ``Graph`` (5% gap, 180 s limit), budget as
  the same fraction of the reference's own baseline peak; skipped above ``--ref-max-blocks`` where it sits at
  its 180 s limit;
* ``speedup``: reference seconds / compat seconds (same model, same numbers) and reference / sacplan.

sacplan and compat cells show the median of ``--repeat`` runs (wall seconds, including PuLP model building
and CBC's process start); the reference runs once.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
import warnings

from sacplan.errors import InfeasibleBudgetError
from sacplan.solver import baseline_peak, sac_milp, solve
from sacplan.testing.llama_tree import llama_tree
from sacplan.units import GiB


def ref_baseline(graph, world_size: int = 1) -> float:
    """The reference model's no-checkpointing peak: max_i (P_1 + TG_i)/world_size + AG_i + TA_i (bytes)."""
    p1 = graph.nodes[0]["param_per_module"]
    return max(
        (p1 + n["grad_total"]) / world_size + n["act_grad_per_module"] + n["act_total"] for n in graph.nodes
    )


def run_reference(info, budget_frac: float, world_size: int = 1):
    """PyTorch's sac_milp on the tree's ModuleInfo; returns (seconds, objective ms or None, budget GiB)."""
    from torch.distributed._tools import sac_ilp
    from torch.distributed._tools.ilp_utils import parse_module_info

    logging.getLogger(sac_ilp.__name__).setLevel(logging.CRITICAL)
    t0 = time.perf_counter()
    graph = parse_module_info(copy.deepcopy(info))
    budget = ref_baseline(graph, world_size) * budget_frac / GiB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dec, ms, pk = sac_ilp.sac_milp(graph, budget, world_size=world_size)
    return time.perf_counter() - t0, (None if pk == -1 else ms), budget


def run_compat(info, budget_gib: float, solver: str, world_size: int = 1):
    from torch.distributed._tools.ilp_utils import parse_module_info

    t0 = time.perf_counter()
    graph = parse_module_info(copy.deepcopy(info))
    dec, ms, pk = sac_milp(graph, budget_gib, world_size=world_size, solver=solver)
    return time.perf_counter() - t0, (None if pk == -1 else ms)


def bench_tree(name: str, tree, fracs, args, rows, world_size: int | None = None):
    base = baseline_peak(tree, world_size=world_size)
    info = tree.to_torch_module_info() if args.reference else None
    n_blocks = sum(1 for n in tree.nodes if "Block" in n.stats.module_type)
    for frac in fracs:
        row = {"tree": name, "blocks": n_blocks, "nodes": len(tree), "budget": frac}
        runs = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = solve(
                        tree, int(base * frac), world_size=world_size, solver=args.solver, time_limit_s=args.time_limit
                    )
                runs.append(
                    dict(
                        build=plan.build_s, solve=plan.solve_s, total=time.perf_counter() - t0, status=plan.status,
                        gap=plan.gap, obj=plan.objective_ms, realised=plan.recompute_ms,
                    )
                )
            except InfeasibleBudgetError as e:
                runs.append(dict(total=time.perf_counter() - t0, status=f"infeas>={e.min_feasible_bytes / base:.0%}"))
        row.update(sorted(runs, key=lambda r: r["total"])[len(runs) // 2])  # the median run
        if args.reference:
            import torch.distributed._tools.ilp_utils  # noqa: F401 - fail early when torch is absent

            # the reference divides (params + grads) by world_size relative to the tree's own numbers
            rws = max(1, (world_size or tree.stats.world_size) // max(1, tree.stats.world_size))

            if n_blocks <= args.ref_max_blocks:
                ref_s, ref_obj, ref_budget = run_reference(info, frac, rws)
                row.update(ref_s=ref_s, ref_obj=ref_obj)
            else:
                from torch.distributed._tools.ilp_utils import parse_module_info

                ref_budget = ref_baseline(parse_module_info(copy.deepcopy(info)), rws) * frac / GiB
            compat = sorted(run_compat(info, ref_budget, args.solver, rws) for _ in range(args.repeat))
            c_s, c_obj = compat[len(compat) // 2]
            row.update(compat_s=c_s, compat_obj=c_obj)
        rows.append(row)
        print_row(row, flush=True)


HEADER = (
    f"{'tree':<14}{'blocks':>6}{'nodes':>6}{'budget':>7} | {'build s':>8}{'solve s':>8}{'total s':>8} "
    f"{'status':<12}{'gap':>9}{'obj ms':>10} | {'compat s':>9}{'obj ms':>10} | {'ref s':>8}{'obj ms':>10} | "
    f"{'ref/compat':>10}{'ref/sacplan':>12}"
)


def _f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else format("-" if v is None else str(v), ">" + fmt.split(".")[0].lstrip("<>"))


def print_row(r, flush=False):
    ratio_c = r["ref_s"] / r["compat_s"] if "ref_s" in r and r.get("compat_s") else None
    ratio_s = r["ref_s"] / r["total"] if "ref_s" in r and r.get("total") else None
    print(
        f"{r['tree']:<14}{r['blocks']:>6}{r['nodes']:>6}{r['budget']:>7.0%} | "
        f"{_f(r.get('build'), '8.3f')}{_f(r.get('solve'), '8.3f')}{_f(r.get('total'), '8.3f')} "
        f"{str(r.get('status'))[:12]:<12}{_f(r.get('gap'), '9.1e')}{_f(r.get('obj'), '10.3f')} | "
        f"{_f(r.get('compat_s'), '9.3f')}{_f(r.get('compat_obj'), '10.3f')} | "
        f"{_f(r.get('ref_s'), '8.2f')}{_f(r.get('ref_obj'), '10.3f')} | "
        f"{_f(ratio_c, '10.1f')}{_f(ratio_s, '12.1f')}",
        flush=flush,
    )


def collected_trees(sizes):
    """Real trees from ``sacplan.collect`` of the Llama-7B shape (hidden 4096, seq 4096, batch 1, bf16, AdamW,
    H100 target) with ``n`` layers; skipped gracefully when ``sacplan.collect`` is unavailable."""
    try:
        import torch

        from sacplan.collector import collect
        from sacplan.models import get_model
        from sacplan.models.llama import LLAMA_PRESETS, example_tokens, next_token_loss
        from sacplan.tree import ModuleTree
    except Exception as e:  # pragma: no cover - depends on the checkout
        print(f"# --collected skipped: sacplan.collect is not available ({type(e).__name__}: {e})")
        return
    preset = get_model("llama-7b")
    vocab = LLAMA_PRESETS["llama-7b"].vocab_size
    for n in sizes:
        try:
            t0 = time.perf_counter()
            stats = collect(
                lambda: preset.build(dtype=torch.bfloat16, n_layers=n),
                lambda: (example_tokens(1, 4096, vocab),),
                loss_fn=lambda out, inputs: next_token_loss(out, inputs[0]),
                device="h100",
                model_name=f"llama-7b-shape-{n}L",
            )
            print(f"# collected llama-7b-shape-{n}L in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # pragma: no cover - depends on collect's state
            print(f"# --collected: collect() failed for {n} layers ({type(e).__name__}: {e}); skipped")
            return
        yield f"collected-{n}L", ModuleTree(stats)


#: issue 14's cells: (label, preset, overrides, batch, seq, world size, what: a budget or "sweep")
ISSUE14_CELLS = (
    ("llama-small x48 @ 0.5GiB", "llama-small", {"n_layers": 48}, None, None, None, "0.5GiB"),
    ("README default plan (80% of H100)", None, None, None, None, None, "80%"),
    ("README default sweep (8 points)", None, None, None, None, None, "sweep"),
    ("llama-8b b2 s8192 ws8 @ 60GiB", "llama-8b", None, 2, 8192, 8, "60GiB"),
)


def issue14_tree(preset, overrides, batch, seq, world_size):
    """The tree ``sacplan plan/sweep`` solves for these arguments (preset None: the CLI's default job)."""
    from sacplan import cli
    from sacplan.devices import get_device
    from sacplan.distributed import shard_stats
    from sacplan.tree import ModuleTree

    spec = cli.load_model_spec(preset or cli.DEFAULT_MODEL, layers=(overrides or {}).get("n_layers"))
    if preset is None:  # the CLI's default job: the default model at its preset's default shape
        batch, seq = spec.preset.default_batch, spec.preset.default_seq
    stats = spec.collect(get_device(cli.DEFAULT_DEVICE), dtype=cli.DEFAULT_DTYPE, batch=batch, seq=seq, progress=None)
    if world_size:
        stats = shard_stats(stats, world_size, fsdp_units="each block", mode="fsdp")
    return ModuleTree(stats)


def issue14(args) -> None:
    """Wall seconds of issue 14's cells (collection excluded), per solver, under ``--time-limit`` (default 60 s),
    with the tree DP (``solve``'s default) and without it (``--issue14-dp``), and whether the plans agree."""
    from sacplan.budget_sweep import sweep
    from sacplan.solver import SolverOptions

    limit = args.time_limit or 60.0
    modes = args.issue14_dp.split(",")

    def agree(key, first) -> str:  # sweeps: rows' (budget, ms, peak); plans: (ms, peak, decisions)
        if key is first:
            return ""
        return "same" if key == first else "equal cost and peak" if key[:2] == first[:2] else "DIFFERENT"

    print(f"{'cell':34s} {'solver':6s} {'DP':4s} {'wall s':>7s}  status       {'gap':>9s}  {'recompute ms':>12s}  "
          "proved by / same plan as the first mode")
    for label, preset, ov, batch, seq, ws, what in ISSUE14_CELLS:
        tree = issue14_tree(preset, ov, batch, seq, ws)
        for solver in args.issue14_solvers.split(","):
            first = None
            for mode in modes:
                t0 = time.perf_counter()
                opts = SolverOptions(solver=solver, time_limit_s=limit, tree_dp=mode != "off")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if what == "sweep":
                        res = sweep(tree, points=8, options=opts)
                        status = ",".join(sorted({r.status for r in res.rows}))
                        gap = max((r.gap for r in res.rows if r.gap == r.gap), default=0.0)
                        ms = float("nan")
                        key = [(r.budget_bytes, round(r.recompute_ms, 9), r.predicted_peak_bytes) for r in res.rows]
                        how = ""
                    else:
                        p = solve(tree, what, options=opts)
                        status, gap, ms = p.status, p.gap, p.recompute_ms
                        key = (round(p.recompute_ms, 9), p.predicted_peak_bytes, p.decisions)
                        how = p.meta.get("proved_by", "")
                first = key if first is None else first
                print(f"{label:34s} {solver:6s} {mode:4s} {time.perf_counter() - t0:7.1f}  {status:12s} {gap:9.2e}  "
                      f"{ms:12.4f}  {how} {agree(key, first)}",
                      flush=True)


def _hf_build(cls_name: str, cfg_name: str, attn: str = "sdpa", **cfg):
    """A factory of ``transformers.<cls_name>(<cfg_name>(**cfg))`` with attention implementation ``attn``."""

    def build():
        import transformers

        c = getattr(transformers, cfg_name)(**cfg)
        c._attn_implementation = attn
        return getattr(transformers, cls_name)(c)

    return build


def user_trees() -> dict[str, dict]:
    """Issue 26's trees: name -> build (factory), inputs (factory), loss (model, args) -> scalar."""
    import torch

    def lm(vocab: int, batch: int, seq: int) -> dict:
        return dict(inputs=lambda: (torch.randint(0, vocab, (batch, seq)),),
                    loss=lambda m, a: m(input_ids=a[0], labels=a[0]).loss)

    def image(batch: int, size: int = 224, classes: int = 1000, hf: bool = False) -> dict:
        def loss(m, a):
            if hf:
                return m(pixel_values=a[0], labels=a[1]).loss
            return torch.nn.functional.cross_entropy(m(a[0]).float(), a[1])

        return dict(inputs=lambda: (torch.randn(batch, 3, size, size, dtype=torch.bfloat16),
                                    torch.randint(0, classes, (batch,))), loss=loss)

    def timm_model(name: str, **kw):
        def build():
            import timm

            return timm.create_model(name, pretrained=False, **kw)

        return build

    def nn_transformer():
        return torch.nn.Transformer(d_model=1024, nhead=16, num_encoder_layers=12, num_decoder_layers=12,
                                    dim_feedforward=4096, batch_first=True)

    seq_pair = dict(inputs=lambda: (torch.randn(8, 512, 1024, dtype=torch.bfloat16),
                                    torch.randn(8, 512, 1024, dtype=torch.bfloat16)),
                    loss=lambda m, a: m(a[0], a[1]).float().pow(2).mean())
    return {
        "bert-large b8 s512": dict(build=_hf_build("BertForMaskedLM", "BertConfig", hidden_size=1024,
                                                   num_hidden_layers=24, num_attention_heads=16,
                                                   intermediate_size=4096), **lm(30522, 8, 512)),
        "vit-l (timm) b64": dict(build=timm_model("vit_large_patch16_224"), **image(64)),
        "convnext-base (timm) b64": dict(build=timm_model("convnext_base"), **image(64)),
        "gemma-2-2b s8192": dict(build=_hf_build("Gemma2ForCausalLM", "Gemma2Config", hidden_size=2304,
                                                 intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                                                 num_key_value_heads=4, head_dim=256, vocab_size=256000,
                                                 use_cache=False, attn="eager"),  # no SDPA for Gemma-2 in transformers
                                **lm(256000, 1, 8192)),
        "gpt2-xl b4 s1024": dict(build=_hf_build("GPT2LMHeadModel", "GPT2Config", n_embd=1600, n_layer=48, n_head=25,
                                                 n_positions=1024, use_cache=False), **lm(50257, 4, 1024)),
        "vit-l (transformers) b64": dict(build=_hf_build("ViTForImageClassification", "ViTConfig", hidden_size=1024,
                                                         num_hidden_layers=24, num_attention_heads=16,
                                                         intermediate_size=4096, num_labels=1000),
                                         **image(64, hf=True)),
        "nn.Transformer 12+12 d1024 b8 s512": dict(build=nn_transformer, **seq_pair),
        "t5-large b8 s512": dict(build=_hf_build("T5ForConditionalGeneration", "T5Config", d_model=1024, d_ff=4096,
                                                 d_kv=64, num_layers=24, num_heads=16, use_cache=False,
                                                 decoder_start_token_id=0), **lm(32128, 8, 512)),
        "mobilenetv3 (timm) b8 64px": dict(build=timm_model("mobilenetv3_large_100"), **image(8, 64)),
        "convnext-atto (timm) b8 64px": dict(build=timm_model("convnext_atto"), **image(8, 64)),
    }


def _user_tree(name: str, spec: dict, cache: str | None):
    """The collected tree of one user model (from ``cache`` when there; pickled there after collecting)."""
    import pickle

    import torch

    from sacplan.collector import collect
    from sacplan.tree import ModuleTree

    path = None if cache is None else os.path.join(cache, name.replace(" ", "_").replace("/", "_") + ".pkl")
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)

    def step(model, args, opt):
        spec["loss"](model, args).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    stats = collect(spec["build"], spec["inputs"], device="h100", dtype=torch.bfloat16, train_step=step,
                    model_name=name)
    tree = ModuleTree(stats)
    if path:
        os.makedirs(cache, exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(tree, f)
        os.replace(path + ".tmp", path)
    return tree


def user_trees_table(args) -> None:
    """Issue 26's table: each user tree at its midway budget with the default settings, and side by side main's
    path (``SolverOptions(chain_dp=False)``: the tree DP, then the MILP), in one run."""
    from sacplan.solver import SolverOptions, min_feasible_budget

    conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "conformance")
    sys.path.insert(0, conf)
    import conftest  # noqa: F401  (torchvision's op schemas before timm imports torchvision)

    warnings.simplefilter("ignore")
    print(f"# python {sys.version.split()[0]}; {os.cpu_count()} CPUs; os.getloadavg() {os.getloadavg()[0]:.1f} at start")
    print("| tree | candidates | binding events | default: s | status / gap | proved by | DP work units | "
          "main (chain_dp=False): s | status / gap | proved by | nodes | stopped by | same plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, spec in user_trees().items():
        if args.only and not any(o in name for o in args.only):
            continue
        try:
            tree = _user_tree(name, spec, args.cache)
            lo, hi = min_feasible_budget(tree), baseline_peak(tree)
            budget = f"{int(lo + (hi - lo) // 2)}B"
            cells = []
            for opts in (SolverOptions(), SolverOptions(chain_dp=False)) if args.old else (SolverOptions(),):
                t0 = time.perf_counter()
                p = solve(tree, budget, options=opts)
                cells.append((time.perf_counter() - t0, p))
        except Exception as e:  # the table says which trees fail and why
            print(f"| {name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]} |", flush=True)
            continue
        print(_user_row(name, cells), flush=True)


def _user_row(name: str, cells: list) -> str:
    """One row of :func:`user_trees_table`: the default solve and, when run, main's path."""
    s1, p1 = cells[0]
    dp = p1.meta.get("tree_dp") if isinstance(p1.meta.get("tree_dp"), dict) else {}
    row = (f"| {name} | {p1.meta.get('candidates')} | {dp.get('binding_events', '-')} | {s1:.1f} | "
           f"{p1.status} {p1.gap:.2%} | {p1.meta.get('proved_by')} | "
           f"{dp.get('work', '-') if p1.meta.get('proved_by') == 'chain-dp' else p1.meta.get('chain_dp', '-')} |")
    if len(cells) < 2:
        return row + " - | - | - | - | - | - |"
    s2, p2 = cells[1]
    same = (p1.to_dict(timings=False)["decisions"] == p2.to_dict(timings=False)["decisions"])
    return row + (f" {s2:.1f} | {p2.status} {p2.gap:.2%} | {p2.meta.get('proved_by')} | {p2.meta.get('work_nodes')} | "
                  f"{', '.join(p2.meta.get('stopped_by', [])) or '-'} | "
                  f"{'yes' if same else f'no ({p1.objective_ms:.4f} vs {p2.objective_ms:.4f} ms)'} |")


#: issue 26.2's tiny CNNs (170-210 modules; the 2 s target), as tests/conformance collects them for the CPU
TINY_CNNS = ("tv-mobilenet-v3", "timm-efficientnet", "timm-efficientformer")


def _tiny_cnn(name: str, cache: str | None):
    """``(tree, budgets)`` of one conformance model, as tests/conformance's ``_setup`` collects it (from ``cache``
    when there; pickled there after collecting)."""
    import pickle

    path = None if cache is None else os.path.join(cache, f"conformance-{name}.pkl")
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    import conformance_tiny  # benchmarks/ is on sys.path: this script's folder

    _, tree, budgets = conformance_tiny._suite()._setup(name)
    if path:
        os.makedirs(cache, exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            pickle.dump((tree, dict(budgets)), f)
        os.replace(path + ".tmp", path)
    return tree, budgets


def tiny_cnns_table(args) -> None:
    """Issue 26.2's table: the tiny conformance CNNs at their three budgets with the default settings (the
    median of ``--repeat`` solves): wall seconds, status, who proved it, the chain DP's work units (the
    deterministic figure), recompute ms, and the host's load average before each row."""
    from sacplan.units import Bytes

    warnings.simplefilter("ignore")
    print(f"# python {sys.version.split()[0]}; {os.cpu_count()} CPUs; median of {args.repeat}")
    print("| model (modules) | budget | s (median) | all runs s | status / gap | proved by | DP work units | "
          "recompute ms | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in TINY_CNNS:
        if args.only and not any(o in name for o in args.only):
            continue
        tree, budgets = _tiny_cnn(name, args.cache)
        for budget, at in budgets.items():
            if args.budgets_named and budget not in args.budgets_named:
                continue
            load = os.getloadavg()[0]
            runs = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                p = solve(tree, Bytes(int(at)))
                runs.append((time.perf_counter() - t0, p))
            s, p = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            dp = p.meta.get("tree_dp") if isinstance(p.meta.get("tree_dp"), dict) else {}
            print(f"| {name} ({len(tree)}) | {budget} | {s:.2f} | {' '.join(f'{r[0]:.2f}' for r in runs)} | "
                  f"{p.status} {p.gap:.2%} | {p.meta.get('proved_by')} | {dp.get('work', '-')} | "
                  f"{p.recompute_ms:.9g} | {load:.1f} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="2,8,32,80,128", help="comma-separated block counts")
    ap.add_argument("--budgets", default="0.9,0.7,0.5", help="fractions of the no-checkpointing peak")
    ap.add_argument("--solver", default="cbc", choices=["cbc", "highs"])
    ap.add_argument("--time-limit", type=float, default=None, help="sacplan time limit (s)")
    ap.add_argument("--ref-max-blocks", type=int, default=16, help="run PyTorch's reference up to this many blocks")
    ap.add_argument("--no-reference", dest="reference", action="store_false", help="skip the PyTorch columns")
    ap.add_argument("--collected", action="store_true", help="also benchmark trees from sacplan.collect")
    ap.add_argument("--repeat", type=int, default=3, help="sacplan runs per cell (the median is shown)")
    ap.add_argument("--collected-layers", default="2,8,32", help="layer counts of the collected trees")
    ap.add_argument(
        "--collected-world-size", type=int, default=8,
        help="plan collected trees for this many FSDP ranks (at 1 rank AdamW state dominates a 7B-shaped model)",
    )
    ap.add_argument("--user-trees", action="store_true", help="only issue 26's third-party trees (see user_trees)")
    ap.add_argument("--only", nargs="*", help="with --user-trees / --tiny-cnns: trees whose name contains one of these")
    ap.add_argument("--cache", default=None, help="with --user-trees / --tiny-cnns: a folder to keep collected trees in")
    ap.add_argument("--no-old", dest="old", action="store_false",
                    help="with --user-trees: skip main's path (SolverOptions(chain_dp=False)) beside the default")
    ap.add_argument("--tiny-cnns", action="store_true",
                    help="only issue 26.2's tiny conformance CNNs at three budgets (see TINY_CNNS; --only, --cache)")
    ap.add_argument("--budget-names", dest="budgets_named", nargs="*",
                    help="with --tiny-cnns: only these budgets (near-min, midway, near-peak)")
    ap.add_argument("--issue14", action="store_true", help="only issue 14's cells (see ISSUE14_CELLS)")
    ap.add_argument("--issue14-solvers", default="highs,cbc", help="solvers for --issue14")
    ap.add_argument("--issue14-dp", default="on,off", help="--issue14 with the tree DP (on) and/or without it (off)")
    args = ap.parse_args(argv)
    if args.user_trees:
        user_trees_table(args)
        return 0
    if args.tiny_cnns:
        tiny_cnns_table(args)
        return 0
    if args.issue14:
        issue14(args)
        return 0
    blocks = [int(x) for x in args.blocks.split(",") if x]
    fracs = [float(x) for x in args.budgets.split(",") if x]
    print(f"# solver={args.solver}; python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
    print(HEADER)
    rows: list[dict] = []
    solve(llama_tree(2), 0.99 * baseline_peak(llama_tree(2)), solver=args.solver)  # warm-up: imports, caches
    for n in blocks:
        bench_tree(f"llama7b-{n}L", llama_tree(n), fracs, args, rows)
    if args.collected:
        sizes = [int(x) for x in args.collected_layers.split(",") if x]
        for name, tree in collected_trees(sizes):
            bench_tree(name, tree, fracs, args, rows, world_size=args.collected_world_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
