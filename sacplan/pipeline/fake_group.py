"""A fake process group for one pipeline rank's fake step: PyTorch's own schedule runs, nothing is sent.

``torch.distributed``'s ``fake`` backend (``FakeProcessGroup``) completes every send and receive at once without
moving data, so a rank's schedule runs alone in this process, on fake tensors, allocating exactly the buffers its
stages allocate. Two things differ from a real run and are made equal here:

* torch >= 2.10 votes between stages on static vs runtime shape inference and reads the vote with ``.item()``,
  which fake tensors cannot answer: :func:`static_schedule` skips the vote and sets the outcome every rank reaches
  when all stages are built with full metadata (:func:`sacplan.pipeline.schedule.build_schedule` builds them so);
* a real backend's send ``Work`` (gloo's, NCCL's) holds the sent tensor until the ``Work`` object dies, and the
  schedules keep some send works across a later forward or backward (1F1B's warm-up sends until its cool-down), so
  a sent microbatch output outlives its backward there; the fake backend's works hold nothing, so
  :func:`fake_process_group` makes every ``isend``'s work hold its tensor as the real ones do;
* the group must be the process's default one, so collecting needs ``torch.distributed`` uninitialised here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from sacplan.errors import ConfigError


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[Any]:
    """The default process group, for the duration, is a fake one of ``world_size`` ranks seen from ``rank``.

    Raises:
        ConfigError: a process group is already initialised in this process.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("pipeline collection needs torch.distributed, which this PyTorch build lacks")
    if dist.is_initialized():
        raise ConfigError(
            "collect_pipeline runs each rank's schedule on a fake process group, which must be this process's default "
            "group: call it before torch.distributed.init_process_group (e.g. in a planning script or on rank 0 before "
            "the job starts), not inside a running distributed job"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with sends_hold_tensors():
            yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _HeldWork:
    """A send's ``Work`` that keeps the sent tensor alive while it lives, as real backends' works do."""

    def __init__(self, work: Any, tensor: Any) -> None:
        self._work = work
        self._tensor = tensor

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def sends_hold_tensors() -> Iterator[None]:
    """``torch.distributed.isend`` returns a :class:`_HeldWork` for the duration (both names of the function are
    replaced: ``batch_isend_irecv`` tells sends from receives by identity)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    orig = c10d.isend

    def isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        work = orig(tensor, *args, **kwargs)
        return None if work is None else _HeldWork(work, tensor)

    c10d.isend = isend
    dist.isend = isend
    try:
        yield
    finally:
        c10d.isend = orig
        dist.isend = orig


def static_schedule(sched: Any) -> None:
    """Skip the stages' static/dynamic shape-inference vote of ``sched`` (torch >= 2.10) and set its outcome,
    static, on every stage: what a real run decides when every stage has full metadata. No-op on older torch."""
    if not hasattr(sched, "_warmup_p2p"):
        return
    from torch.distributed.pipelining.stage import InferenceMode

    def warmup(stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for st in stages:
            st._inference_mode = InferenceMode.STATIC

    sched._warmup_p2p = warmup
