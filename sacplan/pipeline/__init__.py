"""Pipeline parallelism: per-rank statistics over a schedule's step, and per-stage plans.

:func:`collect_pipeline` runs each pipeline rank's step of PyTorch's own schedule (1F1B, GPipe, Interleaved1F1B)
on fake tensors and returns one :class:`~sacplan.stats.ModelStats` per rank; ``sacplan.solve`` plans each rank on
the one memory model (:mod:`sacplan.timeline`), which counts the microbatches in flight exactly.
"""

from sacplan.pipeline.collect import PipelineRank, collect_pipeline, pipeline_loss, rank_module
from sacplan.pipeline.measure import measure_rank
from sacplan.pipeline.plans import PipelinePlan, load_pipeline_plan, solve_pipeline
from sacplan.pipeline.schedule import SCHEDULES, build_schedule, rank_stages, run_schedule_step, stage_io
from sacplan.pipeline.validate import RankReport, validate_pipeline

__all__ = [
    "PipelinePlan", "PipelineRank", "RankReport", "SCHEDULES", "load_pipeline_plan", "solve_pipeline", "build_schedule", "collect_pipeline", "measure_rank", "pipeline_loss",
    "rank_module", "rank_stages", "run_schedule_step", "stage_io", "validate_pipeline",
]
