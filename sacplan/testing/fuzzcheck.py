"""Differential check of one fuzz model (:mod:`sacplan.testing.fuzzmodels`): sacplan's plans against the model's
own unplanned CPU step.

For a :class:`~sacplan.testing.fuzzmodels.ModelSpec` (built by :mod:`sacplan.testing.fuzzmodules`): one real
unplanned step first (a model torch itself refuses, e.g. an in-place activation overwriting a value its producer's
backward needs, raises :class:`InvalidModel`: not sacplan's concern), then ``collect`` on fakes for the CPU spec
(in the spec's precision and with its optimizer, :func:`step_arguments`), ``min_feasible_budget`` and the no-checkpointing
peak, and for each budget fraction ``f`` the plan ``solve(tree, lo + f·(hi − lo))`` checked by:

* :func:`sacplan.validation.validate` (real CPU steps without and with the plan): gradients bitwise equal,
  measured peak within 1% of the prediction for this host, recomputed FLOPs (``FlopCounterMode``, planned step
  minus unplanned step) exactly the prediction; the prediction equal to the plan's own (same stats) and its
  recomputed FLOPs the sum of the plan's decisions';
* a step of its own with and without the plan: buffers (BatchNorm running statistics, counters) bitwise equal
  after the step — recomputation must not update them twice;
* ``remove_plan``: the module's attributes are back as built, and a following step gives bitwise the gradients
  and buffers of the model that never had a plan (after the optimizer's update of the planned step, if any).

Each step runs as the spec says: in bf16 (``dtype``), or with the forward and loss under CPU bf16 autocast (a
``train_step``), with its optimizer (SGD, AdamW) or none. :func:`check_compiled` validates a model of repeated
blocks with ``compile=True`` instead.

Failures are collected as text (:attr:`BudgetCheck.failures`), not raised, so a caller sees all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sacplan.apply import apply_plan, remove_plan
from sacplan.blocks import repeated_blocks
from sacplan.collector import collect
from sacplan.collector.calling import as_inputs
from sacplan.compiling import compile_model
from sacplan.devices import CPU
from sacplan.solver import min_feasible_budget, solve
from sacplan.testing.fuzzmodels import ModelSpec
from sacplan.testing.fuzzmodules import (build_model, forward_loss, loss_fn, make_inputs, make_optimizer,
                                         model_dtype, train_step)
from sacplan.tree import ModuleTree
from sacplan.units import Bytes
from sacplan.validation import validate

__all__ = ["BudgetCheck", "InvalidModel", "check_compiled", "check_spec", "failures", "step_arguments"]

#: Largest |measured − predicted| / measured peak accepted.
PEAK_TOLERANCE = 0.01
#: Gradients of compiled steps with and without a plan (Inductor may fuse the two graphs differently), per
#: precision: ``(rtol, atol)``.
COMPILED_GRAD_TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (2e-2, 1e-3), "autocast": (2e-2, 1e-3)}


class InvalidModel(Exception):
    """The model's own unplanned step fails (torch refuses the drawn model): nothing to compare against."""


@dataclass(frozen=True)
class BudgetCheck:
    """The checks of one plan (bytes, FLOPs).

    Attributes:
        fraction: where the budget lies between the minimum feasible (0) and the no-checkpointing peak (1).
        budget_bytes: the budget solved for.
        checkpointed: the plan's checkpointed modules, ``fqn`` or ``fqn[saved ops]``.
        failures: what did not hold (empty: every check passed).
        report: :meth:`~sacplan.validation.ValidationReport.summary` of the validation.
    """

    fraction: float
    budget_bytes: int
    checkpointed: tuple[str, ...]
    failures: tuple[str, ...]
    report: str


def _step(model: nn.Module, spec: ModelSpec, seed: int,
          opt: torch.optim.Optimizer | None) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """One real step (:func:`~sacplan.testing.fuzzmodules.forward_loss`, backward, ``opt`` step): (gradients,
    buffers after it); gradients are set to None afterwards."""
    args = as_inputs(make_inputs(spec))
    torch.manual_seed(seed)
    forward_loss(spec, model, args).backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)
    return grads, [b.detach().clone() for b in model.buffers()]


