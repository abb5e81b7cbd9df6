"""One call from model to applied plan, and a ``print(model)`` view of what the plan checkpoints.

    plan = sacplan.fit_to_budget(model, inputs, budget="60GiB", device="h100")   # collect + solve + apply
    print(sacplan.show_plan(model))                                               # print(model), marked

:func:`fit_to_budget` is the counterpart of ``model.gradient_checkpointing_enable()``: instead of
checkpointing every block it checkpoints the least it must (whole modules or selected ops) for the
training step to fit ``budget`` on ``device``. It only composes the public layers
(:func:`sacplan.collector.collect` → :class:`~sacplan.tree.ModuleTree` → :func:`sacplan.solver.solve` →
:func:`sacplan.apply.apply_plan`); use them one by one to keep the stats, sweep budgets or save plans.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn

from sacplan.apply import applied_plan, apply_plan, check_model
from sacplan.collector import collect
from sacplan.devices import DeviceSpec
from sacplan.errors import ConfigError
from sacplan.plan import ModuleDecision, Plan
from sacplan.solver import solve
from sacplan.solver.limits import DEFAULT_SOLVE_S
from sacplan.solver.options import SolverOptions, resolve_options
from sacplan.tree import ModuleTree
from sacplan.units import GiB, MiB

__all__ = ["fit_to_budget", "show_plan"]


def fit_to_budget(
    model: nn.Module,
    inputs: Any,
    *,
    budget: int | float | str = "80%",
    device: str | DeviceSpec,
    loss_fn: Callable[..., Any] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], Any] | None | bool = None,
    train_step: Callable[..., Any] | None = None,
    dtype: Any = None,
    world_size: int = 1,
    fsdp_units: Any = "each block",
    ddp: bool = False,
    solver: str = "auto",
    time_limit_s: float | None = DEFAULT_SOLVE_S,
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    options: SolverOptions | None = None,
) -> Plan:
    """Plan selective activation checkpointing for ``model`` under ``budget`` on ``device`` and apply it.

    Collects one fake training step (no real memory, seconds on a CPU), solves for the cheapest plan
    whose predicted per-rank peak fits ``budget``, applies it to ``model`` in place (reversible with
    :func:`sacplan.remove_plan`) and returns the :class:`~sacplan.plan.Plan` (``plan.save(path)`` to keep
    it, ``print(plan)`` for the table, :func:`show_plan` for the model view).

    Args:
        model: the real ``nn.Module`` you will train (it is copied as fake tensors for the planning step;
            its own parameters are untouched).
        inputs: the forward's positional arguments (one tensor or a tuple), a dict of keyword arguments,
            or a zero-argument factory of them; example shapes of one training step (batch, sequence).
        budget: per-GPU memory budget: bytes (int >= 1 MiB), GiB (small numbers), ``"60GiB"``, ``"64GB"``
            or a share of the device's memory such as ``"80%"`` (the default).
        device: the target GPU the step will run on, e.g. ``"h100"``, ``"a100-40gb"`` (``sacplan devices``
            lists them) or a :class:`~sacplan.devices.DeviceSpec` (``DeviceSpec.from_current_cuda()``).
        loss_fn, optimizer, train_step, dtype, world_size, fsdp_units, ddp, model_name, progress: passed
            to :func:`sacplan.collector.collect` unchanged (``loss_fn`` default: the sum of the output).
        solver, time_limit_s: passed to :func:`sacplan.solver.solve` (``time_limit_s``: seconds, default 60 as
            there; None: no limit); stopped there, the best plan found is applied, its gap in ``plan.gap``.
        options: every solver setting as one :class:`~sacplan.solver.SolverOptions` (instead of ``solver`` and
            ``time_limit_s``).

    Returns:
        The applied plan; an empty plan (``plan.decisions == ()``) when the model fits without checkpointing.

    Raises:
        InfeasibleBudgetError: no plan fits; the message and ``e.min_feasible_bytes`` give the smallest budget.
        UnknownDeviceError, ConfigError, CollectionError: bad arguments or a failing fake step.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"fit_to_budget needs the nn.Module you will train, got {type(model).__name__}; "
            "for presets or factories use sacplan.collect + sacplan.solve + sacplan.apply_plan"
        )
    kw: dict[str, Any] = {}
    if loss_fn is not None:
        kw["loss_fn"] = loss_fn
    if train_step is not None:
        kw["train_step"] = train_step
    stats = collect(
        model,
        inputs,
        device=device,
        optimizer=optimizer,
        dtype=dtype,
        model_name=model_name,
        progress=progress,
        world_size=world_size,
        fsdp_units=fsdp_units,
        ddp=ddp,
        **kw,
    )
    opts = resolve_options(options, dict(solver=solver, time_limit_s=time_limit_s))
    plan = solve(ModuleTree(stats), budget, options=opts)
    apply_plan(model, plan)
    return plan


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _mark(d: ModuleDecision) -> str:
    """The note shown beside a checkpointed module."""
    how = "checkpoint" if d.full_checkpoint else f"selective checkpoint, discard {100 * d.discard_ratio:.0f}%"
    return f"  # <- {how}: frees {_size(d.discard_bytes * d.calls)}, recompute {d.recompute_ms:.3g} ms"


