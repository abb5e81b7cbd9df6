"""Apply a :class:`~sacplan.plan.Plan` to a model: selective activation checkpointing per module.

Each checkpointed module's ``forward`` is replaced (as an instance attribute, so parameters, names,
hooks and ``state_dict`` are untouched) by a call to ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False`` and a ``context_fn`` from ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
whose policy saves exactly the ops the plan keeps and recomputes the rest. A module with
``saved_ops=None`` is fully checkpointed (nothing saved), except that ops writing in place into the
module's buffers or the region's inputs (BatchNorm running statistics, ``num_batches_tracked``) are always
saved, so recomputation never updates them a second time; eager BatchNorm kernels, which update the running
statistics without declaring the write, are recomputed with ``momentum = 0`` (the statistics stay as the
forward left them, bit for bit).

Ops are recognised by ``(family, occurrence)`` inside one call of the module's forward: the family is the
op's overload name, except that every attention kernel (flash / efficient / cuDNN / math-for-CPU) is one
family and every random op is one family (random ops are saved or recomputed together, so a device that
implements dropout with different ops still gets the plan's decision).

Wrappers: DDP and ``torch.compile``'s ``OptimizedModule`` (at the root or around a block) are looked through,
FSDP2's per-module ``FSDP<Class>`` subclasses count as their original class, so a plan applies the same before
or after ``fully_shard`` / DDP / ``torch.compile``. Under ``torch.compile`` the same policy is handed to
Dynamo (``context_fn`` as a ``functools.partial`` of module-level functions, which Dynamo accepts) and AOTAutograd
tags the traced ops; buffer mutations are functionalised there, so the in-place guard is not needed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from sacplan.collect.hf import training_cache_configs
from sacplan.errors import ConfigError, PlanMismatchError, UnsupportedModelError
from sacplan.fingerprint import canonical_names, model_fingerprint
from sacplan.plan import Plan
from sacplan.opnames import RANDOM, dropout_is_fused, family, is_inplace_op, is_random_op, resolve_op, saved_op_keys

__all__ = ["apply_plan", "remove_plan", "applied_plan", "make_policy"]

_ATTR = "_sacplan_applied"
_ORIG = "_sacplan_orig_forward"

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
#: Non-random ops of eager ``dropout`` on a device without a fused kernel (CPU): ``empty_like``, ``bernoulli_``
#: (random), ``div_``, ``mul``. Traced by ``torch.compile`` it is one ``native_dropout`` on every device.
_CPU_DROPOUT_COMPANIONS = ("aten.empty_like.default", "aten.div_.Scalar", "aten.mul.Tensor")


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
) -> Callable[..., CheckpointPolicy]:
    """A fresh SAC policy function that saves ops whose ``(family, occurrence)`` is in ``saved``.

    Ops that write in place into a tensor from outside the region (``outside``: storage pointers of the
    region's inputs and the module's buffers, e.g. BatchNorm running statistics) are always saved, so
    recomputation never applies their side effect twice. Under ``torch.compile`` (``compiled=True``) the
    tensors are functional wrappers without storage pointers; there an in-place write into a tensor that
    does not require grad (buffers, inputs without grad) is always saved: recomputing it would read the
    buffer after AOTAutograd's epilogue has written the new value back (an autograd version error).
    ``fused_dropout``: the plan numbers ops as a CUDA target runs them (dropout is one ``native_dropout``,
    see :mod:`sacplan.collect.kernels`). Eager dropout on a CPU host then decomposes into ``empty_like``,
    ``bernoulli_``, ``div_``, ``mul``: the three non-random companions are not counted and follow the random
    decision, so every other op keeps the plan's occurrence numbers.
    The occurrence counters live in the returned closure, so call this once per forward invocation.
    """
    counters: dict[tuple[bool, str], int] = {}
    noise: dict[bool, int] = {}  # fused_dropout: storage of the last decomposed dropout's noise tensor
    pending: dict[bool, list[str]] = {}  # its companions still to come

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        rnd = is_random_op(func)
        fam = family(str(func), rnd)
        recompute = bool(getattr(ctx, "is_recompute", False))
        if fused_dropout and not compiled:
            companion = _dropout_companion(func, args, recompute, noise, pending, counters)
            if companion is not None:
                return companion if not save_random else CheckpointPolicy.MUST_SAVE
        key = (recompute, fam)
        occ = counters.get(key, 0)
        counters[key] = occ + 1
        if fused_dropout and save_random and not compiled and str(func) == "aten.empty_like.default":
            # may head a decomposed dropout whose noise is saved: the cache must hold the filled tensor
            return CheckpointPolicy.MUST_SAVE
        if compiled and not fused_dropout and func is _NATIVE_DROPOUT and _eager_decomposes_dropout(args):
            for fam2 in _CPU_DROPOUT_COMPANIONS:  # keep the occurrences eager on this device would count
                counters[(recompute, fam2)] = counters.get((recompute, fam2), 0) + 1
        if outside and is_inplace_op(func) and _writes_outside(func, args, kwargs, outside):
            return CheckpointPolicy.MUST_SAVE
        if compiled and _mutates(func) and _writes_no_grad(func, args, kwargs):
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


def _compiled_context(
    saved: tuple[tuple[str, int], ...], save_random: bool, mutation: bool, fused_dropout: bool = False
) -> Any:
    """SAC contexts for a region traced by ``torch.compile``.

    Module-level and called through ``functools.partial`` with constant arguments: Dynamo accepts only such a
    ``context_fn`` (a closure raises ``NotImplementedError: checkpoint not implemented for ... context_fn``).
    """
    return create_selective_checkpoint_contexts(
        make_policy(set(saved), save_random, compiled=True, fused_dropout=fused_dropout),
        allow_cache_entry_mutation=mutation,
    )


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
#: them with the statistics frozen (:func:`_frozen_running_stats`); a traced graph is always saved.
_UNANNOTATED_BN = _batch_norm_ops()


@contextlib.contextmanager
def _frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers in ``module`` leave their running statistics as they are (``momentum = 0``).

    Used while a checkpointed forward is *recomputed*: eager BatchNorm kernels (``native_batch_norm`` on
    CPU, cuDNN / MIOpen on GPUs) update ``running_mean`` / ``running_var`` without declaring it, so the
    policy cannot see the write and recomputation would apply the update a second time. With momentum 0 the
    update is ``1·running + 0·batch``, bit-for-bit the old value, and the normalised output (batch
    statistics in training) is unchanged, so the plan's memory and FLOPs stay as planned.
    ``num_batches_tracked += 1`` is an annotated in-place write and is saved, hence never repeated.
    """
    frozen = [
        (m, m.momentum)
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    for m, _ in frozen:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum in frozen:
            m.momentum = momentum


def _mutates(func: Any) -> bool:
    return func in _UNANNOTATED_BN or is_inplace_op(func)


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


def _outside_ptrs(module: nn.Module, args: tuple, kwargs: dict) -> frozenset[int]:
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


# ------------------------------------------------------------------------------------------ wrappers
#: (module of the class, class name, attribute holding the wrapped module) of wrappers that only forward.
_FORWARDING_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
)


