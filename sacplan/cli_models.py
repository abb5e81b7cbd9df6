"""MODEL for the command line: a built-in preset or ``path/to/file.py:factory`` (see :data:`FACTORY_CONTRACT`).

Used by :mod:`sacplan.cli`; :func:`load_model_spec` resolves the name before any slow work so bad arguments
fail fast, and :class:`ModelSpec` collects or builds the model for ``plan``, ``sweep`` and ``validate``.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sacplan.errors import ConfigError, SacplanError

__all__ = ["FACTORY_CONTRACT", "ModelSpec", "UsageError", "is_file_model", "load_model_spec", "parse_factory_output"]


class UsageError(ConfigError):
    """A bad command-line argument (exit code 2)."""


FACTORY_CONTRACT = """\
A file model is path/to/file.py:factory, where factory() takes no arguments and returns
    dict(model=..., inputs=..., loss_fn=..., optimizer=...)
  model      the nn.Module to train (required; build it on the meta device if it is large)
  inputs     one batch: a tensor, a tuple of the forward's positional arguments, or a dict of keyword
             arguments (required; its shapes set batch and sequence length: --batch/--seq do not apply)
  loss_fn    loss_fn(output) -> scalar loss, labels captured from the factory, e.g.
             loss_fn=lambda out: torch.nn.functional.cross_entropy(out, labels)  (optional; default:
             the mean of the output); loss_fn(output, inputs) works too
  optimizer  params -> torch.optim.Optimizer (optional; default AdamW)
The file is imported as `python path/to/file.py` would run it: it may import modules beside it."""

_FACTORY_KEYS = ("model", "inputs", "loss_fn", "optimizer")
_FACTORY_EXAMPLE = "return dict(model=model, inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, y))"


def parse_factory_output(out: Any, label: str) -> tuple[Any, Any, Any, Any]:
    """``(model, inputs, loss_fn, optimizer)`` from what a file model's factory returned.

    The documented form is a dict (:data:`FACTORY_CONTRACT`); a ``(model, inputs[, optimizer])`` tuple is
    accepted too (sacplan 0.1).

    Raises:
        ConfigError: anything else, with the exact form to return.
    """
    import torch

    if isinstance(out, tuple) and 2 <= len(out) <= 3:
        out = dict(zip(("model", "inputs", "optimizer"), out))
    if isinstance(out, torch.nn.Module):
        raise UsageError(
            f"{label} returned a model but no inputs: return a dict with one batch of inputs and the loss, "
            f"e.g. {_FACTORY_EXAMPLE} (see sacplan plan --help)"
        )
    if not isinstance(out, dict):
        raise UsageError(
            f"{label} returned {type(out).__name__}; it must return dict(model=..., inputs=..., loss_fn=..., "
            f"optimizer=...), e.g. {_FACTORY_EXAMPLE}"
        )
    unknown = sorted(set(out) - set(_FACTORY_KEYS))
    if unknown:
        raise UsageError(f"{label} returned unknown keys {unknown}: the keys are {', '.join(_FACTORY_KEYS)}")
    missing = [k for k in ("model", "inputs") if out.get(k) is None]
    if missing:
        raise UsageError(f"{label} returned no {' and no '.join(missing)}: e.g. {_FACTORY_EXAMPLE}")
    if not isinstance(out["model"], torch.nn.Module):
        raise UsageError(f"{label}: 'model' must be a torch.nn.Module, got {type(out['model']).__name__}")
    for k in ("loss_fn", "optimizer"):
        if out.get(k) is not None and not callable(out[k]):
            raise UsageError(f"{label}: {k!r} must be callable, got {type(out[k]).__name__}")
    return out["model"], out["inputs"], out.get("loss_fn"), out.get("optimizer")


# -------------------------------------------------------------------------------------------------------
# Models: presets or path/to/file.py:factory
# -------------------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """What to collect: a preset or a user factory, with the knobs of the fake step.

    Attributes:
        label: name shown in reports.
        preset: the :class:`~sacplan.models.ModelPreset` (or ``None`` for a user factory).
        factory: the user's zero-argument factory (file models).
        overrides: preset config overrides (e.g. ``n_layers``).
    """

    label: str
    preset: Any = None
    factory: Callable[[], Any] | None = None
    overrides: dict[str, Any] | None = None

    def _user(self) -> tuple[Any, Any, Any, Any]:
        """``(model, inputs, loss_fn, optimizer)`` from the factory (see :data:`FACTORY_CONTRACT`)."""
        try:
            out = self.factory()  # type: ignore[misc]
        except SacplanError:
            raise
        except Exception as e:  # the user's factory failed: one line naming it, not their traceback
            raise UsageError(f"{self.label}: the model factory raised {type(e).__name__}: {e}; fix the factory") from e
        return parse_factory_output(out, self.label)

    def collect(self, device: str, *, dtype: str | None, batch: int | None, seq: int | None, progress: Any) -> Any:
        """:func:`sacplan.collector.collect` of this model."""
        from sacplan.collector import collect

        if self.preset is not None:
            p = self.preset
            if not self.overrides:
                return collect(p.name, device=device, dtype=dtype, batch=batch, seq=seq, progress=progress)
            model_fn, inputs_fn = self._preset_fns(batch, seq, dtype)
            return collect(model_fn, inputs_fn, device=device, loss_fn=p.loss_fn, model_name=self.label, progress=progress)
        model, inputs, loss_fn, opt = self._user()
        kw: dict[str, Any] = {}
        if opt is not None:
            kw["optimizer"] = opt
        if loss_fn is not None:
            kw["loss_fn"] = loss_fn
        return collect(model, inputs, device=device, dtype=dtype, model_name=self.label, progress=progress, **kw)

    def _preset_fns(self, batch: int | None, seq: int | None, dtype: str | None) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """``(model_fn, inputs_fn)`` of the preset with this spec's config overrides, built in ``dtype`` by the
        preset's own casting rules (Llama keeps its rotary table fp32); float inputs in ``dtype`` too."""
        from sacplan.collector import parse_dtype

        p, overrides, td = self.preset, dict(self.overrides or {}), parse_dtype(dtype)
        assert p is not None
        fd = td if td is not None and td.is_floating_point else None
        return (lambda: p.build(dtype=td, **overrides)), (lambda: p.example_inputs(batch, seq, dtype=fd))

    def validation_fns(
        self, batch: int | None, seq: int | None, dtype: str | None = None,
    ) -> tuple[Callable[[], Any], Callable[[], Any], Any, Any]:
        """``(model_fn, inputs_fn, loss_fn, optimizer)`` for :func:`sacplan.validation.validate`; a preset is built
        in ``dtype`` as :meth:`collect` builds it (its own casting rules: Llama keeps its rotary table fp32)."""
        if self.preset is not None:
            return (*self._preset_fns(batch, seq, dtype), self.preset.loss_fn, None)
        model, inputs, loss_fn, opt = self._user()
        state = {"first": True}

        def model_fn() -> Any:
            if state["first"]:  # reuse the model built above once, then build fresh ones
                state["first"] = False
                return model
            return self._user()[0]

        return model_fn, (lambda: inputs), loss_fn, opt


