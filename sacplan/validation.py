"""Prove a plan on a real training step: measured vs predicted peak memory, recompute and gradients.

``validate`` builds the model twice from the same seed, runs real training steps without and with the
plan, and reports side by side:

* peak memory — on CUDA ``torch.cuda.max_memory_allocated`` (after ``reset_peak_memory_stats``); on CPU the
  allocator's own memory events from ``torch.profiler`` (kineto ``[memory]`` records, every allocation and
  free in order) added to the bytes live when the step starts, cross-checked with sacplan's tracker run on
  the real tensors;
* recomputed FLOPs — ``FlopCounterMode`` on a step with the plan minus one without, against the plan's
  prediction on this host's stats;
* step time — CUDA events on CUDA (wall time on CPU, reported but not compared with a GPU estimate);
* gradients — the first step's gradients with and without the plan (bitwise, and the largest difference).

Predictions are re-made for *this* host: the model is collected on fake tensors for the host's spec
(exact sizes and the host's attention kernel on CPU; the present GPU's spec on CUDA), and the plan's op
choices are evaluated on those stats with :func:`sacplan.evaluate.predict`.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from sacplan.apply import apply_plan, remove_plan
from sacplan.blocks import repeated_blocks
from sacplan.collector import collect, default_loss, default_optimizer
from sacplan.collector.calling import Inputs, as_inputs, as_loss, call_model
from sacplan.collector.hf import training_without_cache
from sacplan.collector.runtime import flop_mapping
from sacplan.collector.step import TrainStep
from sacplan.compiled_partition import compiled_step
from sacplan.compiled_layout import layout_optimized, region_convolutions, replay_layout
from sacplan.compiled_saves import with_compiled_saves
from sacplan.compiling import compile_choice, compile_model
from sacplan.devices import CPU, DeviceSpec
from sacplan.errors import ConfigError, PlanMismatchError
from sacplan.evaluate import Choice, predict
from sacplan.measurement import live_bytes, measure_step, register_state, state_tensors, tracker_step_peak
from sacplan.tree import ModuleTree
from sacplan.validation_report import Measurement, ValidationReport

__all__ = [
    "Measurement",
    "ValidationReport",
    "validate",
    "plan_choices",
    "measure_step",
    "live_bytes",
    "state_tensors",
    "tracker_step_peak",
    "register_state",
]


def plan_choices(plan: Any) -> dict[str, Choice]:
    """The plan's decisions as :func:`sacplan.evaluate.predict` choices."""
    from sacplan.opnames import saved_op_keys

    out: dict[str, Choice] = {}
    for d in plan.decisions:
        out[d.fqn] = None if d.saved_ops is None else saved_op_keys(d.saved_ops)
    return out


def _rerun_difference(model: nn.Module, args: Inputs, loss: Callable[[Any, Inputs], torch.Tensor], seed: int,
                      grads: list[torch.Tensor | None]) -> float:
    """Largest |difference| between ``grads`` and the same backward run again (same seed): what the device's
    nondeterministic kernels (atomic adds in attention and embedding backward) change on their own. The
    gradients are left as the rerun made them."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss(call_model(model, args), args).backward()
    diffs = [float((p.grad.detach().cpu().float() - g.float()).abs().max())
             for p, g in zip(model.parameters(), grads) if g is not None and p.grad is not None and g.numel()]
    return max(diffs, default=0.0)


def _made_for(plan: Any) -> str:
    name = getattr(plan, "model_name", "") or ""
    return f" ({name})" if name else ""


def _flops(model: nn.Module, args: Inputs, run: "_Step", opt: torch.optim.Optimizer | None) -> int:
    """FLOPs of one forward and backward (of one call of the user's ``train_step``, its optimizer step included: the
    same in both runs)."""
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
        if run.train_step is not None:
            run.train_step(model, args, opt)
        else:
            run.loss(call_model(model, args), args).backward()
    if run.train_step is None:
        model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


@dataclass(frozen=True)
class _Step:
    """How :func:`validate`'s real steps run: the built-in step (forward, ``loss``, backward, optimizer step) or
    the user's ``train_step`` (``(model, inputs, optimizer) -> Any``) when given."""

    loss: Callable[..., torch.Tensor]
    train_step: TrainStep | None


