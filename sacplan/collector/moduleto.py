"""``Module.to()`` inside a collected step: a call that changes nothing leaves the module as it is.

``nn.Module._apply`` swaps every fake parameter for its converted copy (``torch.utils.swap_tensors``), even when the
conversion returns the very same tensor, and the swap fails for a parameter that the step's autograd graph already
holds ("_apply(): Couldn't swap Linear.weight"). On real tensors the same call sets ``param.data`` to itself: a
no-op. Some models cast a submodule inside their forward (Switch Transformers' router runs
``self.classifier = self.classifier.to(self.dtype)`` on every call), so during the collected step a ``to()``
whose device and dtype every parameter and buffer already has returns the module untouched, as the real step
leaves it; any other ``to()`` runs as usual.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import torch
from torch import nn


def _unchanged(t: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """``Module.to(device, dtype)`` would leave ``t`` as it is (only floating and complex tensors take a dtype)."""
    if device is not None and t.device != device:
        return False
    return dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype


@contextlib.contextmanager
def unchanged_module_to() -> Iterator[None]:
    """While active, ``nn.Module.to`` returns the module itself when it would change no tensor of it."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        device = None if device is None else torch.device(device)
        tensors = itertools.chain(self.parameters(), self.buffers())
        if memory_format is None and all(_unchanged(t, device, dtype) for t in tensors):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]
