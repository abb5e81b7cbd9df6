"""Pipeline parallelism composed with a device mesh: FSDP2 / tensor parallel inside every stage, on fakes.

``collect_pipeline(..., mesh={"dp_shard": D, "tp": T}, parallelize=fn)`` collects each pipeline rank as one rank
of a ``pp × D × T`` job, the way torchtitan builds it:

* one fake default process group of ``pp × prod(mesh)`` ranks and a ``DeviceMesh`` with dimensions
  ``("pp", *mesh)`` (:func:`pipeline_dims`; :func:`sacplan.collect`'s ``mesh=`` machinery,
  :mod:`sacplan.collector.mesh`);
* pipeline rank ``r`` is the mesh rank at coordinate ``(r, 0, 0, …)`` (:func:`mesh_rank`): coordinate 0 on every
  other dimension holds the largest shards, as for ``collect(mesh=...)``;
* ``fn(stage_module, mesh[non-pp dims])`` parallelizes every stage module the rank holds (:class:`StageParallelizer`:
  torchtitan parallelizes each model chunk), on ``meta``, before it is materialised as fakes;
* the ``PipelineStage`` objects send and receive on ``mesh["pp"]``'s group;
* the stage boundaries a ``PipelineStage`` is built with (static metadata) are the parallelized stages' own
  outputs (:func:`mesh_stage_io`): under sequence parallelism a stage hands the next one its shard of the
  sequence, and with a mixed-precision policy activations in the compute dtype.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from sacplan.errors import ConfigError
from sacplan.pipeline.schedule import StageIO, chain_stage_io, first_microbatch, stage_io

__all__ = ["PP_DIM", "StageParallelizer", "boundaries", "mesh_rank", "mesh_stage_io", "pipeline_dims", "pipeline_rank"]

#: the pipeline dimension's name in the composed mesh (torchtitan's)
PP_DIM = "pp"


def pipeline_dims(num_ranks: int, mesh: Any) -> dict[str, int]:
    """``{"pp": num_ranks, **mesh}``: the composed mesh's dimensions, pipeline first (torchtitan's order).

    Raises:
        ConfigError: ``mesh`` is not a dict of names to sizes >= 1, or names ``"pp"`` itself.
    """
    from sacplan.collector.mesh import check_mesh

    dims, _ = check_mesh(mesh, 0)
    if PP_DIM in dims:
        raise ConfigError(f"mesh= gives the other dimensions of each pipeline rank (e.g. {{'dp_shard': 2, 'tp': 2}}); "
                          f"drop {PP_DIM!r}: num_ranks is the pipeline's size")
    return {PP_DIM: num_ranks, **dims}


def _per_pipeline_rank(dims: Mapping[str, int]) -> int:
    """Processes per pipeline rank: the product of the mesh's other dimensions."""
    return math.prod(v for k, v in dims.items() if k != PP_DIM)


def mesh_rank(pp_rank: int, dims: Mapping[str, int]) -> int:
    """The global rank at coordinate ``(pp_rank, 0, 0, …)`` of a row-major mesh with dimensions ``dims``."""
    return pp_rank * _per_pipeline_rank(dims)


def pipeline_rank(process: int, dims: Mapping[str, int] | None) -> int:
    """The pipeline rank of global rank ``process``: its ``"pp"`` coordinate in the row-major, pipeline-first mesh
    ``dims``; without a mesh (``None``) every process is its own pipeline rank."""
    return process if dims is None else process // _per_pipeline_rank(dims)


class StageParallelizer:
    """``parallelize`` for :func:`sacplan.collect`'s ``mesh=``: runs the user's ``fn(stage, sub_mesh)`` on the
    rank's stage (or on each stage of a :class:`~sacplan.pipeline.collect.PipelineRank`), ``sub_mesh`` being the
    mesh without its ``"pp"`` dimension, and keeps the pipeline group (:attr:`group`) for the ``PipelineStage``."""

    def __init__(self, fn: Callable[[nn.Module, Any], Any], dims: Mapping[str, int]) -> None:
        if not callable(fn):
            raise ConfigError("mesh= needs parallelize=fn, fn(stage_module, device_mesh) applying your parallelism "
                              "to one pipeline stage")
        self.fn = fn
        self.inner = tuple(k for k in dims if k != PP_DIM)
        self.group: Any = None

    def sub_mesh(self, device_mesh: Any) -> Any:
        """``device_mesh`` without its pipeline dimension."""
        return device_mesh[self.inner[0]] if len(self.inner) == 1 else device_mesh[self.inner]

    def __call__(self, model: nn.Module, device_mesh: Any) -> nn.Module:
        from sacplan.pipeline.collect import PipelineRank

        self.group = device_mesh[PP_DIM].get_group()
        sub = self.sub_mesh(device_mesh)
        if not isinstance(model, PipelineRank):
            return self.fn(model, sub) or model
        for name, stage in list(model.named_children()):
            setattr(model, name, self.fn(stage, sub) or stage)
        return model


def mesh_stage_io(
    stage_fns: Sequence[Callable[[], nn.Module]], inputs: Any, microbatches: int, dtype: torch.dtype | None,
    dims: Mapping[str, int], parallelize: Callable[[nn.Module, Any], Any],
) -> list[StageIO]:
    """Every stage's :class:`~sacplan.pipeline.schedule.StageIO` for one microbatch, each stage parallelized by
    ``parallelize`` on the sub-mesh of a fake ``dims`` mesh and run on fakes (outside the recorded steps; the
    shapes are the same at every pipeline coordinate).

    Raises:
        ConfigError: a stage fails on the previous one's output, or hands on a DTensor.
    """
    from sacplan.collector.materialise import build_fake_model
    from sacplan.collector.mesh import CollectiveFakeMode, fake_mesh

    par = StageParallelizer(parallelize, dims)
    with fake_mesh(dims, 0) as device_mesh:
        sub = par.sub_mesh(device_mesh)

        mode = CollectiveFakeMode(allow_non_fake_inputs=True)

        def build(i: int) -> nn.Module:
            return build_fake_model(stage_fns[i], None, mode, dtype, prepare=lambda m: parallelize(m, sub) or m)

        def call(stage: nn.Module, args: tuple[Any, ...]) -> Any:
            with mode:
                fakes = tuple(torch.empty(a.shape, dtype=a.dtype).requires_grad_(a.requires_grad)
                              if isinstance(a, torch.Tensor) else a for a in args)
                return stage(*fakes)

        return chain_stage_io(len(stage_fns), first_microbatch(inputs, microbatches, dtype), build, call)


def boundaries(
    stage_fns: Sequence[Callable[[], nn.Module]], inputs: Any, microbatches: int, dtype: torch.dtype | None,
    dims: Mapping[str, int] | None = None, parallelize: Callable[[nn.Module, Any], Any] | None = None,
) -> list[StageIO]:
    """The stage boundaries a ``PipelineStage`` is built with: :func:`mesh_stage_io` on the composed mesh ``dims``
    (with ``parallelize``), :func:`~sacplan.pipeline.schedule.stage_io` without one. Run it outside any process
    group (the mesh's is a fake one of its own)."""
    if dims is None:
        return stage_io(stage_fns, inputs, microbatches, dtype)
    return mesh_stage_io(stage_fns, inputs, microbatches, dtype, dims, parallelize)  # type: ignore[arg-type]