def _accumulated_grads(model: nn.Module, fn: Callable[[], Any]) -> list[torch.Tensor | None]:
    """Run ``fn()`` and return each parameter's gradient (``model.parameters()`` order) as it stood after its last
    accumulation during the call, copied to the host (None: no gradient accumulated), whatever ``fn`` does with
    ``.grad`` afterwards (an optimizer step, ``zero_grad``).

    Raises:
        ConfigError: no parameter accumulated a gradient (``fn`` ran no backward).
    """
    params = list(model.parameters())
    grads: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            grads[i] = p.grad.detach().to("cpu", copy=True)  # type: ignore[union-attr]

        return hook

    handles = [p.register_post_accumulate_grad_hook(keep(i)) for i, p in enumerate(params) if p.requires_grad]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    if not grads:
        raise ConfigError("train_step accumulated no gradient into any parameter: it must run the backward "
                          "(loss.backward()) as well as the forward; see validate's train_step")
    return [grads.get(i) for i in range(len(params))]


def _timed(step: Callable[[], None], device: torch.device) -> float:
    """Milliseconds of one call of ``step`` (CUDA-synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _checked_arguments(model_fn: Any, plan: Any, device: str | torch.device | None, compile: Any) -> torch.device:
    """The device :func:`validate` runs on, after a ConfigError for each argument it cannot use."""
    if isinstance(model_fn, nn.Module) or not callable(model_fn):
        raise ConfigError(
            f"validate builds the model twice (with and without the plan), so model_fn must be a factory such as "
            f"lambda: MyModel(config), got {type(model_fn).__name__}"
        )
    if not hasattr(plan, "decisions"):
        raise ConfigError(f"validate needs the Plan to check, got {type(plan).__name__}; load a file with sacplan.load_plan")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("validate(device='cuda') needs a CUDA device; use device='cpu' on this host")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"validate supports cpu and cuda devices, not {dev.type!r}")
    compile_choice(compile, ("any",))  # a bad value fails before the fake step
    return dev


def validate(
    model_fn: Callable[[], nn.Module],
    inputs_fn: Callable[[], Any],
    plan: Any,
    *,
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None | bool = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    grad_rtol: float = 1e-5,
    grad_atol: float = 1e-6,
    timed_steps: int = 3,
    progress: Callable[[str], None] | None = None,
    check_fingerprint: bool = True,
    compile: bool | str = False,
    train_step: TrainStep | None = None,
) -> ValidationReport:
    """Run real steps without and with ``plan`` and compare with the predictions (see module docstring).

    Args:
        model_fn: builds the model (called twice, after ``torch.manual_seed(seed)``, so weights match).
        inputs_fn: builds (or is) the forward's positional arguments (a tuple or one tensor) or keyword arguments (a
            dict) on CPU; moved to ``device``.
        plan: a :class:`~sacplan.plan.Plan` (or anything with ``decisions`` / ``fingerprint``).
        optimizer: factory ``params -> Optimizer`` (default AdamW foreach); ``False`` for none.
        loss_fn: ``(output, inputs) -> scalar`` or ``(output) -> scalar`` (default: mean of floating outputs).
        device: ``"cuda"`` or ``"cpu"`` (default: CUDA when available).
        dtype: cast the model to this dtype.
        grad_rtol, grad_atol: tolerance when gradients are not bitwise equal (nondeterministic kernels). On CUDA the
            baseline's first backward also runs twice: a plan whose difference is at most twice that rerun's
            (``kernel_noise``) matches too.
        timed_steps: steps timed (without the profiler) after the warm-up and measured steps; their median
            is the reported step time.
        progress: called with a short line before each stage (for CLIs: real steps can take minutes).
        check_fingerprint: refuse a plan made for another model (module names or parameter shapes differ)
            before any real step, as :func:`~sacplan.apply.apply_plan` would after them.
        compile: run both steps compiled with Inductor (:mod:`sacplan.compiling`): ``True`` compiles each
            repeated block as torchtitan does (the whole model when it has none), ``"blocks"`` / ``"model"``
            choose. The plan is applied before compiling. The prediction is for the compiled step, without and
            with the plan: a fake step with each compiled region compiled on fake tensors as ``torch.compile``
            compiles it, Inductor's own generated code run without kernels (:mod:`sacplan.compiled_partition`;
            measured on CPU exact to the byte on transformers, conv nets and MLPs). A step whose regions cannot be
            traced that way keeps a bound, with a warning: the eager step (its layout copies replayed where
            Inductor runs convolutions channels-last, :mod:`sacplan.compiled_layout`) with what a planned compiled
            region saves beyond eager (:mod:`sacplan.compiled_saves`). Recomputed FLOPs are not counted (a
            dispatch mode would run the step eagerly), nor is the tracker cross-check; gradients are compared
            within ``grad_rtol`` / ``grad_atol``, and not at all (``grads_compared=False``) when the step draws
            random numbers (dropout): the two compiled graphs draw different ones.
        train_step: ``(model, inputs, optimizer) -> Any`` running forward, backward and optimizer step yourself
            (e.g. the forward and loss under ``torch.autocast``), as :func:`sacplan.collect` takes it, replacing the
            built-in step (``loss_fn`` is then unused) in the fake step and in every real step: the first (its
            gradients, compared, are copied as each parameter's gradient is accumulated, so the step may zero or
            drop them), the measured, timed and FLOP-counted ones. The plan is applied (and the model compiled)
            before. Gradients are left as the step leaves them, as between ``collect``'s two steps. On CUDA the
            rerun measuring the kernels' noise calls it with ``optimizer=None``.

    Raises:
        ConfigError: ``device="cuda"`` without CUDA; a model instead of a factory; no plan; a ``train_step`` that is
            not callable, or whose first real step accumulates no gradient.
        PlanMismatchError: the plan was made for another model (checked after the fake step, before any
            real one).
    """
    dev = _checked_arguments(model_fn, plan, device, compile)
    if train_step is not None and not callable(train_step):
        raise ConfigError(f"train_step must be a callable (model, inputs, optimizer) -> Any running forward, backward "
                          f"and optimizer step, got {type(train_step).__name__}; or leave it out for the built-in step")
    loss = as_loss(loss_fn) if loss_fn is not None else default_loss
    opt_factory = None if optimizer is False else (optimizer or default_optimizer)
    torch.manual_seed(seed)
    raw_inputs = as_inputs(inputs_fn() if callable(inputs_fn) else inputs_fn)

    def build() -> nn.Module:
        torch.manual_seed(seed)
        m = model_fn()
        return m.to(dtype) if dtype is not None else m

    say = progress or (lambda _s: None)
    say(f"predicting for this host ({dev.type}): one fake step")
    host = _host_prediction(build, raw_inputs, plan, dev, opt_factory, loss, check_fingerprint, compile, train_step)
    real = _RealSteps(build, raw_inputs, dev, _Step(loss, train_step), opt_factory, seed, timed_steps, host.how,
                      host.blocks, say)
    base, g0 = real.run(None, check_fingerprint)
    planned, g1 = real.run(plan, check_fingerprint)
    bitwise, max_diff, close = _grad_comparison(g0, g1, grad_rtol, grad_atol, real.noise)
    pred, stats = host.prediction, host.stats
    return ValidationReport(
        host=str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        method=base.method,
        baseline=base,
        planned=planned,
        predicted_baseline_peak_bytes=pred.baseline_peak_bytes,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_recompute_flops=pred.recompute_flops,
        predicted_recompute_ms=pred.recompute_ms,
        predicted_dispatch_ms=pred.dispatch_ms,
        plan_predicted_peak_bytes=getattr(plan, "predicted_peak_bytes", None),
        grads_bitwise_equal=bitwise,
        max_grad_abs_diff=max_diff,
        grads_match=close,
        grads_compared=host.how is None or not any(op.is_random for m in stats.modules for op in m.ops),
        plan_device_name=str(getattr(plan, "device_name", "") or ""),
        timed_steps=max(1, timed_steps),
        compiled=real.compiled[0] if real.compiled else "",
        predicted_baseline_step_ms=None if dev.type == "cpu" else stats.step_ms,
        kernel_noise=real.noise[0] if real.noise else 0.0,
    )


@dataclass(frozen=True)
class _HostPrediction:
    """What :func:`validate` predicts for this host: its stats, the plan's evaluation on them, compile choice."""

    stats: Any
    prediction: Any
    blocks: Any
    how: str | None


