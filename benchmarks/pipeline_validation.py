"""Per-stage plans under pipeline parallelism, proved on real CPU steps (gloo): the RESULTS.md table.

For each schedule (1F1B, GPipe, Interleaved1F1B) at 2 and 4 pipeline ranks: collect every rank on fakes for the
CPU spec (``sacplan.collect_pipeline``), plan each rank 40% of the way from its smallest feasible budget to its
unplanned peak (``solve_pipeline``: one plan file for every stage), then run ``torch.distributed.pipelining``'s
PipelineStage + schedule on spawned gloo ranks without and with the plan (``validate_pipeline``: each rank applies
the pipeline plan stage by stage) and print, per rank, predicted vs measured peak (sacplan's StepRecorder on the
real tensors, the CPU RNG states checkpoint stashes included) and whether the gradients are bitwise equal.

Stages: ``tests/pipeline/_stages.py`` (pre-norm MLP blocks on (rows, 16, 32) activations), ``--blocks`` per stage,
``--rows`` rows per microbatch. Run from the repository root::

    python3 benchmarks/pipeline_validation.py              # all six cases (minutes on 2 busy cores)
    python3 benchmarks/pipeline_validation.py --cases 1F1B:2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ("1F1B:2", "GPipe:2", "Interleaved1F1B:2", "1F1B:4", "GPipe:4", "Interleaved1F1B:4")


def run_case(schedule: str, ranks: int, rows: int, blocks: int) -> list[str]:
    from sacplan.pipeline import collect_pipeline, solve_pipeline, validate_pipeline
    from sacplan.solver import min_feasible_budget
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes
    from tests.pipeline._stages import batch, stage_fns

    per_rank = 2 if schedule.lower().startswith("interleaved") else 1
    mb = 2 * ranks
    fns, x = stage_fns(ranks * per_rank, blocks=blocks), batch(rows * mb)
    t0 = time.perf_counter()
    stats = collect_pipeline(fns, x, schedule=schedule, microbatches=mb, num_ranks=ranks, device="cpu")
    budgets = []
    for s in stats:
        lo = min_feasible_budget(ModuleTree(s))
        budgets.append(Bytes(int(lo + 0.4 * (s.peak_bytes - lo))))
    plan = solve_pipeline(stats, budgets)
    t1 = time.perf_counter()
    reports = validate_pipeline(fns, x, stats, plan)
    t2 = time.perf_counter()
    rows_out = []
    for r, p in zip(reports, plan.plans):
        mods = ", ".join(d.fqn for d in p.decisions) or "none"
        rows_out.append(
            f"| {schedule} | {ranks} | {mb} | {r.rank} | {','.join(map(str, r.stages))} | {r.predicted_baseline:,} | "
            f"{r.measured_baseline:,} | {r.baseline_error:+.3%} | {mods} | {r.predicted_plan:,} | {r.measured_plan:,} | "
            f"{r.plan_error:+.3%} | {'yes' if r.grads_equal else 'NO'} |"
        )
    print(f"  {schedule} p={ranks}: collect+solve {t1 - t0:.1f} s, real steps {t2 - t1:.1f} s", file=sys.stderr)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), help="SCHEDULE:RANKS, e.g. 1F1B:4")
    ap.add_argument("--rows", type=int, default=8, help="rows per microbatch")
    ap.add_argument("--blocks", type=int, default=2, help="MLP blocks per stage")
    a = ap.parse_args()
    print("| schedule | ranks | microbatches | rank | stages | predicted, no plan (B) | measured | error | "
          "plan (checkpointed) | predicted, plan (B) | measured | error | grads bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in a.cases:
        sched, ranks = case.split(":")
        for line in run_case(sched, int(ranks), a.rows, a.blocks):
            print(line, flush=True)


if __name__ == "__main__":
    main()
