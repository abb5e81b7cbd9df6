"""Fingerprints that tie a plan to the model (and inputs) it was made for.

``model_fingerprint`` hashes module fqns, module types and parameter/buffer shapes — not values, dtypes
or devices — so the same architecture gives the same fingerprint on ``meta``, fake, CPU or CUDA tensors
and in any dtype. Input shapes are kept separately (a plan is still *applicable* at another batch size,
only its numbers change).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

#: Wrapper modules that apply/distributed wrapping may insert; their names are dropped from fqns.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.", "_orig_mod.")


def canonical_fqn(fqn: str) -> str:
    """fqn with wrapper segments (checkpoint, FSDP1, DDP, torch.compile) removed."""
    for w in _WRAPPER_PREFIXES:
        fqn = fqn.replace(w, "")
        if fqn.startswith(w):
            fqn = fqn[len(w) :]
    return fqn


def model_fingerprint(model: nn.Module) -> str:
    """Hex SHA-256 over (fqn, module type) of every module and (fqn, shape) of every parameter and buffer."""
    h = hashlib.sha256()
    for name, mod in model.named_modules():
        name = canonical_fqn(name)
        if type(mod).__name__ in ("DistributedDataParallel", "OptimizedModule", "CheckpointWrapper"):
            continue
        h.update(f"m:{name}:{type(mod).__name__};".encode())
    for name, p in model.named_parameters():
        h.update(f"p:{canonical_fqn(name)}:{tuple(_logical_shape(p))};".encode())
    for name, b in model.named_buffers():
        h.update(f"b:{canonical_fqn(name)}:{tuple(_logical_shape(b))};".encode())
    return h.hexdigest()[:32]


def _logical_shape(t: torch.Tensor) -> torch.Size:
    # FSDP2 parameters are DTensors whose .shape is the full (unsharded) shape, which is what we want.
    return t.shape


def input_shapes_of(args: Any) -> tuple[tuple[int, ...], ...]:
    """Shapes of the tensors in ``args`` (in pytree order)."""
    flat, _ = tree_flatten(args)
    return tuple(tuple(int(s) for s in t.shape) for t in flat if isinstance(t, torch.Tensor))
