"""Command line interface: ``sacplan plan | sweep | show | devices | validate``.

    sacplan plan                                   # default job: llama-1b, batch 3 x seq 8192, bf16, H100, 80%
    sacplan plan llama-7b --device h100 --budget 60GiB --batch 2 --seq 4096 -o plan.json
    sacplan plan my_model.py:build --device a100-40gb --budget 30GiB
    sacplan sweep llama-7b --points 8 --plot pareto.png
    sacplan show plan.json
    sacplan devices
    sacplan validate llama-tiny --plan plan.json --device cpu

MODEL is a preset name (``sacplan devices`` lists devices; :mod:`sacplan.models` the presets) or
``path/to/file.py:factory`` where ``factory()`` returns a model, ``(model, inputs)`` or
``(model, inputs, optimizer_factory)``.

Budgets: ``60GiB``, ``64.4GB``, ``512MiB``, a plain number of GiB (``60``) or a percentage of the target
device's memory (``80%``, the default).

Exit codes: 0 ok; 2 bad argument (usage, unknown device or preset, unparsable budget, missing factory file
or function); 3 infeasible budget (the message gives the minimum feasible budget); 1 any other sacplan
error. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from sacplan.errors import ConfigError, InfeasibleBudgetError, SacplanError
from sacplan.units import GiB, MiB

__all__ = ["main", "build_parser", "load_model_spec", "ModelSpec", "format_plan"]

#: The job ``sacplan plan`` runs with no MODEL: Llama 3.2 1B shape at batch 3 x 8192 tokens in bf16 on an
#: H100. Its no-checkpointing peak (~84 GiB) does not fit the default budget (80% of the H100's 79.2 GiB
#: = 63.4 GiB) while full checkpointing needs far less (~43 GiB), so the default run shows a real
#: *selective* plan. Collection + solve take a few seconds on a 2-core laptop.
DEFAULT_MODEL = "llama-1b"
DEFAULT_BATCH = 3
DEFAULT_SEQ = 8192
DEFAULT_DTYPE = "bf16"
DEFAULT_DEVICE = "h100"
DEFAULT_BUDGET = "80%"

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3


class _UsageError(ConfigError):
    """A bad command-line argument (exit code 2)."""


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

    def _user(self) -> tuple[Any, Any, Any]:
        out = self.factory()  # type: ignore[misc]
        if isinstance(out, tuple):
            if not 1 <= len(out) <= 3:
                raise _UsageError(f"{self.label}: the factory must return a model, (model, inputs) or "
                                  f"(model, inputs, optimizer_factory), got a tuple of {len(out)}")
            out = tuple(out) + (None,) * (3 - len(out))
            return out[0], out[1], out[2]
        return out, None, None

    def collect(self, device: str, *, dtype: str | None, batch: int | None, seq: int | None, progress: Any) -> Any:
        """:func:`sacplan.collect.collect` of this model."""
        from sacplan.collect import _parse_dtype, collect

        if self.preset is not None:
            p = self.preset
            if not self.overrides:
                return collect(p.name, device=device, dtype=dtype, batch=batch, seq=seq, progress=progress)
            td = _parse_dtype(dtype)
            overrides = dict(self.overrides)
            return collect(
                lambda: p.build(dtype=td, **overrides),
                lambda: p.example_inputs(batch, seq, dtype=td if td is not None and td.is_floating_point else None),
                device=device,
                loss_fn=p.loss_fn,
                model_name=self.label,
                progress=progress,
            )
        model, inputs, opt = self._user()
        kw: dict[str, Any] = {}
        if opt is not None:
            kw["optimizer"] = opt
        return collect(model, inputs, device=device, dtype=dtype, model_name=self.label, progress=progress, **kw)

    def validation_fns(self, batch: int | None, seq: int | None) -> tuple[Callable[[], Any], Callable[[], Any], Any, Any]:
        """``(model_fn, inputs_fn, loss_fn, optimizer)`` for :func:`sacplan.validate.validate`."""
        if self.preset is not None:
            p, ov = self.preset, dict(self.overrides or {})
            return (lambda: p.build(**ov)), (lambda: p.example_inputs(batch, seq)), p.loss_fn, None
        model, inputs, opt = self._user()
        if inputs is None:
            raise _UsageError(f"{self.label}: validate needs inputs; make the factory return (model, inputs)")
        state = {"first": True}

        def model_fn() -> Any:
            if state["first"]:  # reuse the model built above once, then build fresh ones
                state["first"] = False
                return model
            return self._user()[0]

        return model_fn, (lambda: inputs), None, opt


def load_model_spec(model: str, *, layers: int | None = None) -> ModelSpec:
    """Resolve MODEL: a preset name or ``path/to/file.py:factory`` (the file is imported with importlib).

    Raises:
        ConfigError: unknown preset, missing file, missing or non-callable factory (exit code 2).
    """
    if ":" in model and model.rsplit(":", 1)[0].endswith(".py") or model.endswith(".py"):
        if layers is not None:
            raise _UsageError("--layers only applies to presets")
        path_s, _, func = model.rpartition(":") if not model.endswith(".py") else (model, ":", "")
        if not func:
            raise _UsageError(f"model {model!r}: name the factory function, e.g. {model}:build_model")
        path = Path(path_s)
        if not path.is_file():
            raise _UsageError(f"model file {path_s!r} does not exist")
        name = "_sacplan_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise _UsageError(f"cannot import {path_s!r} as a Python file")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # the user's file failed at import time
            raise SacplanError(f"importing {path_s!r} failed: {type(e).__name__}: {e}") from e
        fn = getattr(mod, func, None)
        if fn is None:
            have = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_"))[:8]
            raise _UsageError(f"{path_s!r} has no function {func!r} (callables defined there: {', '.join(have) or 'none'})")
        if not callable(fn):
            raise _UsageError(f"{path_s}:{func} is not callable")
        return ModelSpec(label=f"{path.name}:{func}", factory=fn)
    from sacplan.models import get_model

    preset = get_model(model)  # ConfigError (exit 2) for unknown names, with suggestions
    if layers is not None:
        if not hasattr(preset.config, "n_layers"):
            raise _UsageError(f"--layers does not apply to {preset.name}")
        return ModelSpec(label=f"{preset.name} ({layers} layers)", preset=preset, overrides={"n_layers": int(layers)})
    return ModelSpec(label=preset.name, preset=preset)


# -------------------------------------------------------------------------------------------------------
# Output
# -------------------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    """Bytes in GiB for messages, with MiB added for small values."""
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / GiB:.4g} GiB ({n / MiB:.2f} MiB)"


def format_plan(plan: Any, extra: Sequence[str] = ()) -> str:
    """A readable table of a plan: header numbers, then one row per checkpointed module.

    Sizes are in GiB, or MiB for models whose baseline peak is under 1 GiB.
    """
    uname, u = ("GiB", GiB) if plan.baseline_peak_bytes >= GiB else ("MiB", MiB)
    gap = plan.gap
    solver = (
        f"{plan.solver}: {plan.status}" + (f", gap {100 * gap:.3f}%" if isinstance(gap, float) and math.isfinite(gap) else "")
        if plan.solver
        else plan.status
    )
    step = plan.baseline_step_ms + plan.recompute_ms
    lines = [
        f"SAC plan: {plan.model_name or '<model>'} on {plan.device_name or '<device>'}, world size {plan.world_size}",
        *[f"  {x}" for x in extra],
        f"  budget               {plan.budget_bytes / u:9.3f} {uname}",
        f"  no-AC baseline peak  {plan.baseline_peak_bytes / u:9.3f} {uname}",
        f"  predicted peak       {plan.predicted_peak_bytes / u:9.3f} {uname}  ({plan.saved_bytes / u:.3f} {uname} saved)",
        f"  step                 {step:9.2f} ms   ({plan.baseline_step_ms:.2f} ms + {plan.recompute_ms:.2f} ms "
        f"recompute, {100 * plan.overhead:.1f}% overhead)",
        f"  solver               {solver} (build {plan.build_s:.2f} s, solve {plan.solve_s:.2f} s)",
    ]
    if plan.min_feasible_bytes is not None:
        lines.append(f"  minimum feasible     {plan.min_feasible_bytes / u:9.3f} {uname}")
    if not plan.decisions:
        lines.append("  no module needs checkpointing: the model fits the budget as is")
        return "\n".join(lines)
    w = max(6, *(len(d.fqn or "<root>") for d in plan.decisions))
    lines.append("")
    lines.append(f"  {'module':<{w}}  {'checkpointed':<12}  {'discard %':>9}  {'saved ' + uname:>9}  {'recompute ms':>12}")
    tot_b = tot_ms = 0.0
    for d in plan.decisions:
        kind = "full" if d.full_checkpoint else "selective"
        saved = d.discard_bytes * d.calls
        tot_b += saved
        tot_ms += d.recompute_ms
        lines.append(
            f"  {d.fqn or '<root>':<{w}}  {kind:<12}  {100 * d.discard_ratio:9.1f}  {saved / u:9.3f}  {d.recompute_ms:12.3f}"
        )
    lines.append(f"  {'total (' + str(len(plan.decisions)) + ' modules)':<{w}}  {'':<12}  {'':>9}  {tot_b / u:9.3f}  {tot_ms:12.3f}")
    return "\n".join(lines)


def _devices_table() -> str:
    from sacplan.devices import list_devices

    rows = [("device", "memory GiB", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "alloc round B")]
    for d in list_devices():
        bf16 = d.peak_flops.get("bf16")
        fp32 = d.peak_flops.get("fp32")
        rows.append((
            d.name,
            f"{d.memory_bytes / GiB:.1f}",
            "-" if bf16 is None else f"{bf16 / 1e12:.1f}",
            "-" if fp32 is None else f"{fp32 / 1e12:.1f}",
            f"{d.hbm_bandwidth / 1e9:.0f}",
            str(d.alloc_round_bytes),
        ))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)


def _dump(obj: Any) -> None:
    print(json.dumps(obj, indent=2, allow_nan=False, default=str))


# -------------------------------------------------------------------------------------------------------
# Commands
# -------------------------------------------------------------------------------------------------------
def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    if args.quiet:
        return None
    return lambda s: print(f"sacplan: {s}", file=sys.stderr, flush=True)


def _limit(args: argparse.Namespace) -> dict[str, float]:
    """``--time-limit`` for the API call, when given (else the call's own default: plan 60 s, sweep 60 s in all,
    certify 300 s)."""
    return {} if args.time_limit is None else {"time_limit_s": args.time_limit}


def _one_line_warning(message: Any, category: Any, *_: Any, **__: Any) -> None:
    print(f"sacplan: warning: {_one_line(message)}", file=sys.stderr, flush=True)


def _job(args: argparse.Namespace) -> tuple[ModelSpec, Any, str, dict[str, Any]]:
    """Resolve model/device/budget *before* the (slow) collection, so bad arguments fail fast."""
    from sacplan.devices import get_device
    from sacplan.units import parse_budget

    default_job = args.model is None
    model = DEFAULT_MODEL if default_job else args.model
    batch = args.batch if args.batch is not None else (DEFAULT_BATCH if default_job else None)
    seq = args.seq if args.seq is not None else (DEFAULT_SEQ if default_job else None)
    spec = load_model_spec(model, layers=args.layers)
    dtype = args.dtype if args.dtype is not None else (DEFAULT_DTYPE if spec.preset is not None else None)
    device = get_device(args.device)
    # Parsed here only to fail fast; the *string* goes to solve(), because an int below 1 MiB would be
    # re-read there as GiB (see sacplan.units.parse_budget).
    budget = getattr(args, "budget", None) or DEFAULT_BUDGET
    parse_budget(budget, capacity_bytes=device.memory_bytes)
    if args.world_size is not None and args.world_size < 1:
        raise _UsageError(f"--world-size must be at least 1, got {args.world_size}")
    return spec, device, budget, {"batch": batch, "seq": seq, "dtype": dtype}


def _collect_tree(args: argparse.Namespace, spec: ModelSpec, device: Any, knobs: dict[str, Any]) -> Any:
    from sacplan.tree import ModuleTree

    stats = spec.collect(device, dtype=knobs["dtype"], batch=knobs["batch"], seq=knobs["seq"], progress=_progress(args))
    ws = getattr(args, "world_size", None)
    if ws is not None and ws > 1:
        from sacplan.distributed import shard_stats

        units: Any = "each block"
        if getattr(args, "fsdp_units", None):
            units = [u.strip() for u in args.fsdp_units.split(",") if u.strip()]
        stats = shard_stats(stats, ws, fsdp_units=units, mode="ddp" if getattr(args, "ddp", False) else "fsdp")
    return ModuleTree(stats)


def _collective_lines(tree: Any) -> list[str]:
    """The per-rank collective buffers, as their own line, when the stats are per rank."""
    d = tree.stats.meta.get("distributed")
    if not d:
        return []
    if d.get("mode") == "ddp":
        return [f"DDP x{tree.stats.world_size}: gradient buckets {d.get('gradient_bucket_bytes', 0) / 2**30:.3f} GiB per rank"]
    return [
        f"FSDP2 x{tree.stats.world_size}: sharded state {d.get('sharded_state_bytes', 0) / 2**30:.3f} GiB, "
        f"all-gather + reduce-scatter buffers at the peak {d.get('collective_peak_bytes', 0) / 2**30:.3f} GiB per rank"
    ]


def _describe(knobs: dict[str, Any]) -> str:
    parts = []
    if knobs["batch"] is not None:
        parts.append(f"batch {knobs['batch']}")
    if knobs["seq"] is not None:
        parts.append(f"seq {knobs['seq']}")
    parts.append(f"dtype {knobs['dtype'] or 'as built'}")
    return ", ".join(parts)


def cmd_plan(args: argparse.Namespace) -> int:
    from sacplan.solve import solve

    spec, device, budget, knobs = _job(args)
    tree = _collect_tree(args, spec, device, knobs)
    if not args.quiet:
        print("sacplan: solving", file=sys.stderr, flush=True)
    plan = solve(tree, budget, solver=args.solver, **_limit(args))
    cert = None
    if args.certify:
        from sacplan.solve import certify

        if not args.quiet:
            print("sacplan: certifying (every module a unit, whole save-list fronts)", file=sys.stderr, flush=True)
        cert = certify(tree, plan.budget_bytes, solver=args.solver, **_limit(args))
    if args.output:
        plan.save(args.output)
    if args.json:
        d = plan.to_dict()
        if cert is not None:
            d["certificate"] = dataclasses.asdict(cert)
        _dump(d)
    else:
        print(format_plan(plan, extra=[_describe(knobs)] + _collective_lines(tree)))
        if cert is not None:
            print(f"\nbest possible at this budget: {cert.summary(reference_ms=plan.recompute_ms or None)}"
                  + (" (percentages: of this plan's recompute)" if plan.recompute_ms else ""))
        if args.output:
            print(f"\nplan written to {args.output}")
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    from sacplan.sweep import sweep

    spec, device, _, knobs = _job(args)
    if args.points < 2:
        raise _UsageError(f"--points must be at least 2, got {args.points}")
    budgets = None
    if args.budgets:
        from sacplan.units import parse_budget

        budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
        for b in budgets:
            parse_budget(b, capacity_bytes=device.memory_bytes)  # fail fast on a bad one
    tree = _collect_tree(args, spec, device, knobs)
    if not args.quiet:
        print("sacplan: sweeping budgets", file=sys.stderr, flush=True)
    result = sweep(tree, budgets, points=args.points, solver=args.solver, **_limit(args))
    if args.plot:
        from sacplan.plot import plot_pareto

        plot_pareto(result, path=args.plot)
    if args.json:
        _dump(result.to_dict())
    else:
        print(result.table())
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from sacplan.plan import load_plan

    plan = load_plan(args.plan)
    if args.json:
        _dump(plan.to_dict())
    else:
        print(format_plan(plan))
    return EXIT_OK


def cmd_devices(args: argparse.Namespace) -> int:
    from sacplan.devices import list_devices

    if args.json:
        _dump([d.to_dict() for d in list_devices()])
    else:
        print(_devices_table())
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from sacplan.plan import load_plan
    from sacplan.validate import validate

    spec = load_model_spec(args.model, layers=args.layers)
    plan = load_plan(args.plan)
    model_fn, inputs_fn, loss_fn, opt = spec.validation_fns(args.batch, args.seq)
    kw: dict[str, Any] = {"device": args.device}
    if loss_fn is not None:
        kw["loss_fn"] = loss_fn
    if opt is not None:
        kw["optimizer"] = opt
    report = validate(model_fn, inputs_fn, plan, **kw)
    print(report.summary())
    if not report.grads_match:
        print("sacplan: error: gradients with the plan differ from those without it", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


# -------------------------------------------------------------------------------------------------------
# Parser and entry point
# -------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {s!r}")
    return v


def _model_args(p: argparse.ArgumentParser, *, optional_model: bool) -> None:
    if optional_model:
        p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help=f"preset name or path/to/file.py:factory (default: {DEFAULT_MODEL}, batch {DEFAULT_BATCH}, "
                            f"seq {DEFAULT_SEQ}, {DEFAULT_DTYPE})")
    else:
        p.add_argument("model", metavar="MODEL", help="preset name or path/to/file.py:factory")
    p.add_argument("--device", default=DEFAULT_DEVICE, help="target GPU (see `sacplan devices`; default h100)")
    p.add_argument("--batch", type=_positive_int, default=None, help="batch size (presets)")
    p.add_argument("--seq", type=_positive_int, default=None, help="sequence length (Llama presets)")
    p.add_argument("--dtype", default=None, help="parameter dtype: bf16, fp16, fp32 (default bf16 for presets)")
    p.add_argument("--layers", type=_positive_int, default=None, help="override the preset's number of layers")
    p.add_argument("--world-size", type=_positive_int, default=None,
                   help="ranks (simulated, no process group needed); sizes become per rank (FSDP2 unless --ddp)")
    p.add_argument("--fsdp-units", default=None, metavar="FQN,FQN",
                   help="FSDP2 units (comma-separated module names; default: each repeated block + the root)")
    p.add_argument("--ddp", action="store_true", help="DDP replicas with gradient buckets instead of FSDP2")
    p.add_argument("--solver", choices=("auto", "cbc", "highs"), default="auto",
                   help="MILP back-end (default auto: HiGHS if highspy is installed, else CBC)")
    p.add_argument("--time-limit", type=_positive_float, default=None, metavar="S", help="wall-clock limit of the solve in seconds (default: plan 60, sweep 60 in all, --certify 300); "
                   "stopped there, the best plan found is kept with its proven gap")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sacplan", description="Plan selective activation checkpointing under a memory budget.")
    from sacplan import __version__

    parser.add_argument("--version", action="version", version=f"sacplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("plan", help="collect, solve and print a plan")
    _model_args(p, optional_model=True)
    p.add_argument("--budget", default=None,
                   help="per-GPU memory budget: 60GiB, 64GB, 60 (GiB) or 80%% of the device (default 80%%)")
    p.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="write the plan file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--certify", action="store_true",
                   help="also solve over every plan (every module a unit, whole save-list fronts) and print the "
                        "best possible recompute and a lower bound beside this plan's")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("sweep", help="recompute time versus budget (Pareto front)")
    _model_args(p, optional_model=True)
    p.add_argument("--points", type=int, default=8, help="budgets from minimum feasible to the no-AC peak (default 8)")
    p.add_argument("--budgets", default=None, help="comma-separated budgets instead, e.g. 40GiB,50GiB,60GiB")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="save the Pareto picture (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the sweep as JSON")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("show", help="pretty-print a saved plan file")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("devices", help="list known GPUs")
    p.add_argument("--json", action="store_true", help="print the devices as JSON")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("validate", help="run real steps with and without a plan and compare with the prediction")
    p.add_argument("model", metavar="MODEL", help="preset name or path/to/file.py:factory (keep it small)")
    p.add_argument("--plan", required=True, metavar="PLAN.json")
    p.add_argument("--device", default="cpu", help="where to run the real steps: cpu or cuda (default cpu)")
    p.add_argument("--batch", type=_positive_int, default=None)
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--layers", type=_positive_int, default=None)
    p.set_defaults(func=cmd_validate)
    return parser


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: usage errors (2), --help / --version (0)
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from sacplan.solve.limits import progress_to

    try:
        with warnings.catch_warnings(), progress_to(None if getattr(args, "quiet", False) else sys.stderr):
            warnings.showwarning = _one_line_warning  # no raw Python warning text (file:line, source line)
            return int(args.func(args))
    except InfeasibleBudgetError as e:
        print(
            f"sacplan: error: budget {_gib(e.budget_bytes)} is infeasible; minimum feasible budget is "
            f"{_gib(e.min_feasible_bytes)} (raise --budget, lower --batch/--seq, or raise --world-size)",
            file=sys.stderr,
        )
        return EXIT_INFEASIBLE
    except ConfigError as e:  # unknown device/preset, bad budget, missing factory...
        print(f"sacplan: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except SacplanError as e:
        print(f"sacplan: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as e:  # optional extras (matplotlib for --plot)
        print(f"sacplan: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("sacplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `sacplan devices | head -1`
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