def _wrapped_attr(mod: nn.Module) -> str | None:
    for modname, clsname, attr in _FORWARDING_WRAPPERS:
        pymod = sys.modules.get(modname)  # not imported: no instance can exist
        cls = getattr(pymod, clsname, None) if pymod is not None else None
        if cls is not None and isinstance(mod, cls):
            return attr
    return None


def _inner(mod: nn.Module) -> nn.Module:
    """The module DDP / ``torch.compile`` wrappers around ``mod`` forward to (``mod`` itself if none)."""
    while (attr := _wrapped_attr(mod)) is not None:
        mod = getattr(mod, attr)
    return mod


def _modules_by_canonical_name(model: nn.Module) -> dict[str, nn.Module]:
    """Modules by their name in the unwrapped model (:func:`~sacplan.fingerprint.canonical_names`), DDP /
    ``torch.compile`` wrappers left out (a plan's decision lands on the module they forward to)."""
    names = canonical_names(model)
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if _wrapped_attr(mod) is None:
            out.setdefault(names[name], mod)
    return out


#: Keyword arguments through which Hugging Face layers receive a key/value cache object.
_CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past")
_CACHE_OFF = "_sacplan_cache_turned_off"


def _check_kv_cache(model: nn.Module) -> list[Any]:
    """Refuse caches recomputation would corrupt; turn Hugging Face ``config.use_cache`` off in training.

    Hugging Face models (``config.use_cache=True`` by default) build a key/value cache only to speed up
    generation; their own ``gradient_checkpointing_enable`` turns it off in training with one warning. Here
    the same: every distinct config object (an encoder–decoder's decoder keeps its own copy) of a module in
    training mode gets ``use_cache=False`` and one :class:`UserWarning` names them; :func:`remove_plan` turns
    them back on. Returns the configs changed. Module attributes ``use_kv_cache`` / ``caching`` /
    ``use_cache`` (caches that live in the module and are updated by its forward) still raise.
    """
    for name, mod in model.named_modules():
        for attr in ("use_kv_cache", "caching", "use_cache"):
            if getattr(mod, attr, False) is True:
                raise UnsupportedModelError(
                    f"module {name or '<root>'!r} has {attr}=True: a key/value cache changes what the forward "
                    "saves and is not replayed by recomputation. Turn the cache off for training with "
                    "checkpointing (e.g. model.disable_kv_cache() or config.use_cache=False), then apply the plan."
                )
    changed = training_cache_configs(model)
    if changed:
        warnings.warn(
            "sacplan: checkpointing a model in training mode turns its key/value cache off "
            f"(config.use_cache=False on {sorted(n for n, _ in changed)}), as Hugging Face's "
            "gradient_checkpointing_enable does; remove_plan turns it back on.",
            UserWarning,
            stacklevel=3,
        )
        for _, cfg in changed:
            cfg.use_cache = False
    return [cfg for _, cfg in changed]


