"""How collection time scales with depth: sacplan's ``collect`` vs PyTorch's ``MemTracker`` alone.

A Llama-7B-shaped model (hidden 4096, 32 heads, SwiGLU 11008, vocab 32000; sequence 4096, batch 1, bf16,
AdamW foreach) at several depths. For each depth, in its own subprocess (so each has its own peak RSS):

(a) ``sacplan``: the whole ``collect(...)`` for an H100 -- memory, runtime and SAC statistics, trade-off
    fits included -- from a factory (built on meta);
(b) ``memtracker``: ``torch.distributed._tools.mem_tracker.MemTracker`` alone on CPU fake tensors of the
    same model (built on meta, ``to_empty`` in ``FakeTensorMode``), tracking one forward / backward /
    AdamW step / zero_grad, with ``track_external(model, optimizer)``. It measures memory only (no
    runtime, no SAC statistics) and exact host sizes (CPU: no 512-byte rounding).

Seconds are wall time from building the model on meta to having the result; module imports are excluded
for both (the one-off import time of torch._dynamo that a fresh process's first collect() pays is
printed under the table).
Peak GiB: sacplan's predicted whole-step peak on the H100 vs MemTracker's peak "Total". They differ where
the backward is the peak (few layers): MemTracker tracks a single first step, whose forward/backward runs
before AdamW has created its state; sacplan records a steady-state step (state already allocated).

    python benchmarks/collect_scaling.py --layers 4 16 32 80 --skip-reference-above 80
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from sacplan.units import GiB

SEQ, BATCH = 4096, 1


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _factory(n_layers: int):
    import torch

    from sacplan.models import get_model

    preset = get_model("llama-7b")
    return lambda: preset.build(dtype=torch.bfloat16, n_layers=n_layers)


def run_sacplan(n_layers: int) -> dict:
    from sacplan.collector import collect
    from sacplan.models.llama import LLAMA_PRESETS, example_tokens, next_token_loss

    vocab = LLAMA_PRESETS["llama-7b"].vocab_size
    factory = _factory(n_layers)
    # One-off import cost of a fresh process, paid on the first collect() only: FakeTensorMode imports
    # torch._dynamo. MemTracker's module imports it too.
    t_imp = time.perf_counter()
    import torch._dynamo  # noqa: F401

    import_s = time.perf_counter() - t_imp
    t0 = time.perf_counter()
    stats = collect(
        factory,
        lambda: (example_tokens(BATCH, SEQ, vocab),),
        loss_fn=lambda out, inputs: next_token_loss(out, inputs[0]),
        device="h100",
        model_name=f"llama-7b-shape-{n_layers}L",
    )
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "import_s": import_s,
        "peak_gib": stats.peak_bytes / GiB,
        "peak_phase": stats.peak_phase,
        "modules": len(stats.modules),
        "param_gib": stats.param_bytes / GiB,
        "rss_gib": _peak_rss_gib(),
    }


def run_memtracker(n_layers: int) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from sacplan.models.llama import LLAMA_PRESETS, example_tokens, next_token_loss

    vocab = LLAMA_PRESETS["llama-7b"].vocab_size
    factory = _factory(n_layers)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = factory()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        model.train()
        tokens = example_tokens(BATCH, SEQ, vocab)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        mem_tracker = MemTracker()
        mem_tracker.track_external(model, optimizer)
        with mem_tracker:
            loss = next_token_loss(model(tokens), tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = mem_tracker.get_tracker_snapshot("peak")
    seconds = time.perf_counter() - t0
    total = max((snap.get("Total", 0) for snap in peak.values()), default=0)
    return {"seconds": seconds, "peak_gib": total / GiB, "rss_gib": _peak_rss_gib()}


def _child(tool: str, n_layers: int, timeout: float) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, "--n-layers", str(n_layers)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        print(f"  {tool} at {n_layers} layers: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    if out.returncode != 0:
        print(f"  {tool} at {n_layers} layers failed:\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32, 80])
    ap.add_argument("--skip-reference-above", type=int, default=None, metavar="N",
                    help="do not run MemTracker for depths above N layers (it slows down superlinearly)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--worker", choices=["sacplan", "memtracker"], help=argparse.SUPPRESS)
    ap.add_argument("--n-layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        result = run_sacplan(args.n_layers) if args.worker == "sacplan" else run_memtracker(args.n_layers)
        print(json.dumps(result))
        return 0

    import torch

    print(f"Llama-7B shape (dim 4096, seq {SEQ}, batch {BATCH}, bf16, AdamW foreach); torch {torch.__version__}; "
          f"each run in its own process")
    rows = []
    for n in args.layers:
        sac = _child("sacplan", n, args.timeout)
        skip = args.skip_reference_above is not None and n > args.skip_reference_above
        ref = None if skip else _child("memtracker", n, args.timeout)
        rows.append({"layers": n, "sacplan": sac, "memtracker": ref})
        print(f"  {n} layers done: sacplan {sac and round(sac['seconds'], 2)} s, "
              f"MemTracker {ref and round(ref['seconds'], 2)} s", file=sys.stderr, flush=True)

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    head = (f"{'layers':>6} | {'sacplan s':>9} | {'MemTracker s':>12} | {'ratio':>6} | {'sacplan RSS GiB':>15} | "
            f"{'MemTracker RSS GiB':>18} | {'sacplan peak GiB (H100)':>23} | {'MemTracker peak GiB (CPU)':>25}")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, m = r["sacplan"], r["memtracker"]
        ratio = m["seconds"] / s["seconds"] if s and m else None
        print(
            f"{r['layers']:>6} | {f(s and s['seconds'], '9.2f')} | {f(m and m['seconds'], '12.2f')} | "
            f"{f(ratio, '5.1f') + ('x' if ratio else ''):>6} | {f(s and s['rss_gib'], '15.2f')} | "
            f"{f(m and m['rss_gib'], '18.2f')} | {f(s and s['peak_gib'], '23.2f')} | {f(m and m['peak_gib'], '25.2f')}"
        )
    timed = [(r["layers"], r["sacplan"]["seconds"]) for r in rows if r["sacplan"]]
    if len(timed) >= 2:
        (l0, t0), (l1, t1) = timed[0], timed[-1]
        print(f"sacplan seconds per layer between {l0} and {l1} layers: {(t1 - t0) / (l1 - l0):.3f} "
              f"(time/layers: {', '.join(f'{l}: {t / l:.3f}' for l, t in timed)})")
    imports = [r["sacplan"]["import_s"] for r in rows if r["sacplan"]]
    if imports:
        print(f"(not in the times above: one-off import of torch._dynamo in a fresh process, "
              f"{min(imports):.1f}-{max(imports):.1f} s, paid by the first collect() only)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
