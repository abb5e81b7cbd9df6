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

The package: :mod:`~sacplan.apply.policy` (which ops are saved), :mod:`~sacplan.apply.rng` (regions planned
without RNG state draw no random numbers), :mod:`~sacplan.apply.kv_cache` (key/value caches under checkpointing),
and here the planned ``forward`` and the apply / remove bookkeeping.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from sacplan.apply.autocast import CacheHits
from sacplan.apply.kv_cache import check_kv_cache, refuse_cache_kwargs
from sacplan.apply.policy import make_policy, outside_ptrs, policy_settings
from sacplan.apply.rng import generator_states, rng_mismatch
from sacplan.errors import ConfigError, PlanMismatchError
from sacplan.fingerprint import canonical_names, model_fingerprint
from sacplan.opnames import dropout_is_fused
from sacplan.plan import Plan

__all__ = ["apply_plan", "remove_plan", "applied_plan", "make_policy"]

_ATTR = "_sacplan_applied"  # on the (unwrapped) model: the applied plan
_ORIG = "_sacplan_orig_forward"  # on a checkpointed module: its own instance ``forward`` (None: the class's)
_CACHE_OFF = "_sacplan_cache_turned_off"  # on the model: configs whose use_cache apply_plan turned off


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


# ------------------------------------------------------------------------------------ planned forward
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


class _PlannedForward:
    """A checkpointed module's ``forward``: an instance attribute that deep-copies and pickles with the module.

    It holds the module itself (``copy.deepcopy`` maps it to the copy, pickle restores the reference) and
    only plain data from the plan (saved op keys), never a closure, so a copied, pickled or
    ``torch.save``-d planned model trains its own parameters with the same plan.
    """

    def __init__(
        self, module: nn.Module, saved: frozenset[tuple[str, int]], save_random: bool, mutation: bool, fused_dropout: bool,
        preserve_rng_state: bool = True, fqn: str = "",
    ) -> None:
        self.module = module
        #: the plan's ``ModuleDecision.preserve_rng_state`` (eager steps; compiled regions keep torch's default)
        self.preserve_rng_state = preserve_rng_state
        self.fqn = fqn
        self.saved = saved
        self.save_random = save_random
        self.mutation = mutation
        self.fused_dropout = fused_dropout
        # A fully checkpointed region (nothing saved) of a module without buffers runs as plain checkpointing:
        # the selective policy would decide nothing there. It saves only ops that write in place into the
        # module's buffers (BatchNorm's statistics) or the region's inputs, and checkpointing refuses the latter
        # anyway (its backward raises autograd's version error for any input written in the region, with or
        # without the selective mode). The mode's Python dispatch on every op of the forward and the
        # recomputation costs 23-119 us per op per pass on a real GPU (benchmarks/RESULTS.md). Same tensors
        # saved, same recomputation: the same bytes and bitwise the same gradients. A region planned without RNG
        # state (``preserve_rng_state=False``) runs its first call under the policy, which refuses a random op
        # there (``checked``: that call has run), and plain afterwards, every plain call checking that its
        # forward left the generators as it found them (sacplan.apply.rng): a later call that draws random
        # numbers (training mode after an eval-mode first call, a data-dependent branch) is refused too.
        self.full = not (saved or save_random or mutation)
        self.checked = False

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
        refuse_cache_kwargs(module, kwargs)
        if torch.compiler.is_compiling():
            ctx = functools.partial(
                _compiled_context, tuple(sorted(self.saved)), self.save_random, self.mutation, self.fused_dropout
            )
            return checkpoint(bound, *args, use_reentrant=False, context_fn=ctx, **kwargs)
        rng, fqn = getattr(self, "preserve_rng_state", True), getattr(self, "fqn", "")  # pickled before the field
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

        # A region that draws no random numbers needs no RNG state: no stash at the forward, no fork_rng copy while
        # recomputing (sacplan.devices.checkpoint_state_bytes); the policy refuses a random op there, so such a
        # region's first call runs the policy even when it is full (see ``self.full``).
        if getattr(self, "full", False) and (rng or getattr(self, "checked", False)) and next(module.buffers(), None) is None:
            if rng:
                return checkpoint(run, *unique, use_reentrant=False)
            before = generator_states(unique)
            out = checkpoint(run, *unique, use_reentrant=False, preserve_rng_state=False)
            if generator_states(unique) != before:
                raise rng_mismatch(fqn, "its forward advanced a random number generator")
            return out
        outside = outside_ptrs(module, args, kwargs)  # only the selective policy reads them
        saved, save_random, mutation, fused_dropout = set(self.saved), self.save_random, self.mutation, self.fused_dropout

        def context_fn() -> Any:
            hits = CacheHits()  # autocast's weight cache (sacplan.apply.autocast)
            forward, recompute = create_selective_checkpoint_contexts(
                make_policy(saved, save_random, outside, fused_dropout=fused_dropout, no_rng_state=not rng, region=fqn,
                            cache_hits=hits),
                allow_cache_entry_mutation=mutation or bool(outside),
            )
            return forward, hits.priming(recompute)

        out = checkpoint(run, *unique, use_reentrant=False, context_fn=context_fn, preserve_rng_state=rng)
        self.checked = True
        return out