def _host_prediction(build: Callable[[], nn.Module], raw_inputs: Inputs, plan: Any, dev: torch.device, opt_factory: Any,
                     loss: Callable[..., torch.Tensor], check_fingerprint: bool, compile: Any,
                     train_step: TrainStep | None) -> _HostPrediction:
    """One fake step for this host's spec and the plan's choices evaluated on it (PlanMismatchError first)."""
    spec: DeviceSpec = CPU if dev.type == "cpu" else DeviceSpec.from_current_cuda()
    fake_kw = {"device": spec, "optimizer": False if opt_factory is None else opt_factory, "loss_fn": loss,
               "train_step": train_step}
    stats = collect(build, raw_inputs, **fake_kw)
    plan_fp = getattr(plan, "fingerprint", None)
    if check_fingerprint and plan_fp and plan_fp != stats.fingerprint:
        raise PlanMismatchError(
            f"this plan was made for another model{_made_for(plan)} (plan fingerprint {plan_fp}, model "
            f"{stats.fingerprint}): module names or parameter shapes differ; no real step was run. Re-plan for this "
            "model, or pass check_fingerprint=False if you changed only something the plan does not depend on."
        )
    blocks = repeated_blocks(stats)
    how = compile_choice(compile, blocks)
    regions = blocks if how == "blocks" else ("",)
    if how is not None:
        stats = _compiled_stats(build, raw_inputs, stats, regions, dev, fake_kw)
    tree = ModuleTree(stats)
    choices = plan_choices(plan)
    missing = [f for f in choices if f not in tree]
    if missing:
        raise PlanMismatchError(f"the plan names modules that did not run in this model's step: {missing[:5]}")
    prediction = predict(tree, choices)
    if how is not None:
        prediction = _compiled_peaks(build, raw_inputs, plan, regions, fake_kw, prediction)
    return _HostPrediction(stats, prediction, blocks, how)


