"""``collect_pipeline``: one fake schedule step per pipeline rank → one :class:`~sacplan.stats.ModelStats` per rank.

Each rank's step is PyTorch's own: its ``PipelineStage`` objects and ``torch.distributed.pipelining`` schedule
(:mod:`sacplan.pipeline.schedule`) run on fake tensors under a fake process group (:mod:`sacplan.pipeline.fake_group`)
inside :func:`sacplan.collect` (as its ``train_step``: a warm-up step creates the optimizer state and the stages'
receive buffers, the second is recorded). So the recorded timeline is the schedule's real order of forwards and
backwards over its microbatches, with the send/receive buffers, the microbatch outputs the schedule keeps, the
loss, the parameters' gradients and the optimizer state: nothing is emulated. Every module call of every
microbatch is one call in the stats' orders, so :class:`~sacplan.timeline.Timeline` counts exactly the calls of
the microbatches in flight at each event, and a plan (one decision per module) changes every in-flight microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from sacplan.collector.step import local_shard_step
from sacplan.errors import ConfigError
from sacplan.pipeline.fake_group import fake_process_group, sends_hold_tensors, static_schedule
from sacplan.pipeline.mesh import StageParallelizer, boundaries, mesh_rank, pipeline_dims
from sacplan.pipeline.schedule import (
    MULTI_STAGE,
    SCHEDULES,
    build_schedule,
    rank_stages,
    run_schedule_step,
    schedule_key,
)
from sacplan.stats import ModelStats

__all__ = ["PipelineRank", "collect_pipeline", "pipeline_loss", "rank_module", "stage_modules"]


class PipelineRank(nn.Module):
    """The stages one rank holds under an interleaved schedule, as children ``stage<index>`` (module names in the
    rank's stats and plan are ``stage<index>.<name in the stage>``).

    The schedule calls each stage; calling the rank module with a function runs that function (the rank's schedule
    step) as its forward, so a collected step has the one root call the statistics are organised under."""

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for i in sorted(stages):
            self.add_module(f"stage{i}", stages[i])

    def stage(self, index: int) -> nn.Module:
        return getattr(self, f"stage{index}")

    def forward(self, step: Callable[[], Any]) -> Any:
        if not callable(step):
            raise ConfigError("PipelineRank is called with the rank's schedule step (a function); the schedule runs each stage")
        return step()


def rank_module(stage_fns: Sequence[Callable[[], nn.Module]], held: Sequence[int]) -> nn.Module:
    """The module a rank's stats describe: its stage itself, or a :class:`PipelineRank` of its stages."""
    if len(held) == 1:
        return stage_fns[held[0]]()
    return PipelineRank({i: stage_fns[i]() for i in held})


def stage_modules(model: nn.Module, held: Sequence[int]) -> dict[int, nn.Module]:
    """Stage index → module of the rank module :func:`rank_module` built (the module itself for one stage)."""
    if len(held) == 1:
        return {held[0]: model}
    return {i: model.stage(i) for i in held}  # type: ignore[operator]


def pipeline_loss(loss_fn: Callable[..., torch.Tensor] | None, has_target: bool) -> Callable[[Any, Any], torch.Tensor]:
    """The ``(output, target)`` loss a schedule calls: ``loss_fn(output, target)`` with a target, ``loss_fn(output)``
    without (default: sacplan's default loss of the output)."""
    from sacplan.collector import default_loss

    if loss_fn is None:
        return lambda out, tgt: default_loss(out, ())
    if has_target:
        return loss_fn
    return lambda out, tgt: loss_fn(out)


def collect_pipeline(
    stage_fns: Sequence[Callable[[], nn.Module]],
    inputs: Any,
    *,
    schedule: str = "1F1B",
    microbatches: int,
    num_ranks: int | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
    device: Any = "h100",
    dtype: torch.dtype | str | None = None,
    optimizer: Any = None,
    runtime: str = "roofline",
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    mesh: Mapping[str, int] | None = None,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
) -> list[ModelStats]:
    """Collect every pipeline rank's step: element ``r`` describes rank ``r`` over one schedule step.

    Args:
        stage_fns: ``stage_fns[i]()`` builds stage ``i``'s module, as for ``PipelineStage`` (called on the ``meta``
            device first, like :func:`sacplan.collect`'s factories). Stage ``i`` takes stage ``i - 1``'s outputs
            as its positional arguments.
        inputs: the first stage's full batch (a tensor or a tuple of positional inputs), split along dim 0 into
            ``microbatches`` as the schedule splits it.
        schedule: ``"1F1B"``, ``"GPipe"`` or ``"Interleaved1F1B"`` (rank ``r`` then holds stages ``r, r + p, …``).
        microbatches: microbatches per step.
        num_ranks: pipeline ranks ``p``; default ``len(stage_fns)`` (required for Interleaved1F1B).
        loss_fn: applied to the last stage's output per microbatch: ``loss_fn(output)``, or
            ``loss_fn(output, target)`` when ``target`` is given; default: sacplan's default loss.
        target: the full batch's target (split like ``inputs``), passed to ``loss_fn``.
        device, dtype, optimizer, runtime, model_name, progress: as for :func:`sacplan.collect`.
        mesh: the other dimensions of each pipeline rank (``{"dp_shard": 2, "tp": 2}``): the job is a
            ``("pp", *mesh)`` mesh of ``num_ranks × prod(mesh)`` ranks on PyTorch's fake process group, the stages
            send on the ``"pp"`` group, and pipeline rank ``r`` is collected as mesh coordinate ``(r, 0, …)``
            (:mod:`sacplan.pipeline.mesh`). ``inputs`` is then one data-parallel rank's batch.
        parallelize: with ``mesh``, ``fn(stage_module, device_mesh)`` applying FSDP2 / TP to one stage on the mesh
            without ``"pp"`` (e.g. :func:`sacplan.models.llama_parallel.parallelize_llama`), as for
            :func:`sacplan.collect`; each stage a rank holds is parallelized on its own.

    Returns:
        One :class:`ModelStats` per rank; ``meta["pipeline"]`` says the schedule, microbatches, rank, its stages and
        every stage module's fingerprint (what a pipeline plan checks a stage against); with ``mesh``,
        ``meta["distributed"]`` is the rank's place in the composed mesh, as ``collect(mesh=...)`` records it.
        Plan rank ``r`` with ``sacplan.solve(sacplan.ModuleTree(stats[r]), budget)``.

    Raises:
        ConfigError: bad arguments, or a process group already initialised in this process.
        CollectionError: a rank's fake step failed.
    """
    from sacplan.collector import parse_dtype

    say = progress or (lambda s: None)
    key = schedule_key(schedule)
    fns = list(stage_fns)
    if not fns or not all(callable(f) for f in fns):
        raise ConfigError("stage_fns must be a non-empty list of zero-argument functions that build each stage's module")
    n = len(fns)
    if num_ranks is None:
        if key in MULTI_STAGE:
            raise ConfigError(f"{SCHEDULES[key]}: pass num_ranks (rank r holds stages r, r + num_ranks, ...)")
        num_ranks = n
    rank_stages(0, num_ranks, n, key)  # the stage count fits the schedule
    dt = parse_dtype(dtype)
    dims = None
    if mesh is not None or parallelize is not None:
        if mesh is None or parallelize is None:
            raise ConfigError("mesh= and parallelize= go together: mesh={'dp_shard': D, 'tp': T} and "
                              "parallelize=fn(stage_module, device_mesh)")
        dims = pipeline_dims(num_ranks, mesh)
        say(f"stage boundaries on the {' x '.join(f'{k} {v}' for k, v in dims.items())} mesh")
    io = boundaries(fns, inputs, microbatches, dt, dims, parallelize)
    from sacplan.fingerprint import model_fingerprint

    metas = [_meta_stage(f) for f in fns]
    name = model_name or type(metas[0]).__name__
    stage_fps = [model_fingerprint(m) for m in metas]
    del metas
    job = _Job(fns, num_ranks, io, key, microbatches, pipeline_loss(loss_fn, target is not None), dict(
        device=device, dtype=dt, optimizer=optimizer, runtime=runtime, progress=progress), dims, parallelize)
    out = []
    for r in range(num_ranks):
        held = rank_stages(r, num_ranks, n, key)
        say(f"pipeline rank {r}: stages {list(held)}")
        stats = job.collect_rank(r, held, _rank_inputs(inputs, target, held, n), target is not None, f"{name} pp{r}")
        meta = dict(stats.meta)
        meta["pipeline"] = dict(schedule=SCHEDULES[key], microbatches=microbatches, rank=r, num_ranks=num_ranks,
                                stages=list(held), num_stages=n, stage_fingerprints=stage_fps)
        out.append(dataclasses.replace(stats, meta=meta))
    return out


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every rank's collection shares: the stages, their boundaries, the schedule, the loss, the
    :func:`sacplan.collect` knobs and, when composed, the mesh dimensions and the parallelize function."""

    fns: Sequence[Callable[[], nn.Module]]
    num_ranks: int
    io: Sequence[Any]
    key: str
    microbatches: int
    loss: Callable[[Any, Any], torch.Tensor]
    knobs: Mapping[str, Any]
    dims: Mapping[str, int] | None
    parallelize: Callable[[nn.Module, Any], Any] | None

    def collect_rank(self, r: int, held: Sequence[int], rank_inputs: tuple, has_target: bool, label: str) -> ModelStats:
        """Pipeline rank ``r``'s stats: its schedule step under its own fake process group (module docstring), or
        as mesh coordinate ``(r, 0, …)`` of the composed mesh (:mod:`sacplan.pipeline.mesh`)."""
        from sacplan.collector import collect

        n = len(self.fns)
        n_inputs = len(rank_inputs) - (has_target and n - 1 in held)
        build = lambda: rank_module(self.fns, held)  # noqa: E731
        if self.dims is None:
            step = _RankStep(held, n, self.io, self.key, self.microbatches, self.loss, n_inputs=n_inputs)
            with fake_process_group(r, self.num_ranks):
                return collect(build, rank_inputs, train_step=step, model_name=label, **self.knobs)
        par = StageParallelizer(self.parallelize, self.dims)  # type: ignore[arg-type]
        step = _RankStep(held, n, self.io, self.key, self.microbatches, self.loss, n_inputs=n_inputs,
                         group=lambda: par.group)
        with sends_hold_tensors():
            return collect(build, rank_inputs, train_step=step, model_name=label, mesh=dict(self.dims),
                           parallelize=par, rank=mesh_rank(r, self.dims), **self.knobs)


def _meta_stage(fn: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return fn()


def _rank_inputs(inputs: Any, target: Any, held: Sequence[int], n: int) -> tuple:
    """What the rank's step holds as inputs: the first stage's batch (rank of stage 0), then the target (rank of
    the last stage)."""
    args: tuple = ()
    if 0 in held:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
    if target is not None and n - 1 in held:
        args = args + (target,)
    return args


class _RankStep:
    """One rank's training step for :func:`sacplan.collect` (its ``train_step``): the schedule's step, then the
    optimizer step. The stages and the schedule are built on the first call and kept, as in training."""

    def __init__(self, held: Sequence[int], n: int, io: Sequence[Any], key: str, microbatches: int,
                 loss: Callable[[Any, Any], torch.Tensor], n_inputs: int, group: Callable[[], Any] | None = None) -> None:
        self.held, self.n, self.io, self.key, self.mb, self.loss, self.n_inputs = held, n, io, key, microbatches, loss, n_inputs
        self.group = group  # the pipeline's process group, when it is not the default one
        self.sched: Any = None

    def __call__(self, model: nn.Module, args: tuple, opt: torch.optim.Optimizer | None) -> None:
        if self.sched is None:
            dev = next(iter(model.parameters()), torch.empty(0)).device
            self.sched = build_schedule(stage_modules(model, self.held), self.io, schedule=self.key, microbatches=self.mb, loss_fn=self.loss,
                                        device=dev, group=self.group() if self.group else None)
            static_schedule(self.sched)
        inputs = tuple(args[: self.n_inputs])
        target = args[self.n_inputs] if len(args) > self.n_inputs else None
        if len(self.held) == 1:
            run_schedule_step(self.sched, self.held, self.n, inputs, target, self.mb)
        else:  # under the rank module's one call (see PipelineRank)
            model(lambda: run_schedule_step(self.sched, self.held, self.n, inputs, target, self.mb))
        if opt is not None:
            with local_shard_step(opt):  # DTensor parameters (a mesh) step through their local shards
                opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
