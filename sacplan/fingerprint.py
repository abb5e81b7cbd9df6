"""Fingerprints that tie a plan to the model (and inputs) it was made for.

``model_fingerprint`` hashes module fqns, module types and parameter/buffer shapes — not values, dtypes
or devices — so the same architecture gives the same fingerprint on ``meta``, fake, CPU or CUDA tensors
and in any dtype. Input shapes are kept separately (a plan is still *applicable* at another batch size,
only its numbers change).

Wrappers are looked through: a model wrapped in DDP, ``torch.compile``'s ``OptimizedModule`` (at the root or
around a block) or a checkpoint wrapper, or sharded with FSDP2's ``fully_shard`` (which swaps each sharded
module's class for a dynamic ``FSDP<Class>`` subclass and its parameters for DTensors of the full shape), has
the fingerprint and the module names (:func:`canonical_names`) of the model it wraps. Which segments of a name
are wrapper segments is read off the model itself (the wrapper module and the attribute holding what it
wraps), so a module of the user's that happens to be called ``module`` keeps its name.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

#: Wrapper modules that apply/distributed wrapping may insert; their names are dropped from fqns.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.", "_orig_mod.")
#: The same names as the *last* segment of an fqn (the wrapped module itself, e.g. ``layers.0._orig_mod``).
_WRAPPER_LEAVES = tuple(w[:-1] for w in _WRAPPER_PREFIXES)
#: Classes (by name) of modules that only hold another module, and the attribute that holds it. They are
#: left out of fingerprints, and their attribute's segment is dropped from the names of what they wrap.
_WRAPPERS = {
    "DistributedDataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
}


def _strip_prefixes(fqn: str) -> str:
    # What fingerprints have always hashed (plan files written before store them): every wrapper prefix is
    # removed wherever it occurs as a substring. Lossy ("sub_module.x" hashes as "sub_x"), but the same on
    # the side that wrote the plan and on the side that checks it.
    for w in _WRAPPER_PREFIXES:
        fqn = fqn.replace(w, "")
        if fqn.startswith(w):
            fqn = fqn[len(w) :]
    return fqn


def canonical_fqn(fqn: str) -> str:
    """fqn with wrapper segments (checkpoint, FSDP1, DDP, torch.compile) removed, judged from the name alone.

    Wrapper names are removed where they are followed by a dot and as the last segment (``layers.0._orig_mod``
    is ``layers.0``). Without the model this cannot tell a wrapper's segment from a module of the user's with
    the same name; :func:`canonical_names` can, and is what sacplan matches plans against.
    """
    fqn = _strip_prefixes(fqn)
    for leaf in _WRAPPER_LEAVES:
        if fqn == leaf:
            return ""
        if fqn.endswith("." + leaf):
            return fqn[: -len(leaf) - 1]
    return fqn


def is_wrapper(mod: nn.Module) -> bool:
    """``mod`` is a DDP / ``torch.compile`` / checkpoint wrapper (left out of fingerprints)."""
    return type(mod).__name__ in _WRAPPERS


def _wrapped_paths(model: nn.Module) -> frozenset[str]:
    """fqns (in ``model``) of the modules that a wrapper holds: the segments to drop from names."""
    out = set()
    for name, mod in model.named_modules():
        attr = _WRAPPERS.get(type(mod).__name__)
        if attr is not None and mod._modules.get(attr) is not None:
            out.add(f"{name}.{attr}" if name else attr)
    return frozenset(out)


def _unwrap(fqn: str, wrapped: frozenset[str]) -> str:
    """``fqn`` without the segments that lead from a wrapper into the module it holds."""
    if not wrapped or not fqn:
        return fqn
    keep, path = [], ""
    for seg in fqn.split("."):
        path = f"{path}.{seg}" if path else seg
        if path not in wrapped:
            keep.append(seg)
    return ".".join(keep)


def canonical_names(model: nn.Module) -> dict[str, str]:
    """``{fqn in model: fqn in the unwrapped model}`` for every module of ``model`` (wrappers included).

    The unwrapped fqn is the name the module has when the model is not wrapped (the name ``collect`` and plans
    use). A wrapper gets the name of the module it holds, so a DDP root and the model inside are both ``""``,
    and a block compiled in place (``layers.0`` holding ``layers.0._orig_mod``) is ``layers.0`` twice.
    """
    wrapped = _wrapped_paths(model)
    return {name: _unwrap(name, wrapped) for name, _ in model.named_modules()}


def module_type_name(mod: nn.Module) -> str:
    """The module's class name, with FSDP2's dynamic ``FSDP<Class>`` subclass counted as ``<Class>``."""
    cls = type(mod)
    fsdp = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")  # not imported: no FSDPModule
    base_cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if base_cls is not None and issubclass(cls, base_cls):
        rest = [b for b in cls.__bases__ if b is not base_cls]
        if len(rest) == 1 and cls.__name__ == "FSDP" + rest[0].__name__:
            return rest[0].__name__
    return cls.__name__


def model_fingerprint(model: nn.Module) -> str:
    """Hex SHA-256 over (fqn, module type) of every module and (fqn, shape) of every parameter and buffer.

    The model as it was before FSDP2 / DDP / ``torch.compile`` / checkpoint wrapping: wrappers are skipped,
    names are those of the unwrapped model and FSDP2's ``FSDP<Class>`` counts as ``<Class>``. On a model
    without wrappers this is the fingerprint sacplan has always computed (plan files written before still match).
    """
    wrapped = _wrapped_paths(model)

    def key(name: str) -> str:
        return _strip_prefixes(_unwrap(name, wrapped))

    h = hashlib.sha256()
    for name, mod in model.named_modules():
        if is_wrapper(mod):
            continue
        h.update(f"m:{key(name)}:{module_type_name(mod)};".encode())
    for name, p in model.named_parameters():
        h.update(f"p:{key(name)}:{tuple(_logical_shape(p))};".encode())
    for name, b in model.named_buffers():
        h.update(f"b:{key(name)}:{tuple(_logical_shape(b))};".encode())
    return h.hexdigest()[:32]


def _logical_shape(t: torch.Tensor) -> torch.Size:
    # FSDP2 parameters are DTensors whose .shape is the full (unsharded) shape, which is what we want.
    return t.shape


def input_shapes_of(args: Any) -> tuple[tuple[int, ...], ...]:
    """Shapes of the tensors in ``args`` (in pytree order)."""
    flat, _ = tree_flatten(args)
    return tuple(tuple(int(s) for s in t.shape) for t in flat if isinstance(t, torch.Tensor))
