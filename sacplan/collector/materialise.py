"""Materialise the user's model and inputs as fake tensors (``FakeTensorMode``): no real memory is allocated.

* :func:`build_fake_model`: a preset or a factory is built on the ``meta`` device first (initialisers with
  data-dependent ops never run; falls back to building inside fake mode), a real ``nn.Module`` is copied
  structurally onto ``meta``; then its tensors are materialised in fake mode (tied weights stay tied), cast to
  the requested dtype, and the copy is put in training mode.
* :func:`make_inputs`: the forward's arguments from the caller's inputs (or a preset's example inputs), every
  real tensor among them replaced by a fake one.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from sacplan.collector.calling import as_inputs
from sacplan.errors import CollectionError, ConfigError, UnsupportedModelError

#: What :func:`sacplan.collect` accepts as the model: a module, a zero-argument factory, or a preset name.
ModelArg = nn.Module | Callable[[], nn.Module] | str


def build_fake_model(
    model: ModelArg,
    preset: Any,
    fake_mode: FakeTensorMode,
    dtype: torch.dtype | None,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """``model`` (or the preset ``preset``, when not None) as a fake-tensor module in training mode, in ``dtype``
    when given (see the module docstring). ``prepare(m)`` (a parallelize function) runs on the ``meta``-built
    model, outside fake mode, before it is materialised; it returns the model to use.

    Raises:
        ConfigError: ``model`` is not a module, factory or preset name, or its factory returned something else.
        CollectionError: the factory failed both on ``meta`` and in fake mode.
        UnsupportedModelError: the model could not be cast to ``dtype``.
    """
    if preset is not None:
        # The preset casts itself (Llama keeps its rotary table in float32, as a real bf16 run does).
        factory: Callable[[], nn.Module] | None = lambda: preset.build(dtype=dtype)  # noqa: E731
    elif isinstance(model, nn.Module):
        factory = None
    elif callable(model):
        factory = model
    else:
        raise ConfigError(f"model must be an nn.Module, a factory returning one, or a preset name; got {type(model).__name__}")

    if factory is not None:
        try:
            with torch.device("meta"):
                m = factory()
        except Exception as on_meta:
            try:
                with fake_mode:
                    m = factory()
            except ConfigError:
                raise  # the factory's own argument checks (e.g. a bad model config)
            except Exception as on_fake:
                raise CollectionError(
                    f"the model factory failed on the meta device ({type(on_meta).__name__}: {on_meta}) and on fake "
                    f"tensors ({type(on_fake).__name__}: {on_fake}); typically its constructor reads tensor data (.item(), "
                    ".tolist(), numpy). Skip that initialisation when the weights are on 'meta' (weights are never "
                    "read during collection), or build the model yourself and pass the nn.Module."
                ) from on_fake
        if not isinstance(m, nn.Module):
            raise ConfigError(f"the model factory returned {type(m).__name__}, not an nn.Module")
        if any(not t.is_meta and not is_fake(t) for t in _tensors_of(m)):
            # The factory ignored the meta device (it returned a model built earlier, or one built with an
            # explicit device): copy it as a passed module is. Left real, fake mode would turn each real weight
            # into a fresh fake tensor at each use, which the step records as new activations (a saved
            # Linear weight each: +7 of 8 weights in a 4-block MLP's prediction).
            m = _meta_copy(m)
    else:
        m = _meta_copy(model)  # type: ignore[arg-type]
    if dtype is not None and preset is None and any(t.is_meta for t in _tensors_of(m)):
        m = m.to(dtype)  # cast on meta: free, and avoids swapping fake tensors later
    if prepare is not None:
        m = prepare(m)
    with fake_mode:
        if any(t.is_meta for t in _tensors_of(m)):
            m = _to_empty_keep_ties(m)
        if dtype is not None and any(t.is_floating_point() and t.dtype != dtype for t in m.parameters()):
            raise UnsupportedModelError(
                f"could not cast the model to {dtype}: build it in that dtype, or pass dtype=None"
            )
    m.train()
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.momentum is None:
            # A cumulative moving average (momentum=None) computes its factor 1/n with .item(), which fake
            # tensors cannot answer. Any fixed factor runs the same ops on the same bytes; the copy is ours.
            mod.momentum = 0.1
    return m


def _to_empty_keep_ties(m: nn.Module) -> nn.Module:
    """``m.to_empty(device="cpu")`` keeping shared (tied) parameters and buffers shared.

    ``Module.to_empty`` replaces each module's tensors one slot at a time, so a weight shared by two modules
    (tied embeddings) would become two tensors: twice the parameter, gradient and optimizer bytes.
    """
    groups: dict[tuple[str, int], list[tuple[nn.Module, str]]] = {}
    for mod in m.modules():
        for kind, slots in (("p", mod._parameters), ("b", mod._buffers)):
            for name, t in slots.items():
                if t is not None:
                    groups.setdefault((kind, id(t)), []).append((mod, name))
    m = m.to_empty(device="cpu")
    for (kind, _), members in groups.items():
        if len(members) > 1:
            first_mod, first_name = members[0]
            for mod, name in members[1:]:
                if kind == "p":
                    mod._parameters[name] = first_mod._parameters[name]
                else:
                    mod._buffers[name] = first_mod._buffers[name]
    return m


def _meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers live on ``meta`` (no data copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _tensors_of(m: nn.Module) -> list[torch.Tensor]:
    return list(m.parameters()) + list(m.buffers())


def is_fake(t: Any) -> bool:
    """``t`` is a ``FakeTensor``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def make_inputs(
    inputs: Any, preset: Any, fake_mode: FakeTensorMode, batch: int | None, seq: int | None, dtype: torch.dtype | None = None
) -> tuple | dict:
    """The forward's arguments (a tuple or a dict) from ``inputs`` (see :func:`sacplan.collect`), real tensors
    made fake in ``fake_mode``; without ``inputs``, the preset's example inputs for ``batch`` (default: the
    preset's) and ``seq``.

    Raises:
        ConfigError: no ``inputs`` and no preset.
    """
    if inputs is None:
        if preset is None:
            raise ConfigError("inputs are required unless the model is a built-in preset name")
        # Floating-point example inputs (images) in the model's dtype: a bf16 model fed fp32 images fails on a
        # real device, while fake tensors would silently run it in fp32 (fp32-sized activations).
        args = preset.example_inputs(batch or preset.default_batch, seq, dtype=dtype)
    elif callable(inputs) and not isinstance(inputs, torch.Tensor):
        args = inputs()
    else:
        args = inputs
    args = as_inputs(args)

    def fake(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not is_fake(x):
            return fake_mode.from_tensor(x)
        return x

    return tree_map(fake, args)
