"""Per-rank validation of 2-D / mixed-precision plans on real gloo ranks (CPU): a markdown table.

For each layout (TP 2; FSDP 2 x TP 2 on 4 ranks; FSDP 2 with bf16 mixed precision) and two prediction paths:

* ``mesh``: ``collect(mesh=..., parallelize=parallelize_llama)`` on PyTorch's fake process group (rank 0);
* ``simulated`` (FSDP-only layouts): ``shard_stats(collect(dtype=bf16), 2, mp_policy=..., fsdp_units=[blocks,
  (norm, output)])`` with no process group.

a plan is solved halfway between the minimum feasible budget and the no-checkpointing peak; every real rank
runs the same ``parallelize_llama`` on a gloo ``DeviceMesh`` (spawned, FileStore) without and with the plan
and measures its step with sacplan's StepRecorder (DTensor local shards). Columns: predicted and measured
per-rank peak (max over ranks), error, gradients bitwise with vs without the plan, max |grad - single-process
reference|. Run from the repository root::

    python3 benchmarks/mesh_validation.py            # ~2 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed import _mp  # noqa: E402
from tests.distributed import test_mesh as tm  # noqa: E402
from tests.distributed import test_mixed_precision as tmp  # noqa: E402


def _row(layout: str, path: str, results: list[dict], plan, base: int) -> str:
    plain = max(r["plain_peak"] for r in results)
    planned = max(r["planned_peak"] for r in results)
    e0, e1 = (plain - base) / plain, (planned - plan.predicted_peak_bytes) / planned
    bitwise = all(r["bitwise"] for r in results)
    ref = max(r["max_ref_diff"] for r in results)
    return (f"| {layout} | {path} | {len(results)} | {base / 2**20:.3f} | {plain / 2**20:.3f} | {e0:+.2%} | "
            f"{plan.predicted_peak_bytes / 2**20:.3f} | {planned / 2**20:.3f} | {e1:+.2%} | "
            f"{'yes' if bitwise else 'NO'} | {ref:.1e} |")


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    t0 = time.perf_counter()
    rows = []
    for layout in ("tp2", "fsdp2xtp2", "fsdp2-bf16"):
        stats, plan, base = tm.predicted(layout)
        dp, tp, _ = tm.LAYOUTS[layout]
        with tempfile.TemporaryDirectory() as d:
            res = _mp.spawn(tm.worker, dp * tp, Path(d), layout, plan.to_dict())
        rows.append(_row(f"{layout} (dp_shard {dp} x tp {tp})", "mesh (fake PG)", res, plan, base))
    per_rank = tmp.per_rank_stats("grouped")
    plan, base = tmp.plan_for(per_rank)
    with tempfile.TemporaryDirectory() as d:
        res = _mp.spawn(tmp.worker, 2, Path(d), "grouped", "after", plan.to_dict())
    rows.append(_row("fsdp2-bf16, [norm, output] group", "simulated (shard_stats, mp_policy)", res, plan, base))
    print("| layout | prediction | ranks | predicted no-AC MiB | measured MiB | error | predicted with plan MiB | "
          "measured MiB | error | grads bitwise with plan | max abs grad - reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
