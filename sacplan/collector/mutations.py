"""Which forward ops read a value that an in-place op overwrites later: the facts that keep save lists safe.

Selective checkpointing caches the *tensor* a saved op returned. When an in-place op later overwrites that
storage (``SiLU(inplace=True)`` on a BatchNorm's output, ``x += residual``, the input clone autograd takes for
``silu_``), the cache hands the recomputation the overwritten value. Every op that read the storage *before*
the overwrite and is recomputed then computes from the wrong value: the gradients change silently (or
autograd refuses with "modified by an inplace operation"). PyTorch itself refuses some such save lists at run
time ("Tensor cached during selective activation checkpoint has been mutated"); others go through.

The safe rule (applied in :func:`sacplan.opgroups.op_groups`): an op that reads a storage which is overwritten
later in the forward is decided *together* with the storage's save decision —

* overwritten inside the module call by an op ``w``: tied to ``w`` (whose group holds the storage's producer,
  or is always saved when the storage comes from outside the call);
* overwritten only after the call, storage produced inside it by ``p``: tied to ``p``;
* overwritten only after the call, storage from outside it (the call's inputs): always saved (``-1``), since
  recomputation would read the overwritten input.

A module call that overwrites one of its own arguments in place (``SiLU(inplace=True)`` as a module alone) is
never a checkpoint region (:meth:`StorageWrites.overwrites_arguments`): recomputation would start from the
overwritten input, and ``torch.utils.checkpoint`` refuses it.

Saved together, every reader returns its cached (correct) value; recomputed together, the producer makes a
fresh storage and the overwrites are applied again in order. No other mix is offered, so no plan can hand a
recomputation an overwritten value. Views are not readers (they compute nothing); the ops that read through
them are, as views share their base's storage.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from sacplan.collector.records import OpRecord


class StorageWrites:
    """In-place writes and producers of every storage over one step's forward ops (global op indices)."""

    def __init__(self, ops: Sequence[OpRecord]) -> None:
        self.ops = ops
        self.writes: dict[int, list[int]] = {}  # storage key -> ascending indices of the ops writing it in place
        self.producer: dict[int, int] = {}  # storage key -> index of the op that allocated it
        for g, o in enumerate(ops):
            for k in o.writes:
                self.writes.setdefault(k, []).append(g)
            for k, new in zip(o.out_sids, o.out_new):
                if new > 0:
                    self.producer.setdefault(k, g)

    def next_write(self, key: int, after: int) -> int | None:
        """Index of the first op after op ``after`` that overwrites storage ``key`` in place (None: none)."""
        w = self.writes.get(key)
        if not w:
            return None
        i = bisect_right(w, after)
        return w[i] if i < len(w) else None

    def ties(self, start: int, end: int) -> list[tuple[int, ...]]:
        """For each op of the call ``[start, end)``: the call-local indices of the ops whose save decision it
        must share (``-1``: it must always be saved); see the module docstring."""
        out: list[tuple[int, ...]] = []
        for g in range(start, end):
            o = self.ops[g]
            tied: list[int] = []
            if not o.is_view:
                for key in o.in_sids:
                    t = self._tie(key, g, start, end)
                    if t is not None and t not in tied:
                        tied.append(t)
            out.append(tuple(tied))
        return out

    def _tie(self, key: int, g: int, start: int, end: int) -> int | None:
        w = self.next_write(key, g)
        if w is None:
            return None
        if w < end:
            return w - start
        p = self.producer.get(key)
        return p - start if p is not None and start <= p < g else -1

    def overwrites_arguments(self, arg_keys: Sequence[int], start: int, end: int) -> bool:
        """Whether an op of the call ``[start, end)`` overwrites in place a storage among the call's arguments."""
        return any(start <= w < end for k in arg_keys for w in self.writes.get(k, ()))
