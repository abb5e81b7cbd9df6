"""Where a real CUDA step's memory differs from sacplan's tracker: a per-op allocator log on the GPU.

    python3 benchmarks/cuda_probe.py [--cases llama-1b gpt2 vit-b16 resnet50] [--out DIR]

For each case of benchmarks/cuda_validation.py (without a plan and with its saved ``tight`` plan) one real
training step runs under two dispatch modes: sacplan's tracker (:class:`StepRecorder`, this GPU's spec) and,
above it, a logger that reads ``torch.cuda.memory_allocated`` before and after every op and the op's own
transient peak (``max_memory_allocated`` after a reset at the op's start). Per op it writes: name, phase,
allocated after, transient peak above the allocation before the op, and the tracker's live total after. The
offset ``allocated − tracker`` is constant where the tracker sees everything; where it jumps, or where an
op's transient peak rises above its outputs, the GPU allocates what the tracker (and so the prediction)
does not. Summaries print; the per-op logs go to ``DIR/probe_<case>.jsonl.gz``. It also profiles the planned
llama step (kernel time against wall time) and repeats the baseline backward to measure how far the GPU's
own kernels differ run to run (the gradient tolerance validate needs).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_validation import CASES  # noqa: E402

MiB = 2**20
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # a CPU run is a smoke test of the script (allocator readings are 0)
allocated = torch.cuda.memory_allocated if CUDA else (lambda: 0)
max_allocated = torch.cuda.max_memory_allocated if CUDA else (lambda: 0)
reset_peak = torch.cuda.reset_peak_memory_stats if CUDA else (lambda: None)
sync = torch.cuda.synchronize if CUDA else (lambda: None)


class AllocLog(TorchDispatchMode):
    """Per-op CUDA allocator readings beside the tracker's live total (entered above the tracker)."""

    def __init__(self, rec: Any) -> None:
        super().__init__()
        self.rec = rec
        self.rows: list[tuple] = []
        self.seen_bw = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = allocated()
        reset_peak()
        out = func(*args, **(kwargs or {}))
        peak = max_allocated()
        after = allocated()
        in_bw = torch._C._current_graph_task_id() != -1
        self.seen_bw |= in_bw
        phase = "bw" if in_bw else ("opt" if self.seen_bw else "fw")
        self.rows.append((str(func), phase, after, peak - before, int(self.rec.total), before))
        return out


def logged_step(model: torch.nn.Module, args: Any, loss_fn: Any, opt: Any) -> tuple[list[tuple], int, int]:
    """(per-op rows, measured peak bytes, tracker peak bytes) of one step (params, grads, state registered)."""
    from sacplan.collector.calling import call_model
    from sacplan.collector.records import GRAD
    from sacplan.collector.runtime import RuntimeModel
    from sacplan.collector.tracker import StepRecorder
    from sacplan.devices import CPU, DeviceSpec
    from sacplan.stats import Phase
    from sacplan.measurement import register_state

    spec = DeviceSpec.from_current_cuda() if CUDA else CPU
    rec = StepRecorder(model, spec, RuntimeModel(spec))
    handles = [p.register_post_accumulate_grad_hook(lambda p: rec.relabel(p.grad, GRAD)) for p in model.parameters() if p.requires_grad]
    log = AllocLog(rec)
    sync()
    start = allocated()
    reset_peak()
    with rec:
        register_state(rec, model, opt, args)
        with log:
            torch.manual_seed(2)
            loss_fn(call_model(model, args), args).backward()
            opt.step()
            model.zero_grad(set_to_none=True)
        rec.close_segment(Phase.OTHER)
    for h in handles:
        h.remove()
    measured = max([r[5] + r[3] for r in log.rows] + [start])
    return log.rows, measured, int(rec.step_peak)


