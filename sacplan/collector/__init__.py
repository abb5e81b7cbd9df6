"""``collect()``: one fake training step of a model → :class:`~sacplan.stats.ModelStats` for a target GPU.

No real memory is allocated: the model and its inputs are fake tensors (``FakeTensorMode``) on the host
CPU; sizes follow the *target* allocator, runtimes the target's roofline (or real timing with
``runtime="benchmark"`` on a CUDA host), and attention saves what the target's fused kernel saves.

The package, in the order :func:`collect` uses it: :mod:`~sacplan.collector.arguments` (argument
normalisation, default optimizer and loss), :mod:`~sacplan.collector.materialise` (model and inputs as fakes),
:mod:`~sacplan.collector.step` (the warm-up and recorded step under :mod:`~sacplan.collector.tracker`'s recorder)
and :mod:`~sacplan.collector.assemble` (the recording → :class:`~sacplan.stats.ModelStats`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

# Public here as well as in their modules: parse_dtype (the CLI imports it from here) and failure_hint.
from sacplan.collector.arguments import OptimizerFactory, default_loss, default_optimizer, optimizer_factory, parse_dtype
from sacplan.collector.assemble import build_stats
from sacplan.collector.calling import as_loss
from sacplan.collector.materialise import ModelArg, build_fake_model, make_inputs
from sacplan.collector.runtime import RuntimeModel
from sacplan.collector.hints import failure_hint  # noqa: F401
from sacplan.collector.step import TrainStep, run_step  # noqa: F401
from sacplan.devices import DeviceSpec, get_device
from sacplan.errors import ConfigError, UnsupportedModelError
from sacplan.stats import ModelStats
from sacplan.tradeoff import DEFAULT_MAX_LINES

__all__ = ["collect", "default_loss", "default_optimizer"]


def collect(
    model: ModelArg,
    inputs: Any = None,
    *,
    device: str | DeviceSpec = "h100",
    optimizer: OptimizerFactory | None | bool = None,
    loss_fn: Callable[[Any, tuple], torch.Tensor] | None = None,
    train_step: TrainStep | None = None,
    dtype: torch.dtype | str | None = None,
    batch: int | None = None,
    seq: int | None = None,
    runtime: str = "roofline",
    model_name: str | None = None,
    max_lines: int = DEFAULT_MAX_LINES,
    progress: Callable[[str], None] | None = None,
    world_size: int = 1,
    fsdp_units: Any = "each block",
    ddp: bool = False,
) -> ModelStats:
    """Run one training step of ``model`` on fake tensors and return its statistics for ``device``.

    Args:
        model: an ``nn.Module`` (a real one is copied as fakes; one on the ``meta`` device is materialised
            in fake mode), a zero-argument factory (called on the ``meta`` device first, so initialisers
            with data-dependent ops never run; falls back to building inside fake mode), or a built-in
            preset name such as ``"llama-7b"`` (see :mod:`sacplan.models`).
        inputs: the forward's positional arguments (a tuple, or one tensor), its keyword arguments (a dict,
            e.g. ``{"input_ids": ids, "labels": ids}``), or a zero-argument factory of either, called inside
            fake mode. Presets make their own from ``batch``/``seq`` when omitted.
        device: target device name (``"h100"``, ``"a100-40gb"``...) or a :class:`DeviceSpec`.
        optimizer: factory ``params -> Optimizer`` (default AdamW, foreach); ``False`` for no optimizer step.
        loss_fn: ``(output, inputs) -> scalar`` or ``(output) -> scalar`` (e.g. ``lambda out: out.loss``;
            decided by the signature, see :mod:`sacplan.collector.calling`); default :func:`default_loss` (presets bring their own).
        train_step: ``(model, inputs, optimizer) -> Any`` running forward, backward and optimizer step
            yourself; replaces the built-in loop (``loss_fn`` is then unused). It runs twice (the first
            creates optimizer state).
        dtype: cast parameters to this dtype (``torch.bfloat16`` or ``"bf16"``).
        batch, seq: example-input sizes for presets.
        runtime: ``"roofline"`` or ``"benchmark"`` (times ops on the CUDA device present).
        model_name: label for reports (defaults to the preset name or class name).
        max_lines: cap on trade-off lines per module before the curve is simplified (chords of its biggest bends).
        progress: called with short status strings (for CLIs on large models).
        world_size: ranks to plan for (simulated: no process group needed). Above 1 the returned stats are
            per rank, through :func:`sacplan.distributed.shard_stats`.
        fsdp_units: FSDP2 units when ``world_size > 1``: ``"each block"`` (repeated blocks + root), a list of
            fqns, or a predicate ``(fqn, ModuleStats) -> bool``.
        ddp: plan for DDP replicas (gradient buckets) instead of FSDP2.

    Returns:
        :class:`ModelStats` of the second step (optimizer state exists), sizes per the target allocator.

    Raises:
        UnknownDeviceError, ConfigError: bad arguments.
        CollectionError: the fake step failed; the message names the module that was running.
    """
    t_start = time.perf_counter()
    say = progress or (lambda s: None)
    spec = get_device(device)
    dtype = parse_dtype(dtype)
    rt = RuntimeModel(spec, runtime)
    preset = None
    if isinstance(model, str):
        from sacplan.models import get_model

        preset = get_model(model)
        model_name = model_name or preset.name
    opt_factory = optimizer_factory(optimizer)
    if isinstance(max_lines, bool) or not isinstance(max_lines, int) or max_lines < 1:
        raise ConfigError(f"max_lines must be an integer >= 1 (trade-off lines per module), got {max_lines!r:.60}")

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    say(f"building {model_name or 'model'} on fake tensors")
    fmodel = build_fake_model(model, preset, fake_mode, dtype)
    model_name = model_name or type(fmodel).__name__
    trainable = [p for p in fmodel.parameters() if p.requires_grad]
    if not trainable and opt_factory is not None:
        raise ConfigError(
            f"{model_name} has no trainable parameters (all requires_grad=False), so there is nothing to optimize: "
            "pass optimizer=False (the backward then needs inputs that require grad), or unfreeze some parameters"
        )
    with fake_mode:
        args = make_inputs(inputs, preset, fake_mode, batch, seq, dtype)
        if loss_fn is None and preset is not None:
            loss_fn = preset.loss_fn
        loss = as_loss(loss_fn) if loss_fn is not None else default_loss
        opt = opt_factory(trainable) if opt_factory else None

    real_inputs = None if callable(inputs) and not isinstance(inputs, torch.Tensor) else inputs
    recorder = run_step(fmodel, args, loss, opt, train_step, spec, rt, fake_mode, real_inputs, say)
    if not recorder.calls:
        raise UnsupportedModelError(f"{model_name}: no module forward ran during the step; is the model called?")
    say("building statistics")
    stats = build_stats(recorder, fmodel, opt, spec, model_name, dtype, args, max_lines)
    meta = dict(stats.meta)
    meta.update(
        torch_version=torch.__version__,
        collect_seconds=round(time.perf_counter() - t_start, 3),
        runtime_mode=runtime,
        host="cpu-fake",
    )
    stats = dataclasses.replace(stats, meta=meta)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if world_size > 1:
        from sacplan.distributed import shard_stats

        stats = shard_stats(stats, world_size, fsdp_units=fsdp_units, mode="ddp" if ddp else "fsdp")
    return stats
