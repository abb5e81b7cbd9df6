"""Pipeline schedules: torch.distributed.pipelining's own stages and schedules, built the same way for a fake step
(:func:`sacplan.pipeline.collect_pipeline`) and for a real one (validation, training).

The order of forwards and backwards a rank runs is never re-derived here: the schedule object PyTorch builds runs
it, under a fake process group when collecting (:mod:`sacplan.pipeline.fake_group`) and under the real one when
training. What this module owns is the plumbing both need:

* :func:`schedule_class` — ``"1F1B"``, ``"GPipe"``, ``"Interleaved1F1B"`` (any case, ``-``/``_`` ignored) → the class;
* :func:`rank_stages` — which stages rank ``r`` holds (interleaved: ``r, r + p, …``; otherwise stage ``r``);
* :func:`stage_io` — every stage's example input and output for one microbatch, from a forward on the ``meta``
  device, so every :class:`~torch.distributed.pipelining.PipelineStage` is built with static metadata (no
  shape-inference round trip, the same buffers in the fake and the real step);
* :func:`build_schedule` and :func:`run_schedule_step` — the rank's stages and schedule, and one step of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from sacplan.errors import ConfigError

#: schedule names sacplan plans for (keys normalised: lower case, no ``-``/``_``) → torch class name
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved1f1b": "ScheduleInterleaved1F1B"}
#: schedules whose ranks hold several stages (``r, r + p, …``)
MULTI_STAGE = frozenset({"interleaved1f1b"})


def schedule_key(name: str) -> str:
    """``name`` normalised (``"Interleaved-1F1B"`` → ``"interleaved1f1b"``); ConfigError naming the choices."""
    key = str(name).lower().replace("-", "").replace("_", "").replace("schedule", "")
    if key not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of 1F1B, GPipe, Interleaved1F1B")
    return key


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class for ``name`` (see :data:`SCHEDULES`)."""
    import torch.distributed.pipelining as pp

    return getattr(pp, SCHEDULES[schedule_key(name)])


def rank_stages(rank: int, num_ranks: int, num_stages: int, schedule: str) -> tuple[int, ...]:
    """Stage indices rank ``rank`` holds: ``rank, rank + num_ranks, …`` (one stage unless interleaved).

    Raises:
        ConfigError: the stage count does not fit the schedule (one stage per rank for 1F1B/GPipe, a multiple of
            the ranks, at least two per rank, for Interleaved1F1B).
    """
    key = schedule_key(schedule)
    if num_ranks < 1 or num_stages < 1:
        raise ConfigError(f"a pipeline needs at least one rank and one stage, got {num_ranks} ranks, {num_stages} stages")
    if key in MULTI_STAGE:
        if num_stages % num_ranks or num_stages < 2 * num_ranks:
            raise ConfigError(
                f"{SCHEDULES[key]} runs several stages per rank (rank r holds stages r, r + p, ...): {num_stages} "
                f"stages do not split over {num_ranks} ranks that way; pass a multiple of num_ranks, at least 2 per rank"
            )
    elif num_stages != num_ranks:
        raise ConfigError(
            f"{SCHEDULES[key]} runs one stage per rank: {num_stages} stages need {num_stages} ranks, not {num_ranks} "
            "(use Interleaved1F1B for several stages per rank)"
        )
    if not 0 <= rank < num_ranks:
        raise ConfigError(f"rank {rank} is outside the pipeline's {num_ranks} ranks")
    return tuple(range(rank, num_stages, num_ranks))


@dataclass(frozen=True)
class StageIO:
    """One microbatch's example tensors of a stage (on the ``meta`` device: shapes, dtypes, requires_grad only).

    Attributes:
        inputs: the stage's positional inputs.
        outputs: the stage's outputs (a tuple, as ``PipelineStage`` normalises them).
    """

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


