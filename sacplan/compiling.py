"""``torch.compile`` a model as its users do, for :func:`sacplan.validation.validate` (``compile=...``).

* ``"blocks"`` (what ``compile=True`` means when the model has repeated blocks, as torchtitan compiles by
  default): each repeated block (:func:`sacplan.blocks.repeated_blocks`) compiled in place with
  ``Module.compile``; identical blocks share their compiled graphs.
* ``"model"`` (``compile=True`` without repeated blocks): the whole model compiled in place.

Compiling in place keeps module names, so a plan applied before compiling (torchtitan's order: checkpointing,
then compile) is found and removed as usual. A block whose forward is PyTorch's own (``nn.Sequential``) is
compiled through a frame of sacplan's (``Module.compile()`` alone would leave it eager). What compile changes in
memory, and how :func:`sacplan.validation.validate` predicts it: :mod:`sacplan.compiled_partition` (each region
compiled on fake tensors as ``torch.compile`` compiles it, Inductor's generated code run without kernels in a
fake step: the steps without and with a plan), and the bounds kept where a region cannot be traced that way:
:mod:`sacplan.compiled_layout` (Inductor's channels-last copies for convolutions) and
:mod:`sacplan.compiled_saves` (what a planned compiled region saves beyond eager). Measured figures:
``benchmarks/RESULTS.md``, "Compiled steps".
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from torch import nn

from sacplan.errors import ConfigError

__all__ = ["COMPILE_CHOICES", "compile_choice", "compile_model"]

#: What ``validate(compile=...)`` accepts besides ``True`` / ``False``.
COMPILE_CHOICES = ("blocks", "model")


def compile_choice(compile: Any, blocks: Sequence[str]) -> str | None:
    """``"blocks"``, ``"model"`` or ``None`` (no compile) for a ``compile=`` argument and the model's repeated blocks.

    Raises:
        ConfigError: anything but a bool or one of :data:`COMPILE_CHOICES`.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return "blocks" if blocks else "model"
    if compile in COMPILE_CHOICES:
        if compile == "blocks" and not blocks:
            raise ConfigError("compile='blocks': this model has no repeated blocks; use compile='model' (or True)")
        return str(compile)
    raise ConfigError(f"compile must be True, False, 'blocks' or 'model', got {compile!r:.60}")


def compile_model(model: nn.Module, how: str, blocks: Sequence[str], backend: str = "inductor") -> str:
    """Compile ``model`` in place (each of ``blocks``, or the whole model); returns a short description."""
    with warnings.catch_warnings():
        # sacplan's planned forwards are plain module attributes, not global hooks; nothing to warn about
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        if how == "blocks":
            for fqn in blocks:
                _compile_in_place(model.get_submodule(fqn), backend)
            return f"{len(blocks)} repeated blocks compiled one by one ({backend})"
        _compile_in_place(model, backend)
        return f"whole model compiled ({backend})"


def _compile_in_place(module: nn.Module, backend: str) -> None:
    """``module.compile()``; for a forward defined in PyTorch itself, compile it through a frame of ours.

    ``Module.compile()`` compiles the module's ``_call_impl``, and Dynamo starts tracing at the first frame
    outside its skip list: for a forward in ``torch.nn`` (``nn.Sequential``, ``nn.TransformerEncoderLayer``) there
    is none, and nothing is compiled: the module runs eagerly, silently. ``torch.compile(module)`` adds a frame
    of its own around such a module (``OptimizedModule``) and does compile it; this does the same without the
    wrapper (module names stay). A planned module's forward is sacplan's (:mod:`sacplan.apply`): compiled as is.
    """
    forward = module.forward
    if not _defined_in_torch(forward):
        module.compile(backend=backend)
        return

    def traced(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    module.forward = torch.compile(traced, backend=backend)  # type: ignore[method-assign]


def _defined_in_torch(fn: Any) -> bool:
    """Whether ``fn`` (a bound method or function) is PyTorch's own code, where Dynamo does not start tracing."""
    module = getattr(getattr(fn, "__func__", fn), "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")