def _render(mod: nn.Module, fqn: str, marks: dict[str, str]) -> list[str]:
    """``repr(mod)`` as lines (like ``nn.Module.__repr__``), with ``marks[fqn]`` after the module's first line."""
    extra = mod.extra_repr()
    head = f"{mod._get_name()}("
    children = list(mod.named_children())
    mark = marks.get(fqn, "")
    if not children:
        return [f"{head}{extra}){mark}"]
    lines = [head + mark]
    if extra:
        lines += ["  " + x for x in extra.split("\n")]
    rendered = [(name, _render(child, f"{fqn}.{name}" if fqn else name, marks)) for name, child in children]
    i = 0
    while i < len(rendered):  # collapse runs of identical children, as torch does for ModuleList
        name, body = rendered[i]
        j = i + 1
        while j < len(rendered) and rendered[j][1] == body and name.isdigit() and rendered[j][0].isdigit():
            j += 1
        first = f"({name}): {body[0]}" if j == i + 1 else f"({name}-{rendered[j - 1][0]}): {j - i} x {body[0]}"
        lines.append("  " + first)
        lines += ["  " + x for x in body[1:]]
        i = j
    lines.append(")")
    return lines


def show_plan(model: nn.Module, plan: Plan | None = None) -> str:
    """``print(model)``'s text with each module the plan checkpoints marked (``# <- checkpoint: ...``).

    Args:
        model: the model (with or without the plan applied).
        plan: the plan to show; default: the plan applied to ``model`` (:func:`sacplan.apply_plan`).

    Raises:
        ConfigError: no plan given and none applied to ``model``.
    """
    check_model(model, "show_plan")
    plan = plan if plan is not None else applied_plan(model)
    if plan is None:
        raise ConfigError("no plan is applied to this model: pass plan=..., or apply one with sacplan.fit_to_budget")
    if not isinstance(plan, Plan):
        raise ConfigError(f"show_plan needs a Plan, got {type(plan).__name__}; load a file with sacplan.load_plan(path)")
    marks = {d.fqn: _mark(d) for d in plan.decisions}
    names = {n for n, _ in model.named_modules()}
    lines = _render(model, "", marks)
    missing = [f for f in marks if f not in names]
    if missing:
        lines.append(f"# not found in this model: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    n = len(plan.decisions)
    lines.append(
        f"# {n} module{'s' if n != 1 else ''} checkpointed: predicted peak {_size(plan.predicted_peak_bytes)} "
        f"of {_size(plan.budget_bytes)} budget ({_size(plan.baseline_peak_bytes)} without), "
        f"+{plan.recompute_ms:.3g} ms recompute per step on {plan.device_name or 'the target'}"
        + (f" (+{plan.dispatch_ms:.3g} ms selective mode)" if plan.dispatch_ms > 0 else "")
    )
    return "\n".join(lines)