def _compiled_peaks(build: Callable[[], nn.Module], raw_inputs: Inputs, plan: Any, regions: tuple[str, ...],
                    fake_kw: dict[str, Any], bound: Any) -> Any:
    """``bound`` (the plan's evaluation on the compiled stats: upper bounds) with the compiled step's peaks without
    and with the plan (bytes) from fake steps (``collect`` with ``fake_kw``) of the regions compiled as Inductor
    compiles them (:func:`~sacplan.compiled_partition.compiled_step`); a peak whose regions cannot be traced keeps
    its bound, with a warning."""
    peaks: dict[str, int] = {}
    for name, p in (("baseline_peak_bytes", None), ("peak_bytes", plan)):
        if p is not None and not getattr(p, "decisions", ()):
            peaks[name] = peaks.get("baseline_peak_bytes", bound.baseline_peak_bytes)
            continue
        try:
            peaks[name] = compiled_step(build, raw_inputs, regions, p, **fake_kw).peak_bytes
        except Exception as e:  # a region Dynamo or Inductor cannot compile on fakes: the eager-based estimate
            which = "with" if p is not None else "without"
            warnings.warn(f"compiled regions could not be traced for the prediction {which} the plan "
                          f"({type(e).__name__}: {str(e)[:200]}); predicting that step from the eager step "
                          "(an estimate: above the compiled step except for Inductor's own scratch buffers, which it "
                          "cannot see; keep a little headroom)", stacklevel=4)
    return dataclasses.replace(bound, **peaks)


def _region_convolutions(build: Callable[[], nn.Module], regions: Iterable[str]) -> list[tuple[tuple[int, ...], int]]:
    """The 2-D convolutions inside the compiled regions (:func:`~sacplan.compiled_layout.region_convolutions`),
    from a model built on ``meta``."""
    with torch.device("meta"):
        return region_convolutions(build(), regions)


def _compiled_stats(build: Callable[[], nn.Module], raw_inputs: Inputs, stats: Any, regions: tuple[str, ...],
                    dev: torch.device, fake_kw: dict[str, Any]) -> Any:
    """The stats a plan is evaluated on for the step as Inductor compiles it (the bound :func:`_compiled_peaks`
    falls back to): where the compiled regions hold convolutions Inductor runs channels-last on ``dev``, a
    second fake step (``collect`` with ``fake_kw``) with its layout copies replayed (:mod:`sacplan.compiled_layout`);
    and what a planned compiled region saves beyond eager (:mod:`sacplan.compiled_saves`)."""
    replayed = layout_optimized(_region_convolutions(build, regions), dev.type)
    if replayed:
        stats = collect(lambda: replay_layout(build(), regions), raw_inputs, **fake_kw)
    return with_compiled_saves(stats, regions, layout_replayed=replayed)