def _wrap(module: nn.Module, decision: Any, fused_dropout: bool = False) -> None:
    _unwrap(module)  # a module named twice (or shared under two names) is wrapped once, by its last decision
    orig = module.__dict__.get("forward", None)
    module.__dict__[_ORIG] = orig
    module.forward = _PlannedForward(  # type: ignore[method-assign]
        module, *policy_settings(decision, fused_dropout), bool(getattr(decision, "preserve_rng_state", True)),
        str(getattr(decision, "fqn", "")),
    )


def _unwrap(module: nn.Module) -> None:
    if _ORIG not in module.__dict__:
        return
    orig = module.__dict__.pop(_ORIG)
    if orig is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = orig  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------ apply / remove
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


def check_model(model: Any, call: str) -> nn.Module:
    """``model`` when it is an ``nn.Module``; else :class:`~sacplan.errors.ConfigError` naming ``call``."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{call} needs the nn.Module as its first argument, got {type(model).__name__} {model!r:.60}")
    return model


def applied_plan(model: nn.Module) -> Any:
    """The plan currently applied to ``model`` (``None`` if none)."""
    check_model(model, "applied_plan")
    held = _inner(model).__dict__.get(_ATTR)
    return held.plan if held is not None else None


def apply_plan(model: nn.Module, plan: Any, *, check_fingerprint: bool = True, stage: int | None = None) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    A pipeline plan (:class:`~sacplan.pipeline.plans.PipelinePlan`: every stage in one file) needs ``stage``, the
    index of the pipeline stage ``model`` is; its part of the plan is applied, after checking ``model`` is the
    module that stage was planned for.

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
    check_model(model, "apply_plan")
    if hasattr(plan, "for_stage"):  # a pipeline plan: the stage's part, checked against the module
        if stage is None:
            raise ConfigError("this is a pipeline plan (every stage in one): say which stage this module is, "
                              "apply_plan(stage_module, plan, stage=i)")
        plan = plan.for_stage(stage, _inner(model) if check_fingerprint else None)
    elif stage is not None:
        raise ConfigError(f"stage={stage!r} selects a stage of a pipeline plan; this is a single-model plan")
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
    cache_off = check_kv_cache(model) if chosen else []
    fused = dropout_is_fused(getattr(plan, "device_name", ""))
    for d in chosen:
        _wrap(mods[d.fqn], d, fused)
    model.__dict__[_ATTR] = _AppliedPlan(plan)
    if cache_off:
        model.__dict__[_CACHE_OFF] = cache_off
    return outer


def remove_plan(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_plan` (no-op if no plan is applied); accepts the same wrappers as :func:`apply_plan`."""
    check_model(model, "remove_plan")
    for mod in model.modules():
        _unwrap(mod)
    inner = _inner(model)
    inner.__dict__.pop(_ATTR, None)
    for cfg in inner.__dict__.pop(_CACHE_OFF, ()):
        cfg.use_cache = True
    return model
