"""The selective-checkpoint policy: which ops of a checkpointed region are saved and which recomputed.

:func:`make_policy` answers ``torch.utils.checkpoint``'s question per op: ops are recognised by ``(family,
occurrence)`` inside one call of the module's forward (the family is the op's overload name, except that every
attention kernel is one family and every random op is one, see :mod:`sacplan.opnames`), and saved exactly when
the plan keeps them. In-place writes into tensors from outside the region (its inputs, the module's buffers
such as BatchNorm's ``num_batches_tracked``) are always saved, so recomputation never applies them twice; under
``torch.compile`` so are writes into tensors that need no gradient. :func:`policy_settings` reads a plan
decision into the policy's arguments; :func:`outside_ptrs` gives the storages outside a region.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

from sacplan.apply.rng import rng_mismatch
from sacplan.opnames import (
    RANDOM, draws_random_numbers, family, is_attention, is_inplace_op, is_random_op, resolve_op, saved_op_keys,
)

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
#: Non-random ops of eager ``dropout`` on a device without a fused kernel (CPU): ``empty_like``, ``bernoulli_``
#: (random), ``div_``, ``mul``. Traced by ``torch.compile`` it is one ``native_dropout`` on every device.
_CPU_DROPOUT_COMPANIONS = ("aten.empty_like.default", "aten.div_.Scalar", "aten.mul.Tensor")


class _OpInfo:
    """What the policy needs to know of an op overload, worked out once per overload (the policy runs on every op
    of a selective region's forward and recomputation, so its own Python time is step time)."""

    __slots__ = ("name", "random", "family", "inplace", "attention")

    def __init__(self, func: Any) -> None:
        self.name = str(func)
        self.random = is_random_op(func)
        self.family = family(self.name, self.random)
        self.inplace = is_inplace_op(func)
        self.attention = is_attention(self.name)


_OP_INFO: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = _OpInfo(func)
    return info


def _eager_decomposes_dropout(args: tuple) -> bool:
    """Eager ``dropout`` of ``args[0]`` would run the composite (unfused) path, as ``at::dropout`` decides."""
    x = args[0] if args else None
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


def make_policy(
    saved: set[tuple[str, int]],
    save_random: bool,
    outside: frozenset[int] = frozenset(),
    *,
    compiled: bool = False,
    fused_dropout: bool = False,
    no_rng_state: bool = False,
    region: str = "",
    cache_hits: Any = None,
) -> Callable[..., CheckpointPolicy]:
    """A fresh SAC policy function that saves ops whose ``(family, occurrence)`` is in ``saved``.

    Ops that write in place into a tensor from outside the region (``outside``: storage pointers of the
    region's inputs and the module's buffers, e.g. BatchNorm running statistics) are always saved, so
    recomputation never applies their side effect twice. Under ``torch.compile`` (``compiled=True``) the
    tensors are functional wrappers without storage pointers; there an in-place write into a tensor that
    does not require grad (buffers, inputs without grad) is always saved: recomputing it would read the
    buffer after AOTAutograd's epilogue has written the new value back (an autograd version error).
    ``fused_dropout``: the plan numbers ops as a CUDA target runs them (dropout is one ``native_dropout``,
    see :mod:`sacplan.collector.kernels`). Eager dropout on a CPU host then decomposes into ``empty_like``,
    ``bernoulli_``, ``div_``, ``mul``: the three non-random companions are not counted and follow the random
    decision, so every other op keeps the plan's occurrence numbers.
    ``no_rng_state``: the region (module ``region``) is checkpointed with ``preserve_rng_state=False`` because
    the collected step drew no random numbers in it (the plan's ``preserve_rng_state``); a forward op that
    draws some after all (dropout turned on since, a module in eval mode when collected) raises
    :class:`~sacplan.errors.PlanMismatchError`, as its recomputation would replay other random numbers and
    change the gradients silently.
    ``cache_hits``: a :class:`~sacplan.apply.autocast.CacheHits` told of every forward op (autocast's weight cache).
    The occurrence counters live in the returned closure, so call this once per forward invocation.
    """
    counters: dict[tuple[bool, str], int] = {}
    noise: dict[bool, int] = {}  # fused_dropout: storage of the last decomposed dropout's noise tensor
    pending: dict[bool, list[str]] = {}  # its companions still to come

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        info = _op_info(func)
        rnd, fam = info.random, info.family
        recompute = bool(getattr(ctx, "is_recompute", False))
        if cache_hits is not None and not recompute:
            cache_hits.note(func, args, kwargs)
        if no_rng_state and not recompute and (rnd or info.attention) and draws_random_numbers(func, args, kwargs):
            raise rng_mismatch(region, str(func))
        if fused_dropout and not compiled:
            companion = _dropout_companion(func, args, recompute, noise, pending, counters)
            if companion is not None:
                return companion if not save_random else CheckpointPolicy.MUST_SAVE
        key = (recompute, fam)
        occ = counters.get(key, 0)
        counters[key] = occ + 1
        if fused_dropout and save_random and not compiled and info.name == "aten.empty_like.default":
            # may head a decomposed dropout whose noise is saved: the cache must hold the filled tensor
            return CheckpointPolicy.MUST_SAVE
        if compiled and not fused_dropout and func is _NATIVE_DROPOUT and _eager_decomposes_dropout(args):
            for fam2 in _CPU_DROPOUT_COMPANIONS:  # keep the occurrences eager on this device would count
                counters[(recompute, fam2)] = counters.get((recompute, fam2), 0) + 1
        if outside and info.inplace and _writes_outside(func, args, kwargs, outside):
            return CheckpointPolicy.MUST_SAVE
        if compiled and (info.inplace or func in _UNANNOTATED_BN) and _writes_no_grad(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if rnd:
            return CheckpointPolicy.MUST_SAVE if save_random else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if (fam, occ) in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _dropout_companion(
    func: Any, args: tuple, recompute: bool, noise: dict[bool, int], pending: dict[bool, list[str]],
    counters: dict[tuple[bool, str], int],
) -> CheckpointPolicy | None:
    """For a fused-numbered plan on a decomposing host: PREFER_RECOMPUTE for a dropout companion (not counted).

    ``bernoulli_`` filling a fresh ``empty_like`` marks the pair: the ``empty_like`` already counted is taken
    back, and the next ``div_`` of that noise tensor and ``mul`` by it are companions. Returns ``None`` for
    every other op.
    """
    name = str(func)
    x = args[0] if args else None
    if name == "aten.bernoulli_.float" and isinstance(x, torch.Tensor):
        k = (recompute, "aten.empty_like.default")
        if counters.get(k, 0) > 0 and x.device.type == "cpu":
            counters[k] -= 1
            noise[recompute] = x.untyped_storage().data_ptr()
            pending[recompute] = ["aten.div_.Scalar", "aten.mul.Tensor"]
        return None
    todo = pending.get(recompute)
    if not todo or name != todo[0]:
        return None
    ptr = noise.get(recompute)
    if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args):
        todo.pop(0)
        return CheckpointPolicy.PREFER_RECOMPUTE
    return None


def _ptr(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):  # fake / functional tensors have no data pointer
        return None


def _batch_norm_ops() -> frozenset[Any]:
    names = ("native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm")
    return frozenset(op.default for n in names if (op := getattr(torch.ops.aten, n, None)) is not None)


#: Batch-norm kernels that update ``running_mean`` / ``running_var`` (arguments 3 and 4) when ``training``
#: (argument 5) although their schemas do not mark those arguments as written. Eager recomputation runs
#: them with the statistics frozen (``sacplan.apply``'s frozen running statistics); a traced graph is always saved.
_UNANNOTATED_BN = _batch_norm_ops()


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``func`` writes in place (its schema's alias annotations, and BatchNorm statistics)."""
    if func in _UNANNOTATED_BN:
        return [a for a in args[3:5] if a is not None] if len(args) > 5 and args[5] else []
    out: list[Any] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        val = args[i] if i < len(args) else kwargs.get(a.name)
        out.extend(val if isinstance(val, (list, tuple)) else (val,))
    return out


def _writes_outside(func: Any, args: tuple, kwargs: dict, outside: frozenset[int]) -> bool:
    return any(_ptr(v) in outside for v in _written(func, args, kwargs))


def _writes_no_grad(func: Any, args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and not v.requires_grad for v in _written(func, args, kwargs))


def outside_ptrs(module: nn.Module, args: tuple, kwargs: dict) -> frozenset[int]:
    """Storage pointers of the tensors outside a checkpointed region of ``module``: its call's tensor arguments
    and the module's buffers (fake / functional tensors, which have none, are left out)."""
    flat, _ = tree_flatten((args, kwargs))
    ptrs = {_ptr(t) for t in flat if isinstance(t, torch.Tensor)}
    ptrs.update(_ptr(b) for b in module.buffers())
    ptrs.discard(None)
    ptrs.discard(0)
    return frozenset(p for p in ptrs if p is not None)


def _saves_inplace(entry: Any) -> bool:
    op = resolve_op(entry[1])
    return op is not None and is_inplace_op(op)


def _saved_keys(decision: Any) -> tuple[set[tuple[str, int]], bool]:
    """(family, occurrence) keys of the plan's saved ops, and whether random ops are saved."""
    keys = saved_op_keys(getattr(decision, "saved_ops", None))
    return {k for k in keys if k[0] != RANDOM}, (RANDOM, 0) in keys


def policy_settings(decision: Any, fused_dropout: bool) -> tuple[frozenset[tuple[str, int]], bool, bool, bool]:
    """(saved ``(family, occurrence)`` keys, save random ops, cache entries may be mutated, ``fused_dropout``)
    of a decision (``fused_dropout``: see :func:`make_policy`)."""
    saved_ops = getattr(decision, "saved_ops", None)
    if saved_ops is None:
        return frozenset(), False, False, fused_dropout
    saved, save_random = _saved_keys(decision)
    # Saving an in-place group caches its head, which the group's in-place ops then mutate; the cache must
    # then hand back the mutated (final) value, which is what the forward produced. Saved dropout companions
    # of a fused-numbered plan include div_ (in place) too.
    mutation = any(_saves_inplace(e) for e in saved_ops) or (fused_dropout and save_random)
    return frozenset(saved), save_random, mutation, fused_dropout
