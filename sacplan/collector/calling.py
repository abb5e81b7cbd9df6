"""How sacplan calls the user's model and loss: the forms users of Hugging Face / timm write.

* ``inputs``: a tuple of positional arguments, one tensor (one argument), or a mapping of keyword arguments
  (``{"input_ids": ..., "labels": ...}``), called as ``model(*inputs)`` or ``model(**inputs)``;
* ``loss_fn``: ``loss_fn(output, inputs)``, or ``loss_fn(output)`` (e.g. ``lambda out: out.loss`` for a
  Hugging Face ``ModelOutput``). The form is decided by the signature: a callable that accepts exactly one
  positional argument gets the output alone; anything else (two parameters, ``*args``, or no inspectable
  signature) gets ``(output, inputs)``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch
from torch import nn

__all__ = ["Inputs", "as_inputs", "call_model", "as_loss"]

#: Positional arguments (tuple) or keyword arguments (mapping) of the model's forward.
Inputs = tuple | Mapping[str, Any]


def as_inputs(x: Any) -> Inputs:
    """``x`` as the forward's arguments: a tuple or a dict kept as is (a dict copied), anything else one argument."""
    if isinstance(x, tuple):
        return x
    if isinstance(x, Mapping):
        return dict(x)
    return (x,)


def call_model(model: nn.Module | Callable[..., Any], inputs: Inputs) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)


def _takes_one(fn: Callable[..., Any]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(None, None)
        return False
    except TypeError:
        pass
    try:
        sig.bind(None)
        return True
    except TypeError:
        return False


def as_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[[Any, Inputs], torch.Tensor]:
    """``loss_fn`` as a two-argument ``(output, inputs) -> scalar`` callable (see the module docstring)."""
    if _takes_one(loss_fn):
        return lambda output, inputs: loss_fn(output)
    return loss_fn
