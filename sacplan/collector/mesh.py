"""Collect one rank's step of a parallel job by running the user's own parallelize function on PyTorch's
fake process group.

``collect(..., mesh={"dp_shard": 2, "tp": 2}, parallelize=fn)``:

1. :func:`fake_mesh` starts PyTorch's ``fake`` backend (no communication, no peers: collectives return
   without touching data) as rank ``rank`` of ``prod(mesh)`` ranks and builds a ``DeviceMesh`` on CPU with
   those dimension names and sizes;
2. the model is built on ``meta`` and ``fn(model, device_mesh)`` runs on it *outside* fake mode (FSDP2's
   ``fully_shard``, ``parallelize_module`` with Colwise / Rowwise / SequenceParallel styles, a sacplan plan...);
   parallelizing inside ``FakeTensorMode`` fails in ``DeviceMesh``;
3. the parallelized model is materialised as fakes (``to_empty``) and the ordinary fake step runs: DTensor
   ops, FSDP2's all-gathers / reshards / mixed-precision casts and the collectives' outputs are what this
   rank allocates. The recorder counts a DTensor's local shard (:func:`~sacplan.collector.storage.storages_of`)
   and its FLOPs on local shapes (:func:`~sacplan.collector.runtime.local_shards`);
4. the process group is destroyed (also when the step fails), unless it was an existing fake group reused.

Which rank: ``torch.chunk`` semantics (FSDP2's dim-0 shards, TP's Colwise / Rowwise splits) give the
earlier ranks the larger pieces when a size does not divide, so coordinate 0 on every dimension (rank 0,
the default) holds the largest shards. Every rank of a TP group runs the same ops on same-sized shards, so
the plan solved on these stats is the plan of every rank.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.errors import ConfigError

__all__ = ["fake_mesh", "check_mesh", "forget_meshes", "fsdp_units_of", "mesh_info", "CollectiveFakeMode"]

Parallelize = Callable[[nn.Module, Any], Any]


class CollectiveFakeMode(FakeTensorMode):
    """``FakeTensorMode`` whose ``_c10d_functional.wait_tensor`` returns its input, as the real kernel does.

    The op's registered fake/meta kernel returns ``empty_like(input)``: a second buffer of every collective's
    output (a full-logits copy after a TP all-gather) that a real rank never allocates.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _WAIT:
            return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)


_WAIT = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT = getattr(_WAIT, "default", None)


def check_mesh(mesh: Any, rank: Any) -> tuple[dict[str, int], int]:
    """``mesh`` as ``{name: size}`` (insertion order = mesh dimension order) and the rank, both validated.

    Raises:
        ConfigError: not a mapping of names to positive ints, or ``rank`` outside ``0..prod(sizes)-1``.
    """
    if not isinstance(mesh, Mapping) or not mesh:
        raise ConfigError(f"mesh must be a dict of dimension names to sizes, e.g. {{'dp_shard': 2, 'tp': 2}}; got {mesh!r}")
    dims: dict[str, int] = {}
    for name, size in mesh.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"mesh dimension names must be non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"mesh[{name!r}] must be an integer >= 1, got {size!r}")
        dims[name] = size
    world = math.prod(dims.values())
    if rank is None:
        rank = 0
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ConfigError(f"rank must be an integer in 0..{world - 1} (the mesh has {world} ranks), got {rank!r}")
    return dims, rank


@contextlib.contextmanager
def fake_mesh(dims: Mapping[str, int], rank: int) -> Iterator[Any]:
    """A CPU ``DeviceMesh`` of ``dims`` on PyTorch's fake process group, as rank ``rank``; torn down after.

    An already initialised default group is reused only if it is a fake one of the same world size and
    rank (then it is left initialised); any other raises, since this process is part of a real job.

    Raises:
        ConfigError: a real (or differently shaped) default process group is initialised.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = math.prod(dims.values())
    created = False
    if dist.is_initialized():
        backend = str(dist.get_backend())
        if backend != "fake" or dist.get_world_size() != world or dist.get_rank() != rank:
            raise ConfigError(
                f"collect(mesh=...) runs the step on PyTorch's fake process group, but a default process group is "
                f"already initialised here (backend {backend!r}, rank {dist.get_rank()} of {dist.get_world_size()}): "
                "collect before init_process_group, in a separate process, or on one rank before the job starts "
                "(the plan is the same for every rank), or pass world_size= for the simulated FSDP path"
            )
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        created = True
    try:
        yield init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
            forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans, which hold ``DeviceMesh`` objects.

    Two meshes of the same shape seen from different ranks compare equal (``DeviceMesh.__eq__`` ignores the
    process groups), so after a fake group is destroyed a cached decision would hand the next collection (another
    rank: rank 2's TP group is not rank 0's) a mesh whose groups no longer exist."""
    from torch.distributed.tensor import _redistribute

    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # pragma: no cover - older torch: the Python cache only
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    else:
        _clear_sharding_prop_cache()
    plans = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(plans, "cache_clear"):
        plans.cache_clear()
    clear = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear is not None:
        clear()


def fsdp_units_of(model: nn.Module) -> list[str | list[str]]:
    """The ``fully_shard`` units of a parallelized model (fqns; a group as a list), root ``""`` included."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    names = {m: n for n, m in model.named_modules()}
    units: list[str | list[str]] = []
    seen: set[int] = set()
    for mod, name in names.items():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        members = [names[m] for m in getattr(state, "_modules", (mod,)) if m in names]
        units.append(members[0] if len(members) == 1 else members)
    return units


def mesh_info(dims: Mapping[str, int], rank: int, model: nn.Module) -> dict[str, Any]:
    """``stats.meta["distributed"]`` of a mesh collection: dimensions, this rank's coordinate, FSDP units."""
    coord: dict[str, int] = {}
    rest = rank
    for name, size in reversed(list(dims.items())):  # row-major: the last dimension varies fastest
        coord[name] = rest % size
        rest //= size
    return {
        "mode": "mesh",
        "world_size": math.prod(dims.values()),
        "mesh": dict(dims),
        "rank": rank,
        "coordinate": {n: coord[n] for n in dims},
        "units": fsdp_units_of(model),
        "note": "observed on PyTorch's fake process group: DTensor local shards, collective outputs, FSDP2 itself",
    }