def _built(spec: ModelSpec) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The model of ``spec`` in its dtype, and its optimizer (None without one)."""
    model = build_model(spec)
    dtype = model_dtype(spec)
    if dtype is not None:
        model = model.to(dtype)
    factory = make_optimizer(spec)
    return model, (factory([p for p in model.parameters() if p.requires_grad]) if factory else None)


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
    )


def _attrs(model: nn.Module) -> list[tuple[str, list[str]]]:
    return [(n, sorted(m.__dict__)) for n, m in model.named_modules()]


def _own_steps(spec: ModelSpec, plan: Any) -> list[str]:
    """Buffers after a step with the plan, and the model after ``remove_plan``, against a model never planned
    (the optimizer, if any, steps after each: the step after ``remove_plan`` starts from the planned step's
    update)."""
    out = []
    ref, ref_opt = _built(spec)
    fresh_attrs = _attrs(ref)
    g1, b1 = _step(ref, spec, 11, ref_opt)
    g2, b2 = _step(ref, spec, 12, ref_opt)
    model, opt = _built(spec)
    model = apply_plan(model, plan)
    pg1, pb1 = _step(model, spec, 11, opt)
    if not _same(g1, pg1):
        out.append("gradients of the planned step differ (own step)")
    if not _same(b1, pb1):
        out.append("buffers after the planned step differ from the unplanned step's (recomputation updated them)")
    remove_plan(model)
    if _attrs(model) != fresh_attrs:
        out.append("remove_plan left module attributes different from a freshly built model's")
    rg2, rb2 = _step(model, spec, 12, opt)
    if not (_same(g2, rg2) and _same(b2, rb2)):
        out.append("after remove_plan, a step's gradients or buffers differ from the never-planned model's")
    return out


def step_arguments(spec: ModelSpec) -> dict[str, Any]:
    """The keyword arguments of ``collect`` and ``validate`` for how ``spec`` trains: ``optimizer``, ``dtype``, and
    ``train_step`` (forward and loss under autocast) for ``"autocast"`` or ``loss_fn`` otherwise."""
    kw: dict[str, Any] = {"optimizer": make_optimizer(spec), "dtype": model_dtype(spec)}
    if spec.precision == "autocast":
        kw["train_step"] = train_step(spec)
    else:
        kw["loss_fn"] = loss_fn(spec)
    return kw


def _check_plan(spec: ModelSpec, plan: Any) -> tuple[list[str], str]:
    out: list[str] = []
    rep = validate(lambda: build_model(spec), lambda: make_inputs(spec), plan, device="cpu", seed=spec.seed,
                   timed_steps=0, **step_arguments(spec))
    if not rep.grads_bitwise_equal:
        out.append(f"gradients not bitwise equal (max |diff| {rep.max_grad_abs_diff:.3g})")
    if abs(rep.peak_error) > PEAK_TOLERANCE:
        out.append(f"planned peak off by {rep.peak_error:+.2%} ({rep.planned.peak_bytes - rep.predicted_peak_bytes:+d} B)")
    if abs(rep.baseline_peak_error) > PEAK_TOLERANCE:
        out.append(f"unplanned peak off by {rep.baseline_peak_error:+.2%} "
                   f"({rep.baseline.peak_bytes - rep.predicted_baseline_peak_bytes:+d} B)")
    if rep.measured_recompute_flops != rep.predicted_recompute_flops:
        out.append(f"recomputed FLOPs {rep.measured_recompute_flops} measured, {rep.predicted_recompute_flops} predicted")
    if rep.predicted_recompute_flops != sum(d.recompute_flops for d in plan.decisions):
        out.append("validate's re-prediction of recomputed FLOPs differs from the plan's decisions'")
    if rep.predicted_peak_bytes != plan.predicted_peak_bytes:
        out.append(f"validate's predicted peak {rep.predicted_peak_bytes} differs from the plan's {plan.predicted_peak_bytes}")
    return out, rep.summary()


def _label(d: Any) -> str:
    return d.fqn if d.saved_ops is None else f"{d.fqn}[{', '.join(map(str, d.saved_ops))}]"


def _planning_tree(spec: ModelSpec) -> tuple[ModuleTree, int, int]:
    """The model's own unplanned step first (:class:`InvalidModel` when it fails), then its tree collected on fakes
    for the CPU spec, with the minimum feasible budget and the no-checkpointing peak (bytes)."""
    try:
        _step(_built(spec)[0], spec, 0, None)
    except RuntimeError as e:
        raise InvalidModel(str(e)) from e
    stats = collect(lambda: build_model(spec), make_inputs(spec), device=CPU, **step_arguments(spec))
    tree = ModuleTree(stats)
    return tree, int(min_feasible_budget(tree)), int(stats.peak_bytes)


def check_spec(spec: ModelSpec, fractions: tuple[float, ...] = (0.0, 0.5)) -> list[BudgetCheck]:
    """Collect, solve at each budget fraction and check every plan (see the module docstring).

    Raises:
        InvalidModel: the unplanned model's own step fails.
    """
    tree, lo, hi = _planning_tree(spec)
    checks = []
    for f in dict.fromkeys(fractions):
        budget = lo + round(f * (hi - lo))
        plan = solve(tree, Bytes(budget))
        fails, report = _check_plan(spec, plan)
        fails += _own_steps(spec, plan)
        checks.append(BudgetCheck(f, budget, tuple(_label(d) for d in plan.decisions), tuple(fails), report))
    return checks


def check_compiled(spec: ModelSpec, fraction: float) -> BudgetCheck:
    """The plan ``solve`` makes at ``fraction`` (see :func:`check_spec`) from the eager step's stats, validated with
    ``compile=True``: the spec's repeated blocks (a ``list`` container, :func:`~sacplan.testing.fuzzmodels.
    draw_repeated_spec`) compiled one by one with Inductor, without and with the plan. Checked: the blocks were
    compiled; the measured peaks within :data:`PEAK_TOLERANCE` of the prediction for the compiled step where its
    regions were traced on fakes (exact there), and not above the prediction plus that tolerance where they could
    not be (then an upper bound, with a warning); gradients within :data:`COMPILED_GRAD_TOLERANCE` where compared.

    Raises:
        InvalidModel: the unplanned model's own step fails.
    """
    import warnings

    tree, lo, hi = _planning_tree(spec)
    budget = lo + round(fraction * (hi - lo))
    plan = solve(tree, Bytes(budget))
    rtol, atol = COMPILED_GRAD_TOLERANCE[spec.precision]
    # Each model compiles afresh, as in a process of its own: Dynamo would otherwise recompile the block code an
    # earlier example compiled for other shapes with dynamic shapes (where Inductor itself fails on some)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rep = validate(lambda: build_model(spec), lambda: make_inputs(spec), plan, device="cpu", seed=spec.seed,
                           timed_steps=0, compile=True, grad_rtol=rtol, grad_atol=atol, **step_arguments(spec))
        except Exception as e:
            _unplanned_compiled_step(spec, tree.stats)  # InvalidModel where torch cannot compile the model itself
            raise e
    bound = any("could not be traced" in str(w.message) for w in caught)
    out = []
    if "repeated blocks compiled" not in rep.compiled:
        out.append(f"not compiled block by block: {rep.compiled!r}")
    for what, err in (("unplanned", rep.baseline_peak_error), ("planned", rep.peak_error)):
        if err > PEAK_TOLERANCE or (not bound and err < -PEAK_TOLERANCE):
            out.append(f"{what} compiled peak off by {err:+.2%} ({'bound' if bound else 'traced on fakes'})")
    if rep.grads_compared and not rep.grads_match:
        out.append(f"compiled gradients differ beyond rtol {rtol}, atol {atol} (max |diff| {rep.max_grad_abs_diff:.3g})")
    return BudgetCheck(fraction, budget, tuple(_label(d) for d in plan.decisions), tuple(out), rep.summary())


def _unplanned_compiled_step(spec: ModelSpec, stats: Any) -> None:
    """One step of the model without a plan, its repeated blocks compiled as validate compiles them.

    Raises:
        InvalidModel: torch fails on it (an Inductor error compiling the model itself is not sacplan's).
    """
    model, opt = _built(spec)
    try:
        compile_model(model, "blocks", repeated_blocks(stats))
        _step(model, spec, 0, opt)
    except Exception as e:
        raise InvalidModel(f"the unplanned compiled step fails: {type(e).__name__}: {e}") from e


def failures(spec: ModelSpec, checks: list[BudgetCheck]) -> str:
    """A readable account of the failed checks ('' when all passed), with the spec to paste into a test."""
    bad = [c for c in checks if c.failures]
    if not bad:
        return ""
    lines = [f"spec = {spec!r}"]
    for c in bad:
        lines.append(f"budget {c.budget_bytes} B (fraction {c.fraction:.3f}), checkpointed {list(c.checkpointed)}:")
        lines += [f"  - {f}" for f in c.failures]
        lines.append("  " + c.report.replace("\n", "\n  "))
    return "\n".join(lines)
