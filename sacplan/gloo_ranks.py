"""Spawned gloo ranks on one host: join a FileStore rendezvous, report on a queue, leave cleanly.

Shared by :func:`sacplan.pipeline.validate_pipeline` and the multi-process tests. Rendezvous is
``init_method="file://<rdzv>"`` (a FileStore in a temporary folder), so no TCP port is picked, released and
possibly taken by another process before the ranks bind it.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


def join_gloo(rank: int, ws: int, rdzv: str) -> None:
    """Join the gloo group (one thread per rank)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=ws)


def report_and_exit(rank: int, q: Any, body: Callable[[], dict]) -> None:
    """Run ``body`` and put its report (or the full traceback) on ``q``; always leave the process group, then
    end the process without interpreter teardown."""
    import torch.distributed as dist

    try:
        q.put(dict(rank=rank, **body()))
    except BaseException as e:  # reported to the parent
        q.put(dict(rank=rank, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The report is on the queue: leave without running interpreter teardown, where gloo's background threads
    # sometimes end the process with "terminate called without an active exception" (SIGABRT) after the
    # work is done (seen about one run in four on 2 busy cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker: Callable[..., None], ws: int, rdzv: Path, *args: Any) -> tuple[list[dict], BaseException | None]:
    """Spawn ``worker(rank, ws, str(rdzv), *args, q)`` on ``ws`` processes; the reports put on ``q`` (sorted by
    rank) and the error of a rank that died without reporting (``None`` if none did)."""
    import torch.multiprocessing as mp

    if rdzv.exists():
        rdzv.unlink()
    q = mp.get_context("spawn").SimpleQueue()
    died: BaseException | None = None
    try:
        mp.spawn(worker, args=(ws, str(rdzv), *args, q), nprocs=ws, join=True)
    except Exception as e:  # a rank died without reporting (e.g. killed): the others' reports still say why
        died = e
    out = []
    while not q.empty():
        out.append(q.get())
    return sorted(out, key=lambda r: r["rank"]), died
