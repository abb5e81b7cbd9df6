"""Pipeline parallelism: per-rank statistics over a schedule's step, and per-stage plans.

:func:`collect_pipeline` runs each pipeline rank's step of PyTorch's own schedule (1F1B, GPipe, Interleaved1F1B)
on fake tensors and returns one :class:`~sacplan.stats.ModelStats` per rank; ``sacplan.solve`` plans each rank on
the one memory model (:mod:`sacplan.timeline`), which counts the microbatches in flight exactly;
:func:`solve_pipeline` plans them all into one :class:`PipelinePlan` (one file, each stage's part applied with
``apply_plan(stage, plan, stage=i)``); :func:`validate_pipeline` proves the plans on real gloo steps. With
``mesh=``/``parallelize=`` each rank is one rank of a pp × FSDP2 × TP job (:mod:`sacplan.pipeline.mesh`).

Names load on first use (the CLI's ``--help`` imports no torch).
"""

import importlib

_LAZY = {
    "sacplan.pipeline.collect": ("PipelineRank", "collect_pipeline", "pipeline_loss", "rank_module"),
    "sacplan.pipeline.measure": ("measure_rank",),
    "sacplan.pipeline.plans": ("PipelinePlan", "load_pipeline_plan", "solve_pipeline"),
    "sacplan.pipeline.schedule": ("SCHEDULES", "build_schedule", "rank_stages", "run_schedule_step", "stage_io"),
    "sacplan.pipeline.validate": ("RankReport", "validate_pipeline"),
}


def __getattr__(name: str):
    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'sacplan.pipeline' has no attribute {name!r}")


__all__ = sorted(n for names in _LAZY.values() for n in names)
