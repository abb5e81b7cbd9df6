"""Measure one pipeline rank's real schedule step (CPU, inside a running process group): peak bytes and gradients.

:func:`measure_rank` builds the rank's stages (optionally with a plan applied), runs the same
``torch.distributed.pipelining`` schedule that :func:`~sacplan.pipeline.collect_pipeline` ran on fakes, and measures
a step after a warm-up step (optimizer state and the stages' receive buffers exist, as in the collected step):

* ``peak_bytes`` — sacplan's :class:`~sacplan.collector.tracker.StepRecorder` on the real tensors, entered from the
  warm-up step on, so the stages' persistent buffers count; every storage's real lifetime, gloo's included;
* ``profiler_peak_bytes`` — the CPU allocator's own events (``torch.profiler``) of the measured step on the caller's
  thread, added to the bytes live at its start (a cross-check; frees made by gloo's threads are not seen);
  The one allocation no dispatch mode sees, the CPU RNG state ``torch.utils.checkpoint`` stashes per checkpointed
  call (``torch.get_rng_state()``, made in C++), is registered with the recorder as it is made;
* ``grad_digests`` — per parameter, a SHA-256 of the warm-up step's gradient bytes (bitwise comparison of runs).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from sacplan.collector.runtime import local_shards
from sacplan.pipeline.collect import pipeline_loss, rank_module, stage_modules
from sacplan.pipeline.mesh import StageParallelizer, pipeline_rank
from sacplan.pipeline.schedule import StageIO, build_schedule, rank_stages, run_schedule_step, schedule_key, stage_io

__all__ = ["measure_rank"]


def measure_rank(
    stage_fns: Sequence[Callable[[], nn.Module]],
    inputs: Any,
    *,
    schedule: str,
    microbatches: int,
    num_ranks: int,
    plan: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    seed: int = 0,
    mesh: Mapping[str, int] | None = None,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
    io: Sequence[StageIO] | None = None,
) -> dict[str, Any]:
    """This process's rank (``torch.distributed.get_rank()``) of the pipeline: warm-up step, then a measured one.

    ``plan``: the rank's :class:`~sacplan.plan.Plan`, applied to the rank's module, or a
    :class:`~sacplan.pipeline.plans.PipelinePlan`, applied to each of the rank's stage modules (``stage=i``), before
    the schedule is built. Stages are built after ``torch.manual_seed(seed)`` (every rank builds
    the same way, so runs with and without a plan start from the same weights). Returns the figures of the module
    docstring (bytes) and ``where`` (phase, module of the recorder's peak).

    Composed with a mesh (as :func:`~sacplan.pipeline.collect_pipeline` collects it): ``mesh`` is the whole mesh's
    dimensions (``{"pp": p, ...}``, the stats' ``meta["distributed"]["mesh"]``) over every process of the group,
    this process's pipeline rank its ``"pp"`` coordinate; ``parallelize`` runs on each stage after the plan is
    applied, and ``io`` (:func:`~sacplan.pipeline.mesh.boundaries`, computed before the process group starts)
    gives the parallelized stage boundaries.
    """
    from sacplan.collector.records import BUFFER, GRAD, INPUT, OPT, PARAM
    from sacplan.collector.runtime import RuntimeModel
    from sacplan.collector.tracker import StepRecorder
    from sacplan.collector.workspace import profiled_cpu_peak
    from sacplan.devices import CPU
    from sacplan.measurement import rng_states_registered
    from sacplan.stats import Phase

    key = schedule_key(schedule)
    fns = list(stage_fns)
    model, mods, rank, held, group = _build_rank(fns, key, num_ranks, plan, seed, mesh, parallelize)
    io = io if io is not None else stage_io(fns, inputs, microbatches)
    sched = build_schedule(mods, io, schedule=key, microbatches=microbatches,
                           loss_fn=pipeline_loss(loss_fn, target is not None), device=torch.device("cpu"), group=group)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)))(params)
    n = len(fns)
    first_in = (inputs if isinstance(inputs, tuple) else (inputs,)) if 0 in held else ()
    tgt = target if n - 1 in held else None

    def schedule_step() -> None:
        run_schedule_step(sched, held, n, first_in, tgt, microbatches)

    def step() -> None:
        schedule_step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rec = StepRecorder(model, CPU, RuntimeModel(CPU))
    hooks = [p.register_post_accumulate_grad_hook(lambda p: rec.relabel(p.grad, GRAD)) for p in params]
    hooks.append(opt.register_step_post_hook(
        lambda o, a, k: [rec.relabel([v for v in s.values() if isinstance(v, torch.Tensor)], OPT) for s in o.state.values()]))
    try:
        with rng_states_registered(rec), rec:
            rec.register(list(model.parameters()), PARAM)
            rec.register(list(model.buffers()), BUFFER)
            rec.register([t for t in (*first_in, tgt) if isinstance(t, torch.Tensor)], INPUT)
            schedule_step()  # warm-up: gradients to compare, then optimizer state
            digests = {name: _digest(p.grad) for name, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.close_segment()
            live = rec.total
            rec.recording = True
            prof = profiled_cpu_peak(step)
            rec.close_segment(Phase.OTHER)
            rec.recording = False
    finally:
        for h in hooks:
            h.remove()
    return dict(rank=rank, stages=list(held), peak_bytes=int(rec.step_peak), where=list(rec.step_peak_where),
                profiler_peak_bytes=int(live + prof), live_at_start=int(live), grad_digests=digests)


def _build_rank(fns: Sequence[Callable[[], nn.Module]], key: str, num_ranks: int, plan: Any, seed: int,
                mesh: Mapping[str, int] | None, parallelize: Any) -> tuple[nn.Module, dict[int, nn.Module], int, tuple[int, ...], Any]:
    """This process's rank module (plan applied, then parallelized on ``mesh`` when given), its stage modules by
    index, its pipeline rank, the stages it holds and the pipeline's process group (None: the default one)."""
    import torch.distributed as dist

    from sacplan.apply import apply_plan

    rank = pipeline_rank(dist.get_rank(), mesh)
    held = rank_stages(rank, num_ranks, len(fns), key)
    torch.manual_seed(seed)
    model = rank_module(fns, held)
    if hasattr(plan, "for_stage"):  # a pipeline plan: each stage its part, as a training script applies it
        for i, stage in stage_modules(model, held).items():
            apply_plan(stage, plan, stage=i)
    elif plan is not None:
        apply_plan(model, plan)
    if mesh is None:
        return model, stage_modules(model, held), rank, held, None
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
    par = StageParallelizer(parallelize, mesh)
    model = par(model, dm)
    return model, stage_modules(model, held), rank, held, par.group


def _digest(grad: torch.Tensor) -> str:
    """SHA-256 of a gradient's bytes (a DTensor's local shard), any dtype (bf16 has no numpy view)."""
    local = local_shards(grad).detach().contiguous()
    return hashlib.sha256(local.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
