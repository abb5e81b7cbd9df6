"""The autocast weight cache: the low-precision copies of parameters that ``torch.autocast`` keeps for reuse.

Under autocast, aten's ``cached_cast`` casts an fp32 leaf tensor that requires grad (a parameter; not a view) to
the autocast dtype (bf16 / fp16) once and keeps the copy in a cache that is cleared only when the outermost
autocast context exits (``torch.autocast.__exit__``: ``clear_autocast_cache``), the end of the forward and loss in
a training step. So such a copy lives until then whether or not anything saves it for backward, and later uses of
the parameter in the same context (a weight tied to another, a module called twice) run no cast at all.

For the memory model (:mod:`sacplan.collector.module_hooks`): a copy that no op saves is held by the cache, not by
the module, so checkpointing the module cannot discard it; it is not the module's activation. For the plan's
policy (:mod:`sacplan.apply.policy`): ``torch.utils.checkpoint`` recomputes a region under a fresh autocast context
(a fresh cache), so the recomputation casts parameters whose cast the forward found in the cache: one
``_to_copy`` more than the forward ran, which must not shift the occurrence numbers of the plan's saved ops.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["autocast_caching", "is_weight_cast"]

_TO_COPY = torch.ops.aten._to_copy.default
_LOW = (torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")


def is_weight_cast(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op is the cast autocast's weight cache keeps (when a caching autocast context is active):
    ``_to_copy`` of an fp32 leaf tensor requiring grad, not a view, to bf16 / fp16 (``cached_cast``'s condition)."""
    if func is not _TO_COPY or not args or not isinstance(args[0], torch.Tensor):
        return False
    x = args[0]
    return (kwargs.get("dtype") in _LOW and x.dtype == torch.float32 and x.requires_grad and x.is_leaf
            and not x._is_view())


def autocast_caching() -> bool:
    """Whether an autocast context with its weight cache is active (read outside dispatch: inside an autocast kernel
    the autocast dispatch key is excluded and ``torch.is_autocast_enabled`` answers False)."""
    return torch.is_autocast_cache_enabled() and any(torch.is_autocast_enabled(d) for d in _DEVICES)