def _refuse_cache_kwargs(module: nn.Module, kwargs: Mapping[str, Any]) -> None:
    for k in _CACHE_KWARGS:
        if kwargs.get(k) is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} received a key/value cache ({k}=...) in a checkpointed forward with "
                "gradients on: recomputation would update the cache a second time. Call the model with "
                "use_cache=False when training, then run the planned step again."
            )


def _settings(decision: Any, fused_dropout: bool) -> tuple[frozenset[tuple[str, int]], bool, bool, bool]:
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


class _PlannedForward:
    """A checkpointed module's ``forward``: an instance attribute that deep-copies and pickles with the module.

    It holds the module itself (``copy.deepcopy`` maps it to the copy, pickle restores the reference) and
    only plain data from the plan (saved op keys), never a closure, so a copied, pickled or
    ``torch.save``-d planned model trains its own parameters with the same plan.
    """

    def __init__(
        self, module: nn.Module, saved: frozenset[tuple[str, int]], save_random: bool, mutation: bool, fused_dropout: bool
    ) -> None:
        self.module = module
        self.saved = saved
        self.save_random = save_random
        self.mutation = mutation
        self.fused_dropout = fused_dropout

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # inspect.signature sees the module's own forward
        return self._bound()

    def _bound(self) -> Callable[..., Any]:
        orig = self.module.__dict__.get(_ORIG)
        return type(self.module).forward.__get__(self.module) if orig is None else orig

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound, module = self._bound(), self.module
        if not torch.is_grad_enabled():
            return bound(*args, **kwargs)  # inference: nothing to save, nothing to recompute
        _refuse_cache_kwargs(module, kwargs)
        if torch.compiler.is_compiling():
            ctx = functools.partial(
                _compiled_context, tuple(sorted(self.saved)), self.save_random, self.mutation, self.fused_dropout
            )
            return checkpoint(bound, *args, use_reentrant=False, context_fn=ctx, **kwargs)
        outside = _outside_ptrs(module, args, kwargs)
        saved, save_random, mutation, fused_dropout = set(self.saved), self.save_random, self.mutation, self.fused_dropout
        # Hand checkpoint each distinct tensor once and rebuild the arguments from them: with saved-tensor
        # hooks active (offloading, a memory tracker) recomputation gets a new tensor object per saved input,
        # and a forward that branches on identity (nn.MultiheadAttention's ``query is key``) must see the
        # same aliasing as in the forward.
        flat, spec = tree_flatten((args, kwargs))
        unique: list[torch.Tensor] = []
        slot: dict[int, int] = {}
        index = [slot.setdefault(id(t), len(slot)) if isinstance(t, torch.Tensor) else -1 for t in flat]
        for t, i in zip(flat, index):
            if i == len(unique):
                unique.append(t)
        calls = 0

        def run(*tensors: Any) -> Any:  # first call: the forward; later calls: recomputation
            nonlocal calls
            calls += 1
            a, k = tree_unflatten([tensors[i] if i >= 0 else x for x, i in zip(flat, index)], spec)
            if calls == 1:
                return bound(*a, **k)
            with _frozen_running_stats(module):
                return bound(*a, **k)

        def context_fn() -> Any:
            return create_selective_checkpoint_contexts(
                make_policy(saved, save_random, outside, fused_dropout=fused_dropout),
                allow_cache_entry_mutation=mutation or bool(outside),
            )

        return checkpoint(run, *unique, use_reentrant=False, context_fn=context_fn)


