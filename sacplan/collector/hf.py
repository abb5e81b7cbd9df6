"""Make Hugging Face ``transformers`` take, on fake tensors, the code path its real step takes.

``transformers`` decides some attention details from tensor *values*: whether a 2-D padding mask is all
ones (then no 4-D mask is built and SDPA runs with ``is_causal``, and with ``enable_gqa`` for grouped-query
attention instead of copying K/V with ``repeat_kv``), and whether ``position_ids`` pack several sequences.
Values cannot be read from fake tensors, and its ``is_tracing`` check treats every ``FakeTensor`` as a
tracer, so a fake step always builds the 4-D mask and copies K/V while the real step does neither: a
Llama-family decoder with grouped-query attention was predicted 7-13% above its real peak.

:func:`transformers_real_paths` answers those questions from the *real* example inputs the caller handed
to :func:`sacplan.collect` (before they became fakes) for the duration of the fake step, and puts every
function it replaced back on exit, also when the step raises. Rules:

* a padding mask on fakes is dense (all ones) unless a real input whose name contains ``"mask"`` (kwargs
  or dict entries) holds a zero — positional masks cannot be recognised, and an all-ones mask is the
  training default;
* ``position_ids`` on fakes pack no sequences unless a real ``position_ids`` input does (checked with the
  library's own function on the real tensor).

Nothing changes when ``transformers`` was never imported, or under real tracing (compile / export / jit),
which the library's own checks still see.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten_with_path

from sacplan.collector.materialise import is_fake

__all__ = ["training_cache_configs", "training_without_cache", "transformers_real_paths"]


def _named_real_tensors(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    """``(path as text, tensor)`` of every real (non-fake) tensor in ``inputs``."""
    try:
        flat, _ = tree_flatten_with_path(inputs)
    except Exception:  # pragma: no cover - unflattenable containers: nothing to learn from
        return []
    out = []
    for path, leaf in flat:
        if isinstance(leaf, torch.Tensor) and not is_fake(leaf) and leaf.device.type != "meta":
            out.append(("".join(str(k) for k in path), leaf))
    return out


@contextlib.contextmanager
def transformers_real_paths(real_inputs: Any) -> Iterator[None]:
    """While active, ``transformers``' value-dependent attention choices on fakes follow ``real_inputs``.

    Args:
        real_inputs: the example inputs as the caller gave them (real tensors; fakes and meta tensors are
            ignored). See the module docstring for the rules.
    """
    mu = sys.modules.get("transformers.masking_utils")
    if mu is None:
        yield
        return
    named = _named_real_tensors(real_inputs)
    sparse_mask = any("mask" in name.lower() and bool((t == 0).any()) for name, t in named)
    orig_packed = getattr(mu, "find_packed_sequence_indices", None)
    packed = orig_packed is not None and any(
        orig_packed(t) is not None for name, t in named if "position_ids" in name and t.dim() == 2
    )
    patches: dict[str, Any] = {}

    if orig_packed is not None:

        def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
            if is_fake(position_ids) and not packed:
                return None
            return orig_packed(position_ids)

        patches["find_packed_sequence_indices"] = find_packed_sequence_indices

    def dense_mask_reader(orig: Callable[..., bool]) -> Callable[..., bool]:
        """``orig`` with a fake padding mask read as dense (None) unless a real mask input holds a zero."""

        def check(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
            if padding_mask is not None and is_fake(padding_mask) and not sparse_mask:
                padding_mask = None
            return orig(padding_mask, *args, **kwargs)

        return check

    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        orig = getattr(mu, name, None)
        if orig is not None:
            patches[name] = dense_mask_reader(orig)

    saved = {name: getattr(mu, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(mu, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(mu, name, fn)


def training_cache_configs(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(module name, config)`` of each distinct Hugging Face config with ``use_cache=True`` on a module in
    training mode (an encoder–decoder's decoder keeps its own copy). In training such a model builds a
    key/value cache it never reads; checkpointing turns it off (as the library's own
    ``gradient_checkpointing_enable`` does), and sacplan plans the training step the same way."""
    found: dict[int, tuple[str, Any]] = {}
    for name, mod in model.named_modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and mod.training and getattr(cfg, "use_cache", False) is True and id(cfg) not in found:
            found[id(cfg)] = (name or "<root>", cfg)
    return list(found.values())


@contextlib.contextmanager
def training_without_cache(model: torch.nn.Module) -> Iterator[list[str]]:
    """While active, the configs of :func:`training_cache_configs` have ``use_cache=False``; yields their module
    names and restores ``use_cache=True`` on exit (also when the block raises).

    :func:`sacplan.collect` records the step this way, and :func:`sacplan.validate` runs its step without a
    plan this way, so predictions and both measured steps describe the step a plan runs (``apply_plan``
    turns the cache off): measured on a 2-layer Llama-family decoder, the cache held 128 KiB in the
    forward that the planned step does not, and the prediction was 2.8% off where it mattered."""
    changed = training_cache_configs(model)
    for _, cfg in changed:
        cfg.use_cache = False
    try:
        yield [n for n, _ in changed]
    finally:
        for _, cfg in changed:
            cfg.use_cache = True
