"""Key/value caches under checkpointing: recomputation must not update a cache a second time.

:func:`check_kv_cache` runs when a plan is applied (Hugging Face configs off in training, caches kept in a
module refused); :func:`refuse_cache_kwargs` at each checkpointed forward (a cache passed as an argument).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from torch import nn

from sacplan.collector.hf import training_cache_configs
from sacplan.errors import UnsupportedModelError

#: Keyword arguments through which Hugging Face layers receive a key/value cache object.
CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past")


def check_kv_cache(model: nn.Module) -> list[Any]:
    """Refuse caches recomputation would corrupt; turn Hugging Face ``config.use_cache`` off in training.

    Hugging Face models (``config.use_cache=True`` by default) build a key/value cache only to speed up
    generation; their own ``gradient_checkpointing_enable`` turns it off in training with one warning. Here
    the same: every distinct config object (an encoder–decoder's decoder keeps its own copy) of a module in
    training mode gets ``use_cache=False`` and one :class:`UserWarning` names them; :func:`~sacplan.apply.remove_plan` turns
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


def refuse_cache_kwargs(module: nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Raise UnsupportedModelError if ``kwargs`` hand ``module``'s checkpointed forward a key/value cache."""
    for k in CACHE_KWARGS:
        if kwargs.get(k) is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} received a key/value cache ({k}=...) in a checkpointed forward with "
                "gradients on: recomputation would update the cache a second time. Call the model with "
                "use_cache=False when training, then run the planned step again."
            )