def split_microbatches(inputs: Any, microbatches: int) -> list[tuple[Any, ...]]:
    """``inputs`` (a tensor or a tuple of the first stage's positional inputs) split along dim 0 into
    ``microbatches`` chunks, as the schedule splits them (``torch.distributed.pipelining.microbatch``)."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    args = inputs if isinstance(inputs, tuple) else (inputs,)
    chunks, _ = split_args_kwargs_into_chunks(args, None, microbatches)
    return [tuple(c) for c in chunks]


def _meta_like(x: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    dt = dtype if dtype is not None and x.is_floating_point() else x.dtype
    return torch.empty(x.shape, dtype=dt, device="meta").requires_grad_(x.requires_grad and dt.is_floating_point)


def stage_io(
    stage_fns: Sequence[Callable[[], nn.Module]], inputs: Any, microbatches: int, dtype: torch.dtype | None = None
) -> list[StageIO]:
    """Every stage's :class:`StageIO` for one microbatch: the stages built on the ``meta`` device and run in order
    on the first microbatch of ``inputs`` (floating inputs cast to ``dtype``).

    Raises:
        ConfigError: a stage fails on the previous one's output, or returns no tensor.
    """

    def build(i: int) -> nn.Module:
        with torch.device("meta"):
            mod = stage_fns[i]()
        return mod.to(dtype) if dtype is not None else mod

    return chain_stage_io(len(stage_fns), first_microbatch(inputs, microbatches, dtype), build)


def first_microbatch(inputs: Any, microbatches: int, dtype: torch.dtype | None) -> tuple[Any, ...]:
    """The first microbatch of ``inputs`` as ``meta`` tensors (floating ones cast to ``dtype``).

    Raises:
        ConfigError: ``microbatches`` is not an integer >= 1.
    """
    from torch.utils._pytree import tree_map

    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    return split_microbatches(tree_map(lambda t: _meta_like(t, dtype), inputs), microbatches)[0]


def chain_stage_io(
    num_stages: int, first: tuple[Any, ...], build: Callable[[int], nn.Module],
    call: Callable[[nn.Module, tuple[Any, ...]], Any] = lambda mod, args: mod(*args),
) -> list[StageIO]:
    """:class:`StageIO` of ``num_stages`` stages chained from the first stage's inputs ``first``: ``build(i)``
    builds stage ``i``, ``call(stage, args)`` runs it on ``args`` (stage ``i - 1``'s outputs); the recorded
    tensors are ``meta`` copies.

    Raises:
        ConfigError: a stage fails on the previous one's output, or returns something other than plain tensors.
    """
    out: list[StageIO] = []
    args: tuple[Any, ...] = first
    for i in range(num_stages):
        mod = build(i)
        try:
            res = call(mod, args)
        except Exception as e:
            raise ConfigError(
                f"pipeline stage {i} failed on its input (shapes {[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]}): "
                f"{type(e).__name__}: {e}; each stage must take the previous stage's outputs as positional arguments"
            ) from e
        outs = tuple(res) if isinstance(res, (tuple, list)) else (res,)
        if not outs or not all(_plain(t) for t in outs):
            raise ConfigError(
                f"pipeline stage {i} must return a tensor or a tuple of plain tensors, got "
                f"{', '.join(type(t).__name__ for t in outs) or type(res).__name__}; a parallelized stage must hand "
                "the next one local tensors (e.g. use_local_output=True, or .to_local())"
            )
        metas = tuple(_meta_like(t, None) for t in outs)
        out.append(StageIO(tuple(_meta_like(a, None) for a in args if isinstance(a, torch.Tensor)), metas))
        args = metas
    return out


def _plain(t: Any) -> bool:
    """A plain tensor (fake ones included), not a subclass a pipeline cannot send (a DTensor)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is torch.Tensor or isinstance(t, FakeTensor)


def build_schedule(
    modules: Mapping[int, nn.Module],
    io: Sequence[StageIO],
    *,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
    device: torch.device,
    group: Any = None,
) -> Any:
    """The schedule object for one rank: a ``PipelineStage`` per held stage (``modules``: stage index → module),
    built with the static metadata of ``io``, and the ``torch.distributed.pipelining`` schedule over them.

    ``loss_fn(output, target)`` is what the schedule calls on the last stage's microbatch outputs.
    """
    from torch.distributed.pipelining import PipelineStage

    import inspect

    cls = schedule_class(schedule)
    n = len(io)
    takes_grads = "output_grads" in inspect.signature(PipelineStage).parameters  # torch >= 2.10
    stages = []
    for idx in sorted(modules):
        sio = io[idx]
        grads = dict(input_grads=tuple(t if t.requires_grad else None for t in sio.inputs),
                     output_grads=tuple(t if t.requires_grad else None for t in sio.outputs)) if takes_grads else {}
        stages.append(PipelineStage(modules[idx], idx, n, device, input_args=sio.inputs, output_args=sio.outputs,
                                    group=group, **grads))
    try:
        if schedule_key(schedule) in MULTI_STAGE:
            return cls(stages, microbatches, loss_fn=loss_fn)
        return cls(stages[0], microbatches, loss_fn=loss_fn)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"{cls.__name__} with {microbatches} microbatches over {n} stages: {e}") from e


def run_schedule_step(sched: Any, stages: Sequence[int], num_stages: int, inputs: Any, target: Any, microbatches: int) -> Any:
    """One step of ``sched`` on a rank holding ``stages``: the first stage's rank passes ``inputs``, the last
    stage's rank the ``target`` (an empty one, split like the microbatches, when there is none). Returns what the
    schedule's ``step`` returns (the merged output on the last stage's rank)."""
    kw: dict[str, Any] = {}
    if num_stages - 1 in stages:
        kw["target"] = target if target is not None else torch.empty(microbatches, 0)
    if 0 in stages:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return sched.step(*args, **kw)
    return sched.step(**kw)