class _RealSteps:
    """The real steps of :func:`validate` on ``dev``: a fresh model per run, the first step's gradients (kept on
    the host), then the measured, timed and FLOP-counted steps."""

    def __init__(self, build: Callable[[], nn.Module], raw_inputs: Inputs, dev: torch.device, run: _Step,
                 opt_factory: Any, seed: int, timed_steps: int, how: str | None, blocks: Any,
                 say: Callable[[str], None]) -> None:
        self.build, self.raw_inputs, self.dev, self.run_step = build, raw_inputs, dev, run
        self.opt_factory, self.seed, self.timed_steps = opt_factory, seed, timed_steps
        self.how, self.blocks, self.say = how, blocks, say
        self.compiled: list[str] = []
        self.noise: list[float] = []  # CUDA: the baseline's own run-to-run gradient difference

    def run(self, plan: Any, check_fingerprint: bool) -> tuple[Measurement, list[torch.Tensor | None]]:
        """Measurement and first-step gradients without (``plan`` None) or with ``plan``."""
        self.say(f"real steps {'with' if plan is not None else 'without'} the plan: warm-up, measured peak, "
                 f"{self.timed_steps} timed")
        if self.dev.type == "cuda":  # the other run's model may sit in reference cycles: max_memory_allocated would
            gc.collect()  # count it (the host measurement is relative to the step's start)
        model = self.build().to(self.dev)
        model.train()
        if plan is not None:
            apply_plan(model, plan, check_fingerprint=check_fingerprint)  # turns a Hugging Face training cache off
            if self.how is not None:  # after the plan, as torchtitan orders them
                self.compiled.append(compile_model(model, self.how, self.blocks))
            return self.steps(model, True)
        with training_without_cache(model):  # as collect records the step and the planned step runs
            if self.how is not None:
                self.compiled.append(compile_model(model, self.how, self.blocks))
            return self.steps(model, False)

    def first_step(self, model: nn.Module, args: Inputs, opt: torch.optim.Optimizer | None,
                   with_plan: bool) -> list[torch.Tensor | None]:
        """The first step (it creates the optimizer state): its gradients, kept on the host. On CUDA a copy on the
        device would count in the measured steps' max_memory_allocated (one copy per run: a parameter-sized error in
        each measurement). On CUDA without the plan, the backward's own run-to-run difference (:attr:`noise`)."""
        dev, seed, run = self.dev, self.seed, self.run_step
        noise = dev.type == "cuda" and not with_plan
        if run.train_step is not None:
            user = run.train_step
            rerun = None
            if noise:  # the user's step steps the optimizer: the rerun runs first, without it
                torch.manual_seed(seed + 1)
                rerun = _accumulated_grads(model, lambda: user(model, args, None))
                model.zero_grad(set_to_none=True)
            torch.manual_seed(seed + 1)
            grads = _accumulated_grads(model, lambda: user(model, args, opt))
            if rerun is not None:
                self.noise.append(max((float((a.float() - b.float()).abs().max()) for a, b in zip(rerun, grads)
                                       if a is not None and b is not None and a.numel()), default=0.0))
            return grads
        torch.manual_seed(seed + 1)
        run.loss(call_model(model, args), args).backward()
        grads = [p.grad.detach().to("cpu", copy=True) if p.grad is not None else None for p in model.parameters()]
        if noise:
            self.noise.append(_rerun_difference(model, args, run.loss, seed + 1, grads))
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        return grads

    def steps(self, model: nn.Module, with_plan: bool) -> tuple[Measurement, list[torch.Tensor | None]]:
        dev, run, seed = self.dev, self.run_step, self.seed
        args = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, self.raw_inputs)
        opt = self.opt_factory([p for p in model.parameters() if p.requires_grad]) if self.opt_factory else None
        grads = self.first_step(model, args, opt, with_plan)

        def step() -> None:
            torch.manual_seed(seed + 2)
            if run.train_step is not None:
                run.train_step(model, args, opt)
                return
            l = run.loss(call_model(model, args), args)
            l.backward()
            del l
            if opt is not None:
                opt.step()
            model.zero_grad(set_to_none=True)

        if self.how is not None:
            step()  # compiled: a recompilation on the second call (guards on the first) is not measured
        peak, tracker, ms = measure_step(model, args, step, opt, dev, track=self.how is None)
        times = [_timed(step, dev) for _ in range(max(0, self.timed_steps))]
        if times:
            ms = statistics.median(times)
        torch.manual_seed(seed + 3)
        flops = _flops(model, args, run, opt) if self.how is None else None
        if with_plan:
            remove_plan(model)
        method = "torch.cuda.max_memory_allocated" if dev.type == "cuda" else "torch.profiler CPU allocator events + live bytes at step start"
        return Measurement(peak, tracker, ms, flops, method), grads


def _grad_comparison(g0: list[torch.Tensor | None], g1: list[torch.Tensor | None], rtol: float, atol: float,
                     noise: list[float]) -> tuple[bool, float, bool]:
    """(bitwise equal, largest |difference|, match): within ``rtol`` / ``atol``, or on CUDA within twice the
    baseline's own rerun difference (``noise``)."""
    bitwise = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)) for a, b in zip(g0, g1))
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(g0, g1) if a is not None and b is not None and a.numel()]
    close = all(
        (a is None and b is None) or (a is not None and b is not None and torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol))
        for a, b in zip(g0, g1)
    ) or (bool(noise) and 0 < max(diffs, default=0.0) <= 2 * noise[0])
    return bitwise, max(diffs, default=0.0), close