def _wrap(module: nn.Module, decision: Any, fused_dropout: bool = False) -> None:
    _unwrap(module)  # a module named twice (or shared under two names) is wrapped once, by its last decision
    orig = module.__dict__.get("forward", None)
    module.__dict__[_ORIG] = orig
    module.forward = _PlannedForward(module, *_settings(decision, fused_dropout))  # type: ignore[method-assign]


def _unwrap(module: nn.Module) -> None:
    if _ORIG not in module.__dict__:
        return
    orig = module.__dict__.pop(_ORIG)
    if orig is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = orig  # type: ignore[method-assign]


class _AppliedPlan:
    """Holds the applied plan on the model: shared (plans are immutable) by ``copy.deepcopy``, pickled as the
    plan's ``to_dict()`` (a :class:`~sacplan.plan.Plan` holds read-only mappings that do not pickle)."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def __deepcopy__(self, memo: dict) -> "_AppliedPlan":
        return _AppliedPlan(self.plan)

    def __reduce__(self) -> tuple:
        to_dict = getattr(self.plan, "to_dict", None)
        if callable(to_dict):
            return _restore_plan, (type(self.plan), to_dict())
        return _AppliedPlan, (self.plan,)


def _restore_plan(cls: Any, d: Mapping[str, Any]) -> _AppliedPlan:
    return _AppliedPlan(cls.from_dict(d))


def applied_plan(model: nn.Module) -> Any:
    """The plan currently applied to ``model`` (``None`` if none)."""
    held = _inner(model).__dict__.get(_ATTR)
    return held.plan if held is not None else None


def apply_plan(model: nn.Module, plan: Any, *, check_fingerprint: bool = True) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Idempotent (applying the same plan twice changes nothing; applying another plan replaces the first),
    reversible with :func:`remove_plan`, and usable before or after moving the model to its device,
    under bf16 autocast, and before or after FSDP2 ``fully_shard`` / DDP wrapping: ``model`` may be the
    ``DistributedDataParallel`` wrapper or its ``.module``, and FSDP2's ``FSDP<Class>`` modules and wrapper
    prefixes in names are recognised. Gradients and the per-rank peak are the same in either order (tested
    with 2 and 4 gloo ranks).

    ``torch.compile`` composes in either order (tested with ``backend="aot_eager"``: gradients bitwise equal
    to the compiled model without a plan, recomputed FLOPs exactly the plan's):

    * ``apply_plan(model, plan)`` then ``torch.compile(model)`` (or ``block.compile()`` per block): Dynamo
      traces the checkpointed regions with the plan's policy;
    * ``torch.compile`` first: pass the compiled module (its ``_orig_mod`` is planned) or the original one;
      Dynamo's guards on each module's ``forward`` make the next call recompile the changed graphs once
      (so does :func:`remove_plan`).

    The same holds with FSDP2 and blocks compiled one by one, in torchtitan's order (plan, compile,
    ``fully_shard``) or after both. Differences under compile: in-place writes into tensors that need no
    gradient (BatchNorm statistics) are always saved, as the traced graph cannot replay them, and with
    dropout the partitioner recomputes at most the plan's FLOPs (eager checkpointing also replays ops whose
    outputs the backward does not need).

    Raises:
        PlanMismatchError: the plan's fingerprint differs from the model's, or a module it names is absent.
        UnsupportedModelError: a module keeps a key/value cache of its own (``use_kv_cache`` / ``caching`` /
            ``use_cache`` attributes), or a checkpointed forward is handed a cache (``past_key_values=...``)
            with gradients on. A Hugging Face ``config.use_cache=True`` in training mode is turned off with
            one warning instead (as ``gradient_checkpointing_enable`` does) and back on by :func:`remove_plan`.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"apply_plan needs the nn.Module to plan as its first argument, got {type(model).__name__} {model!r:.60}")
    if not isinstance(plan, Plan):
        how = "load it first: apply_plan(model, sacplan.load_plan(path, model))" if isinstance(plan, (str, os.PathLike)) else (
            "build it with Plan.from_dict(d), or load the file with sacplan.load_plan" if isinstance(plan, dict) else
            "pass the Plan that solve() returned or sacplan.load_plan() read")
        raise ConfigError(f"apply_plan needs a Plan, got {type(plan).__name__} {plan!r:.60}; {how}")
    outer, model = model, _inner(model)
    if applied_plan(model) is plan:
        return outer
    if check_fingerprint and getattr(plan, "fingerprint", None):
        fp = model_fingerprint(model)
        if fp != plan.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for another model (plan fingerprint {plan.fingerprint}, model {fp}): module "
                "names or parameter shapes differ. Re-plan for this model, or pass check_fingerprint=False if you "
                "changed only something the plan does not depend on."
            )
    mods = _modules_by_canonical_name(model)
    chosen = list(plan.decisions)
    missing = [d.fqn for d in chosen if d.fqn not in mods]
    if missing:
        import difflib

        hints = {m: difflib.get_close_matches(m, list(mods), n=2) for m in missing[:3]}
        raise PlanMismatchError(f"the plan checkpoints modules this model does not have: {missing[:5]}; close names: {hints}")
    remove_plan(model)
    cache_off = _check_kv_cache(model) if chosen else []
    fused = dropout_is_fused(getattr(plan, "device_name", ""))
    for d in chosen:
        _wrap(mods[d.fqn], d, fused)
    model.__dict__[_ATTR] = _AppliedPlan(plan)
    if cache_off:
        model.__dict__[_CACHE_OFF] = cache_off
    return outer


def remove_plan(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_plan` (no-op if no plan is applied); accepts the same wrappers as :func:`apply_plan`."""
    for mod in model.modules():
        _unwrap(mod)
    inner = _inner(model)
    inner.__dict__.pop(_ATTR, None)
    for cfg in inner.__dict__.pop(_CACHE_OFF, ()):
        cfg.use_cache = True
    return model