def is_file_model(model: str | None) -> bool:
    """Whether MODEL names ``path/to/file.py[:factory]`` rather than a preset."""
    return model is not None and (model.endswith(".py") or (":" in model and model.rsplit(":", 1)[0].endswith(".py")))


def load_model_spec(model: str, *, layers: int | None = None) -> ModelSpec:
    """Resolve MODEL: a preset name or ``path/to/file.py:factory`` (the file is imported with importlib).

    Raises:
        ConfigError: unknown preset, missing file, missing or non-callable factory (exit code 2).
    """
    if is_file_model(model):
        if layers is not None:
            raise UsageError("--layers only applies to presets")
        path_s, _, func = model.rpartition(":") if not model.endswith(".py") else (model, ":", "")
        if not func:
            raise UsageError(f"model {model!r}: name the factory function, e.g. {model}:build_model")
        path = Path(path_s)
        if not path.is_file():
            raise UsageError(f"model file {path_s!r} does not exist")
        name = "_sacplan_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"cannot import {path_s!r} as a Python file")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        # As `python path/to/file.py` does: the file's folder comes first on the import path, so the file can
        # import modules beside it (`from my_mlp import MLP`), at import time or later inside its factory.
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # the user's file failed at import time: a bad MODEL argument (exit 2)
            sys.modules.pop(name, None)
            raise UsageError(
                f"importing {path_s!r} failed: {type(e).__name__}: {e}; fix the file (it is imported as "
                f"`python {path_s}` would run it, with {folder!r} first on the import path)"
            ) from e
        fn = getattr(mod, func, None)
        if fn is None:
            have = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_"))[:8]
            raise UsageError(f"{path_s!r} has no function {func!r} (callables defined there: {', '.join(have) or 'none'})")
        if not callable(fn):
            raise UsageError(f"{path_s}:{func} is not callable")
        return ModelSpec(label=f"{path.name}:{func}", factory=fn)
    from sacplan.models import get_model

    preset = get_model(model)  # ConfigError (exit 2) for unknown names, with suggestions
    if layers is not None:
        if not hasattr(preset.config, "n_layers"):
            raise UsageError(f"--layers does not apply to {preset.name}")
        return ModelSpec(label=f"{preset.name} ({layers} layers)", preset=preset, overrides={"n_layers": int(layers)})
    return ModelSpec(label=preset.name, preset=preset)
