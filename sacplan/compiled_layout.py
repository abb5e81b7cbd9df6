"""Inductor's layout optimization, replayed on the eager model so that a fake step sees its memory.

The bound :func:`sacplan.validation.validate` keeps for compiled regions with convolutions that cannot be
compiled on fake tensors (:mod:`sacplan.compiled_partition` reproduces Inductor's layouts for the others).

When a graph Inductor compiles contains a 2-D convolution, it may run the graph's convolutions in
channels-last layout (``torch._inductor.graph.GraphLowering.decide_layout_opt``): on CPU with oneDNN always,
on CUDA unless a heuristic says it would be slower. What that costs in memory (measured on a compiled
torchvision ResNet-18, allocator events of each compiled block, ``benchmarks/RESULTS.md``):

* each convolution weight not already channels-last is copied to channels-last in the forward, and the
  *copy* is what the graph saves for its backward: a weight-sized tensor held from the block's forward to its
  backward (the parameter itself stays too), in a checkpointed block as well (its recomputation reads it);
* a graph input a convolution reads (the block's input activation) is copied to channels-last, and the copy is
  saved in its place;
* the backward computes each weight gradient channels-last and copies it to the parameter's layout: a
  weight-sized transient;
* the graph's outputs keep the eager layout (a copy back at the block's end).

:func:`replay_layout` wraps the forward of each module Inductor will compile so that the eager step does the
same copies through autograd (a ``TorchFunctionMode`` hands each convolution channels-last copies of its input
and weight; the module's 4-D input is copied on entry and its output copied back on exit): collected on fake
tensors, the copies are saved and freed exactly as the compiled graph's are.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["WEIGHT_COPY_OP", "layout_optimized", "region_convolutions", "replay_layout"]

#: the op the replay copies convolution weights with (activations are copied with ``aten.clone``)
WEIGHT_COPY_OP = "aten._to_copy.default"

_CONV2D = frozenset({torch.conv2d, torch.nn.functional.conv2d})


def layout_optimized(convs: Iterable[tuple[tuple[int, ...], int]], device_type: str) -> bool:
    """Whether Inductor runs a graph with these 2-D convolutions channels-last (``decide_layout_opt`` for training).

    Args:
        convs: ``(weight shape, groups)`` of each convolution in the graph.
        device_type: ``"cpu"`` or ``"cuda"``.

    Follows ``torch._inductor.config.layout_optimization`` / ``force_layout_optimization``. On CPU with oneDNN:
    always. Elsewhere: not with a grouped convolution of more than one input channel per group, nor one whose
    input channels are at least twice its output channels (kernel > 1), nor when every convolution has at most 64
    input and output channels. Inductor also skips graphs with 300 or more nodes per convolution; the node count
    of a graph is not known here, so such graphs are taken as optimized (the copies are then over-counted).
    """
    import torch._inductor.config as inductor_config

    convs = list(convs)
    if not convs or not inductor_config.layout_optimization:
        return False
    if inductor_config.force_layout_optimization:
        return True
    if device_type == "cpu":
        return bool(torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available())
    if any(groups > 1 and shape[1] > 1 for shape, groups in convs):
        return False
    if any(shape[0] * 2 <= shape[1] and shape[2] > 1 for shape, _ in convs):
        return False
    return not all(shape[0] <= 64 and shape[1] <= 64 for shape, _ in convs)


def region_convolutions(model: nn.Module, regions: Iterable[str]) -> list[tuple[tuple[int, ...], int]]:
    """``(weight shape, groups)`` of the ``nn.Conv2d`` modules inside the named regions (``""``: the whole model)."""
    out = []
    for fqn in regions:
        for m in model.get_submodule(fqn).modules():
            if isinstance(m, nn.Conv2d):
                out.append((tuple(m.weight.shape), int(m.groups)))
    return out


def _needs_copy(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() and not t.is_contiguous(
        memory_format=torch.channels_last)


def _channels_last(t: Any) -> Any:
    """An activation as a channels-last tensor (``aten.clone``, through autograd) when it is a 4-D floating tensor
    not already one."""
    return t.contiguous(memory_format=torch.channels_last) if _needs_copy(t) else t


def _channels_last_weight(t: Any) -> Any:
    """A convolution weight as a channels-last copy, made by :data:`WEIGHT_COPY_OP` (the op
    :mod:`sacplan.compiled_saves` marks as always saved: the compiled graph saves it even when checkpointed)."""
    return t.to(memory_format=torch.channels_last) if _needs_copy(t) else t


def _eager_layout(t: Any) -> Any:
    """A 4-D output back in the default (contiguous) layout, as Inductor returns graph outputs."""
    if isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous():
        return t.contiguous()
    return t


class _ChannelsLastConvolutions(TorchFunctionMode):
    """Hands every 2-D convolution channels-last copies of its input and weight."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _CONV2D and len(args) >= 2:
            args = (_channels_last(args[0]), _channels_last_weight(args[1]), *args[2:])
        return func(*args, **kwargs)


class _LayoutReplayed:
    """A module's forward run as Inductor's layout-optimized graph would lay its tensors out."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(_channels_last, (args, kwargs))
        with _ChannelsLastConvolutions():
            out = self.forward(*args, **kwargs)
        return tree_map(_eager_layout, out)


def replay_layout(model: nn.Module, regions: Iterable[str]) -> nn.Module:
    """Wrap the forward of each module named in ``regions`` (``""``: the whole model) in place; returns ``model``.

    For a fake step of what compiled regions do to memory (see the module docstring); the caller decides with
    :func:`layout_optimized` whether Inductor lays the regions out this way.
    """
    for fqn in regions:
        module = model.get_submodule(fqn)
        module.forward = _LayoutReplayed(module.forward)  # type: ignore[method-assign]
    return model
