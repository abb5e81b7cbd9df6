"""Prove per-stage plans on real CPU steps: one gloo process per pipeline rank, without and with the plans.

:func:`validate_pipeline` spawns ``num_ranks`` processes (gloo, rendezvous on a FileStore in a temporary folder: no
TCP port), each running :func:`~sacplan.pipeline.measure.measure_rank` twice — without a plan, then with its rank's
plan — and returns one :class:`RankReport` per rank: measured vs predicted peak both ways, and whether the warm-up
step's gradients are bitwise equal. Stage factories, inputs and loss must pickle (module-level functions,
``functools.partial``), as for any spawned process. Stats collected on a mesh (``collect_pipeline(mesh=,
parallelize=)``) are validated on one process per mesh rank, each parallelizing its stages on a gloo
``DeviceMesh`` with the same function; every process is compared with its pipeline rank's prediction. The stage
boundaries every ``PipelineStage`` is built with (:func:`~sacplan.pipeline.mesh.boundaries`) are computed once,
here, and handed to every process.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from sacplan.errors import ConfigError, ValidationError
from sacplan.gloo_ranks import join_gloo, report_and_exit, spawn_ranks
from sacplan.pipeline.mesh import boundaries, pipeline_rank
from sacplan.stats import ModelStats

__all__ = ["RankReport", "validate_pipeline"]


@dataclass(frozen=True)
class RankReport:
    """One rank's real steps next to the predictions (bytes).

    Attributes:
        rank, stages: the rank and the stage indices it holds.
        predicted_baseline, measured_baseline: peak without a plan (the stats' peak; the measured step's).
        predicted_plan, measured_plan: peak with the rank's plan (the plan's prediction; the measured step's).
        profiler_baseline, profiler_plan: the CPU allocator's view of the same steps (cross-check; it misses frees
            gloo's threads make, so it may read high on ranks that send).
        grads_equal: every parameter's gradient of the first step is bitwise equal with and without the plan.
        process: the process's rank in the whole group (under a composed mesh several processes share a pipeline
            rank; otherwise ``rank``).
    """

    rank: int
    stages: tuple[int, ...]
    predicted_baseline: int
    measured_baseline: int
    predicted_plan: int
    measured_plan: int
    profiler_baseline: int
    profiler_plan: int
    grads_equal: bool
    process: int

    @property
    def baseline_error(self) -> float:
        """(measured - predicted) / measured without a plan."""
        return (self.measured_baseline - self.predicted_baseline) / self.measured_baseline

    @property
    def plan_error(self) -> float:
        """(measured - predicted) / measured with the plan."""
        return (self.measured_plan - self.predicted_plan) / self.measured_plan


def validate_pipeline(
    stage_fns: Sequence[Callable[[], nn.Module]],
    inputs: Any,
    stats: Sequence[ModelStats],
    plans: Sequence[Any],
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
    seed: int = 0,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
) -> list[RankReport]:
    """Run every rank's real schedule step without and with its plan (one spawned gloo process per rank; with
    stats collected on a mesh, one per process of the mesh, each parallelizing its stages on a gloo
    ``DeviceMesh`` as :func:`~sacplan.pipeline.collect_pipeline` did on the fake one).

    Args:
        stage_fns, inputs, loss_fn, target: as given to :func:`~sacplan.pipeline.collect_pipeline` (picklable).
        stats: what :func:`~sacplan.pipeline.collect_pipeline` returned for them on the ``"cpu"`` device (its
            ``meta["pipeline"]`` gives the schedule, microbatches and ranks).
        plans: per rank, a :class:`~sacplan.plan.Plan` solved on ``stats[rank]``, or one pipeline plan
            (:class:`~sacplan.pipeline.plans.PipelinePlan`) holding every rank's.
        seed: stages are built after ``torch.manual_seed(seed)`` in both runs.
        parallelize: the function given to ``collect_pipeline`` with ``mesh=`` (picklable); required for such stats.

    Raises:
        ConfigError: the stats are not a pipeline's, or plans and ranks do not match.
        ValidationError: a rank failed (its traceback in the message).
    """
    infos = [dict(s.meta.get("pipeline") or {}) for s in stats]
    if not infos or not all(infos):
        raise ConfigError("validate_pipeline needs the stats collect_pipeline returned (one per rank)")
    info = infos[0]
    ws = int(info["num_ranks"])
    if len(stats) != ws:
        raise ConfigError(f"{len(stats)} stats for a pipeline of {ws} ranks")
    dist_info = stats[0].meta.get("distributed") or {}
    mesh = dict(dist_info["mesh"]) if dist_info.get("mode") == "mesh" else None
    if (mesh is None) != (parallelize is None):
        raise ConfigError("stats collected with mesh= are validated with the same parallelize= (and only they)")
    if hasattr(plans, "for_rank"):  # one pipeline plan: each rank applies it stage by stage (apply_plan(.., stage=i))
        docs = [("pipeline", plans.to_dict())] * ws  # type: ignore[union-attr]
        plans = [plans.for_rank(r) for r in range(ws)]  # type: ignore[union-attr]
    else:
        plans = list(plans)
        docs = [("plan", p.to_dict()) for p in plans]
    if len(plans) != ws:
        raise ConfigError(f"{len(plans)} plans for a pipeline of {ws} ranks: pass one per rank")
    fns, microbatches = list(stage_fns), int(info["microbatches"])
    io = boundaries(fns, inputs, microbatches, None, mesh, parallelize)  # once, for every process
    job = dict(stage_fns=fns, inputs=inputs, schedule=info["schedule"], microbatches=microbatches, num_ranks=ws,
               plans=docs, loss_fn=loss_fn, target=target, seed=seed, mesh=mesh, parallelize=parallelize, io=io)
    processes = math.prod(mesh.values()) if mesh else ws
    with tempfile.TemporaryDirectory(prefix="sacplan-pp-") as tmp:
        results, died = spawn_ranks(_worker, processes, Path(tmp) / "rdzv", job)
    errors = [f"process {r['rank']}: {r['error']}" for r in results if "error" in r]
    if errors or died is not None or len(results) != processes:
        raise ValidationError("pipeline validation failed:\n" + "\n".join(errors or [str(died)]))
    out = []
    for r in results:
        none, pl = r["none"], r["plan"]
        pp = none["rank"]
        out.append(RankReport(
            rank=pp, stages=tuple(none["stages"]),
            predicted_baseline=int(stats[pp].peak_bytes), measured_baseline=none["peak_bytes"],
            predicted_plan=int(plans[pp].predicted_peak_bytes),
            measured_plan=pl["peak_bytes"], profiler_baseline=none["profiler_peak_bytes"],
            profiler_plan=pl["profiler_peak_bytes"], grads_equal=none["grad_digests"] == pl["grad_digests"],
            process=r["rank"],
        ))
    return out


def _plan_of(doc: tuple[str, dict], plan_cls: Any, pipeline_cls: Any) -> Any:
    kind, d = doc
    return pipeline_cls.from_dict(d) if kind == "pipeline" else plan_cls.from_dict(d)


def _worker(process: int, ws: int, rdzv: str, job: dict, q: Any) -> None:
    """One process: join the gloo group, measure without and with the plan, report on ``q``."""
    from sacplan.pipeline.measure import measure_rank
    from sacplan.pipeline.plans import PipelinePlan
    from sacplan.plan import Plan

    def body() -> dict:
        join_gloo(process, ws, rdzv)
        plan = _plan_of(job["plans"][pipeline_rank(process, job["mesh"])], Plan, PipelinePlan)
        return {name: measure_rank(job["stage_fns"], job["inputs"], schedule=job["schedule"],
                                   microbatches=job["microbatches"], num_ranks=job["num_ranks"], plan=p,
                                   loss_fn=job["loss_fn"], target=job["target"], seed=job["seed"], mesh=job["mesh"],
                                   parallelize=job["parallelize"], io=job["io"])
                for name, p in (("none", None), ("plan", plan))}

    report_and_exit(process, q, body)