def summarise(name: str, rows: list[tuple], measured: int, tracker_peak: int) -> dict[str, Any]:
    """Where the real peak is, the offset (allocated − tracker) there, and the ops whose own peak rises above
    both their start and their end (memory the kernel allocates and frees inside the op)."""
    offs = [r[2] - r[4] for r in rows]
    top = [r[5] + r[3] for r in rows]  # the allocator's peak during each op
    i_peak = max(range(len(rows)), key=lambda i: top[i])
    excess = sorted(((top[i] - max(r[5], r[2]), i) for i, r in enumerate(rows)), reverse=True)[:10]
    near = [i for i in range(len(rows)) if top[i] >= top[i_peak] - 64 * MiB]
    s = {
        "case": name, "measured_peak": measured, "tracker_peak": tracker_peak, "peak_op": [i_peak, *rows[i_peak][:2]],
        "before_peak_op": rows[i_peak][5], "top_at_peak_op": top[i_peak], "tracker_at_peak_op": rows[i_peak][4],
        "offset_first": offs[0], "offset_at_peak": offs[i_peak],
        "excess": [(d, i, *rows[i][:2]) for d, i in excess if d > 0],
        "near_peak": [(i, *rows[i][:2], top[i] - top[i_peak], rows[i][3]) for i in near[:12]],
    }
    print(f"== {name}: measured {measured / MiB:.1f} MiB, tracker {tracker_peak / MiB:.1f} MiB; real peak during op {i_peak} "
          f"{rows[i_peak][0]} ({rows[i_peak][1]}): before {rows[i_peak][5] / MiB:.1f} + op peak {rows[i_peak][3] / MiB:.1f}; "
          f"tracker after it {rows[i_peak][4] / MiB:.1f}; offset first/at peak {offs[0] / MiB:.1f}/{offs[i_peak] / MiB:.1f} MiB")
    print("   in-op excess above start and end (MiB, op):", [(round(d / MiB, 2), i, n, p) for d, i, n, p in s["excess"]])
    print("   ops within 64 MiB of the peak (op, name, phase, MiB below, op peak MiB):",
          [(i, n, p, round(b / MiB, 1), round(t / MiB, 1)) for i, n, p, b, t in s["near_peak"]])
    return s


def probe_case(name: str, plans: Path, out: Path) -> None:
    from sacplan.apply import apply_plan
    from sacplan.collector import default_optimizer
    from sacplan.collector.calling import as_inputs, as_loss
    from sacplan.plan import load_plan

    case = CASES[name]()
    torch.manual_seed(0)
    model = case["build"]()
    model = (model.to(case["dtype"]) if case["dtype"] else model).to(DEV).train()
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False
    args = tree_map(lambda t: t.to(DEV) if isinstance(t, torch.Tensor) else t, as_inputs(case["inputs"]()))
    loss = as_loss(case["loss"])
    opt = default_optimizer([p for p in model.parameters() if p.requires_grad])
    from sacplan.collector.calling import call_model

    loss(call_model(model, args), args).backward()
    g1 = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    loss(call_model(model, args), args).backward()
    g2 = [p.grad for p in model.parameters() if p.grad is not None]
    nondet = max(float((a.float() - b.float()).abs().max()) for a, b in zip(g1, g2))
    print(f"{name}: same step twice, max |grad diff| {nondet:.3g} (the GPU kernels' own nondeterminism)")
    del g1, g2
    opt.step()
    model.zero_grad(set_to_none=True)
    results = []
    for label in ("none", "tight"):
        if label == "tight":
            try:
                apply_plan(model, load_plan(plans / f"{name}.tight.json"))
            except Exception as e:
                print(f"{name}: cannot apply the tight plan here: {type(e).__name__}: {e}"[:400])
                break
        if CUDA:
            torch.cuda.empty_cache()
        rows, measured, tracker_peak = logged_step(model, args, loss, opt)
        s = summarise(f"{name} {label}", rows, measured, tracker_peak)
        results.append({"summary": s, "rows": rows})
        if name.startswith("llama"):
            wall, kernels = profiled(model, args, loss, opt)
            print(f"   {name} {label}: wall {wall:.1f} ms, CUDA kernel time {kernels:.1f} ms (profiler, one step)")
    with gzip.open(out / f"probe_{name}.jsonl.gz", "wt") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")


def profiled(model: Any, args: Any, loss: Any, opt: Any) -> tuple[float, float]:
    from sacplan.collector.calling import call_model

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
    with torch.profiler.profile(activities=acts) as prof:
        sync()
        t0 = time.perf_counter()
        loss(call_model(model, args), args).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    return wall, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["gpt2", "vit-b16", "resnet50", "llama-1b"])
    ap.add_argument("--plans", default=str(Path(__file__).resolve().parent / "cuda_plans"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    for name in a.cases:
        try:
            probe_case(name, Path(a.plans), Path(a.out))
        except Exception as e:
            import traceback

            traceback.print_exc()
            print(f"{name}: probe failed: {type(e).__name__}: {e}"[:400])
        gc.collect()  # the last case's model sits in reference cycles: its memory would be the next case's offset
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
