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
    mp_policy: Any = None,
    mesh: dict[str, int] | None = None,
    parallelize: Callable[[torch.nn.Module, Any], Any] | None = None,
    rank: int | None = None,
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
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for the simulated path (``world_size > 1``): the step is
            collected in its ``param_dtype`` (unless ``dtype`` says otherwise) and the shards are fp32 masters
            (see :func:`sacplan.distributed.shard_stats`). The cast reaches buffers too, which FSDP2 leaves in
            their dtype: for exact figures build the model with bf16 parameters and buffers in their own dtype
            (``preset.build(dtype)`` keeps Llama's rotary table fp32), or use ``mesh``, where FSDP2 itself runs
            (put the policy in your ``parallelize``).
        mesh: ``{dimension name: size}`` of a ``DeviceMesh`` (e.g. ``{"dp_shard": 2, "tp": 2}``): the step runs
            on PyTorch's fake process group as one rank of ``prod(sizes)`` ranks, the model parallelized by
            ``parallelize`` (see :mod:`sacplan.collector.mesh`). ``inputs`` is that rank's batch. The stats are
            that rank's (``world_size`` = the mesh's ranks; solve them as they are).
        parallelize: ``fn(model, device_mesh)`` (your own, e.g. torchtitan's ``parallelize_llama`` or
            :func:`sacplan.models.llama_parallel.parallelize_llama`), run on the ``meta``-built model before it
            is materialised; it may return the model or None.
        rank: which rank of the mesh to collect (default 0: the largest shards where sizes do not divide).

    Returns:
        :class:`ModelStats` of the second step (optimizer state exists), sizes per the target allocator.

    Raises:
        UnknownDeviceError, ConfigError: bad arguments (a real process group already initialised with ``mesh``).
        CollectionError: the fake step failed; the message names the module that was running.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    knobs = dict(device=device, optimizer=optimizer, loss_fn=loss_fn, train_step=train_step, dtype=dtype, batch=batch,
                 seq=seq, runtime=runtime, model_name=model_name, max_lines=max_lines, progress=progress)
    if mesh is None:
        if parallelize is not None or rank is not None:
            raise ConfigError("parallelize= and rank= need mesh= (e.g. mesh={'dp_shard': 2, 'tp': 2})")
        if mp_policy is not None and dtype is None:
            knobs["dtype"] = getattr(mp_policy, "param_dtype", None)
        stats, fmodel = _collect(model, inputs, None, None, **knobs)
    else:
        from sacplan.collector.mesh import check_mesh, fake_mesh, mesh_info

        if world_size != 1 or ddp or mp_policy is not None:
            raise ConfigError("mesh= observes the parallel layout itself: drop world_size=, ddp= and mp_policy= "
                              "(put fully_shard(..., mp_policy=...) in your parallelize function)")
        if parallelize is None or not callable(parallelize):
            raise ConfigError("mesh= needs parallelize=fn, fn(model, device_mesh) applying your parallelism")
        dims, rank = check_mesh(mesh, rank)
        with fake_mesh(dims, rank) as device_mesh:
            stats, fmodel = _collect(model, inputs, device_mesh, parallelize, **knobs)
            info = mesh_info(dims, rank, fmodel)
        return dataclasses.replace(stats, world_size=info["world_size"], meta={**stats.meta, "distributed": info})
    if world_size > 1:
        from sacplan.distributed import shard_stats

        stats = shard_stats(stats, world_size, fsdp_units=fsdp_units, mode="ddp" if ddp else "fsdp",
                            mp_policy=mp_policy, master_dtype=torch.float32 if mp_policy is not None else None,
                            model=fmodel if mp_policy is not None else None)
    return stats


def _collect(
    model: ModelArg, inputs: Any, device_mesh: Any, parallelize: Any, *, device: str | DeviceSpec, optimizer: Any,
    loss_fn: Any, train_step: Any, dtype: Any, batch: int | None, seq: int | None, runtime: str,
    model_name: str | None, max_lines: int, progress: Callable[[str], None] | None,
) -> tuple[ModelStats, torch.nn.Module]:
    """The fake step of :func:`collect` (parallelized by ``parallelize`` on ``device_mesh`` when given) and the
    fake model it ran."""
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
    prepare = None
    if device_mesh is not None:
        from sacplan.collector.mesh import CollectiveFakeMode

        fake_mode = CollectiveFakeMode(allow_non_fake_inputs=True)
        prepare = lambda m: parallelize(m, device_mesh) or m  # noqa: E731
    fmodel = build_fake_model(model, preset, fake_mode, dtype, prepare=prepare)
    # FSDP2 swaps the class for a generated "FSDP<name>" subclass: report the user's class
    model_name = model_name or next(c.__name__ for c in type(fmodel).__mro__ if not c.__name__.startswith("FSDP"))
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
    return dataclasses.replace(stats, meta=meta), fmodel
