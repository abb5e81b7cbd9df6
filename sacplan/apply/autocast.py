"""Selective regions under autocast: the recomputation runs the forward's op sequence although autocast's weight
cache starts empty there.

The forward of a region finds the low-precision copy of a parameter in autocast's weight cache when something
before the region cast it (a weight tied to an earlier one, a module called twice: see
:mod:`sacplan.collector.autocast`); no ``_to_copy`` runs. ``torch.utils.checkpoint`` recomputes the region under a
fresh autocast context, whose cache is empty, so the recomputation would cast it: one ``_to_copy`` more than the
forward ran. The selective mode numbers the recomputation's ops per overload and hands out the saved tensors by
that number, so every later ``_to_copy`` would get the wrong saved tensor (an error, or silently another tensor of
the same shape). :class:`CacheHits` notes, while the forward runs, the parameters whose copy came from the cache
(an argument made by a ``_to_copy`` of a parameter that the region did not cast itself), and primes the
recomputation's cache with them before the selective mode starts, so the recomputation runs the forward's ops.
The priming casts run where the recomputation's casts would have (the same bytes, under the same modes).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from sacplan.collector.autocast import is_weight_cast

__all__ = ["CacheHits"]

_LOW = (torch.bfloat16, torch.float16)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class CacheHits:
    """The parameters a region's forward took from autocast's weight cache (see the module docstring)."""

    def __init__(self) -> None:
        self.cast: set[int] = set()  # ids of the parameters the region's forward cast itself
        self.hits: dict[int, torch.Tensor] = {}  # id -> parameter whose copy the forward found in the cache

    def note(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Called with every op of the region's forward (by the selective policy)."""
        if is_weight_cast(func, args, kwargs):
            self.cast.add(id(args[0]))
            return
        for a in args:
            if not isinstance(a, torch.Tensor) or a.dtype not in _LOW or a.grad_fn is None:
                continue
            fn = a.grad_fn
            if type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
                continue
            acc = fn.next_functions[0][0]
            p = getattr(acc, "variable", None)  # AccumulateGrad of a leaf: the parameter cast
            if isinstance(p, torch.Tensor) and p.dtype == torch.float32 and id(p) not in self.cast and p.dim() > 0:
                self.hits[id(p)] = p

    def prime(self) -> None:
        """Cast each noted parameter through an autocast op with an empty result, which puts its copy in the
        current autocast context's cache (run inside the recomputation's autocast context). The empty products'
        saved tensors go to hooks of their own: the recomputation's hooks count the tensors it saves."""
        if not self.hits:
            return
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            for p in self.hits.values():
                torch.matmul(p, p.new_empty((p.shape[-1], 0)))

    @contextlib.contextmanager
    def priming(self, recompute_context: Any) -> Iterator[None]:
        """``recompute_context`` (the selective mode of the recomputation), entered after :meth:`prime`."""
        self.prime()
        with recompute_context:
            yield
