"""Helpers for the multi-process tests: spawn gloo ranks rendezvousing on a FileStore, collect their reports.

Rendezvous is a FileStore in the test's own temporary folder (:mod:`sacplan.gloo_ranks`, which these wrap with
the tests' assertions).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable


from sacplan.gloo_ranks import join_gloo, report_and_exit, spawn_ranks


def init(rank: int, ws: int, rdzv: str) -> None:
    """Join the gloo group (one thread per rank, as the tests assume)."""
    join_gloo(rank, ws, rdzv)


def guarded(rank: int, q: Any, body: Callable[[], dict]) -> None:
    """Run ``body`` and put its report (or the full traceback) on ``q``; always leave the process group."""
    report_and_exit(rank, q, body)


def spawn(worker: Callable[..., None], ws: int, tmp_path: Path, *args: Any) -> list[dict]:
    """Spawn ``worker(rank, ws, rdzv_file, *args, q)`` on ``ws`` processes; the ranks' reports, by rank.

    Every rank's report is printed (pytest shows it on failure) before an error fails the test.
    """
    out, join_error = spawn_ranks(worker, ws, tmp_path / "rdzv", *args)
    for r in out:
        figures = {k: v for k, v in r.items() if k not in ("rank", "error")}
        print(f"rank {r['rank']}: " + json.dumps(figures, default=str))
    errors = [f"rank {r['rank']}: {r['error']}" for r in out if "error" in r]
    assert not errors, "\n".join(errors)
    assert join_error is None, f"{join_error}"
    assert [r["rank"] for r in out] == list(range(ws)), f"only ranks {[r['rank'] for r in out]} reported"
    return out


def traced_cpu_memory(fn: Callable[[], None], trace_dir: Path) -> dict[str, int]:
    """``fn()`` under ``torch.profiler`` (CPU memory events); what the caller's thread allocated, in bytes.

    Like :func:`sacplan.collector.workspace.profiled_cpu_peak` (the thread that ran the most ops, running sum
    of its ``[memory]`` events, relative to the start), plus address bookkeeping from the exported trace:

    * ``peak``: the running sum's maximum (the profiler's peak);
    * ``end``: the running sum after ``fn`` (0 in a steady-state step if every free was seen);
    * ``unseen_free``: bytes of blocks that the caller's thread allocated and that were allocated again at
      the same address with no free recorded in between: freed on a thread the profiler does not follow.

    The profiler records allocator events only on threads it profiles. A gloo collective's ``Work``
    holds its input/output tensors; when the main thread has already dropped its own references, the
    gloo worker thread releases the last one, and that free never reaches the trace, so the running sum
    stays too high from there on (by ``unseen_free`` at least; ``end`` bounds it from above).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = trace_dir / f"trace-{os.getpid()}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    path.unlink()
    ops = Counter(e.get("tid") for e in events if e.get("cat") == "cpu_op")
    main = ops.most_common(1)[0][0] if ops else None
    mem = sorted(
        (e for e in events if e.get("name") == "[memory]" and e.get("tid") == main
         and e["args"].get("Device Type", 0) == 0),
        key=lambda e: e["ts"],
    )
    live: dict[int, int] = {}
    cur = peak = unseen = 0
    for e in mem:
        nbytes, addr = int(e["args"]["Bytes"]), int(e["args"]["Addr"])
        if nbytes > 0:
            if addr in live:
                unseen += live[addr]
            live[addr] = nbytes
        else:
            live.pop(addr, None)
        cur += nbytes
        peak = max(peak, cur)
    return dict(peak=peak, end=cur, unseen_free=unseen)
