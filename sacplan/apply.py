"""Apply a :class:`~sacplan.plan.Plan` to a model: selective activation checkpointing per module.

Each checkpointed module's ``forward`` is replaced (as an instance attribute, so parameters, names,
hooks and ``state_dict`` are untouched) by a call to ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False`` and a ``context_fn`` from ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
whose policy saves exactly the ops the plan keeps and recomputes the rest. A module with
``saved_ops=None`` is fully checkpointed (nothing saved), except that ops writing in place into the
module's buffers or the region's inputs (BatchNorm running statistics, ``num_batches_tracked``) are always
saved, so recomputation never updates them a second time.

Ops are recognised by ``(family, occurrence)`` inside one call of the module's forward: the family is the
op's overload name, except that every attention kernel (flash / efficient / cuDNN / math-for-CPU) is one
family and every random op is one family (random ops are saved or recomputed together, so a device that
implements dropout with different ops still gets the plan's decision).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from sacplan.errors import PlanMismatchError, UnsupportedModelError
from sacplan.fingerprint import canonical_fqn, model_fingerprint
from sacplan.opnames import RANDOM, family, is_inplace_op, is_random_op, resolve_op, saved_op_keys

__all__ = ["apply_plan", "remove_plan", "applied_plan", "make_policy"]

_ATTR = "_sacplan_applied"
_ORIG = "_sacplan_orig_forward"

def make_policy(
    saved: set[tuple[str, int]], save_random: bool, outside: frozenset[int] = frozenset()
) -> Callable[..., CheckpointPolicy]:
    """A fresh SAC policy function that saves ops whose ``(family, occurrence)`` is in ``saved``.

    Ops that write in place into a tensor from outside the region (``outside``: storage pointers of the
    region's inputs and the module's buffers, e.g. BatchNorm running statistics) are always saved, so
    recomputation never applies their side effect twice. The occurrence counters live in the returned
    closure, so call this once per forward invocation.
    """
    counters: dict[tuple[bool, str], int] = {}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        rnd = is_random_op(func)
        fam = family(str(func), rnd)
        key = (bool(getattr(ctx, "is_recompute", False)), fam)
        occ = counters.get(key, 0)
        counters[key] = occ + 1
        if outside and is_inplace_op(func) and _writes_outside(func, args, kwargs, outside):
            return CheckpointPolicy.MUST_SAVE
        if rnd:
            return CheckpointPolicy.MUST_SAVE if save_random else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if (fam, occ) in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _ptr(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):  # fake / functional tensors have no data pointer
        return None


def _writes_outside(func: Any, args: tuple, kwargs: dict, outside: frozenset[int]) -> bool:
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        val = args[i] if i < len(args) else kwargs.get(a.name)
        vals = val if isinstance(val, (list, tuple)) else (val,)
        if any(_ptr(v) in outside for v in vals):
            return True
    return False


def _outside_ptrs(module: nn.Module, args: tuple, kwargs: dict) -> frozenset[int]:
    from torch.utils._pytree import tree_flatten

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


def _modules_by_canonical_name(model: nn.Module) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        out.setdefault(canonical_fqn(name), mod)
    return out


def _check_kv_cache(model: nn.Module) -> None:
    for name, mod in model.named_modules():
        for attr in ("use_kv_cache", "caching", "use_cache"):
            if getattr(mod, attr, False) is True:
                raise UnsupportedModelError(
                    f"module {name or '<root>'!r} has {attr}=True: a key/value cache changes what the forward "
                    "saves and is not replayed by recomputation. Turn the cache off for training with "
                    "checkpointing (e.g. model.disable_kv_cache() or config.use_cache=False), then apply the plan."
                )
        cfg = getattr(mod, "config", None)
        if cfg is not None and getattr(cfg, "use_cache", False) is True and mod.training:
            raise UnsupportedModelError(
                f"module {name or '<root>'!r} has config.use_cache=True: turn the key/value cache off for training "
                "with checkpointing (config.use_cache=False), then apply the plan."
            )


def _wrap(module: nn.Module, decision: Any) -> None:
    orig = module.__dict__.get("forward", None)
    bound = type(module).forward.__get__(module) if orig is None else orig
    full = getattr(decision, "saved_ops", None) is None
    saved, save_random = (set(), False) if full else _saved_keys(decision)
    # Saving an in-place group caches its head, which the group's in-place ops then mutate; the cache must
    # then hand back the mutated (final) value, which is what the forward produced.
    mutation = any(_saves_inplace(e) for e in (getattr(decision, "saved_ops", None) or ()))

    @functools.wraps(bound)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return bound(*args, **kwargs)  # inference: nothing to save, nothing to recompute
        outside = _outside_ptrs(module, args, kwargs)

        def context_fn() -> Any:
            return create_selective_checkpoint_contexts(
                make_policy(saved, save_random, outside), allow_cache_entry_mutation=mutation or bool(outside)
            )

        return checkpoint(bound, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.__dict__[_ORIG] = orig
    module.forward = forward  # type: ignore[method-assign]


def _unwrap(module: nn.Module) -> None:
    if _ORIG not in module.__dict__:
        return
    orig = module.__dict__.pop(_ORIG)
    if orig is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = orig  # type: ignore[method-assign]


def applied_plan(model: nn.Module) -> Any:
    """The plan currently applied to ``model`` (``None`` if none)."""
    return model.__dict__.get(_ATTR)


def apply_plan(model: nn.Module, plan: Any, *, check_fingerprint: bool = True) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Idempotent (applying the same plan twice changes nothing; applying another plan replaces the first),
    reversible with :func:`remove_plan`, and usable before or after moving the model to its device,
    under bf16 autocast, and before or after FSDP2 ``fully_shard`` / DDP wrapping (wrapper prefixes in
    names are ignored).

    Raises:
        PlanMismatchError: the plan's fingerprint differs from the model's, or a module it names is absent.
        UnsupportedModelError: a key/value cache is switched on.
    """
    if applied_plan(model) is plan:
        return model
    if check_fingerprint and getattr(plan, "fingerprint", None):
        fp = model_fingerprint(model)
        if fp != plan.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for another model (plan fingerprint {plan.fingerprint}, model {fp}): module "
                "names or parameter shapes differ. Re-plan for this model, or pass check_fingerprint=False if you "
                "changed only something the plan does not depend on."
            )
    mods = _modules_by_canonical_name(model)
    chosen = [d for d in plan.decisions if getattr(d, "checkpoint", True)]
    missing = [d.fqn for d in chosen if d.fqn not in mods]
    if missing:
        import difflib

        hints = {m: difflib.get_close_matches(m, list(mods), n=2) for m in missing[:3]}
        raise PlanMismatchError(f"the plan checkpoints modules this model does not have: {missing[:5]}; close names: {hints}")
    if chosen:
        _check_kv_cache(model)
    remove_plan(model)
    for d in chosen:
        _wrap(mods[d.fqn], d)
    model.__dict__[_ATTR] = plan
    return model


def remove_plan(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_plan` (no-op if no plan is applied)."""
    for mod in model.modules():
        _unwrap(mod)
    model.__dict__.pop(_ATTR, None)
    return model
