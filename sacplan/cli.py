"""Command line interface: ``sacplan plan | sweep | show | devices | models | validate``.

    sacplan plan                                   # default job: llama-1b, batch 3 x seq 8192, bf16, H100, 80%
    sacplan plan llama-7b --device h100 --budget 60GiB --batch 2 --seq 4096 -o plan.json
    sacplan plan my_model.py:build --device a100-40gb --budget 30GiB
    sacplan sweep llama-7b --points 8 --plot pareto.png
    sacplan show plan.json
    sacplan devices                                # target GPUs for --device
    sacplan models                                 # built-in presets for MODEL
    sacplan validate llama-tiny --plan plan.json --on cpu [--compile]

MODEL is a preset name (``sacplan models``) or ``path/to/file.py:factory``: see
:data:`sacplan.cli_models.FACTORY_CONTRACT`
(printed by ``sacplan plan --help``). ``--device`` always names the *target* GPU (``sacplan devices``);
``validate --on cpu|cuda`` names the machine the real steps run on.

Budgets: ``60GiB``, ``64.4GB``, ``512MiB``, a plain number of GiB (``60``) or a percentage of the target
device's memory (``80%``, the default).

Exit codes: 0 ok; 2 bad argument (usage, unknown device or preset, unparsable budget, missing factory file
or function, a model file that fails to import); 3 infeasible budget (the message gives the minimum feasible
budget); 1 any other sacplan error; 130 interrupted (Ctrl-C). Errors are one line on stderr, never a traceback; so are warnings (e.g. a budget
above the target device's memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from sacplan.cli_models import FACTORY_CONTRACT, ModelSpec, is_file_model, load_model_spec
from sacplan.cli_mesh import add_mesh_args, check_mesh_args, collect_on_mesh, mesh_requested, shard_for_world_size
from sacplan.cli_models import UsageError as _UsageError
from sacplan.cli_device import devices_table, target_device
from sacplan.errors import ConfigError, InfeasibleBudgetError, PlanMismatchError, SacplanError
from sacplan.units import fmt_bytes

__all__ = ["main", "build_parser", "load_model_spec", "ModelSpec", "format_plan"]

#: The job ``sacplan plan`` runs with no MODEL (the same as ``sacplan plan llama-1b``): Llama 3.2 1B shape at
#: its preset's batch 3 x 8192 tokens in bf16 on an
#: H100. Its no-checkpointing peak (~84 GiB) does not fit the default budget (80% of the H100's 79.2 GiB
#: = 63.4 GiB) while full checkpointing needs far less (~43 GiB), so the default run shows a real
#: *selective* plan. Collection + solve take a few seconds on a 2-core laptop.
DEFAULT_MODEL = "llama-1b"  # its preset defaults: batch 3 x seq 8192
DEFAULT_DTYPE = "bf16"
DEFAULT_DEVICE = "h100"
DEFAULT_BUDGET = "80%"

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3


# -------------------------------------------------------------------------------------------------------
# Output
# -------------------------------------------------------------------------------------------------------
def format_plan(plan: Any, extra: Sequence[str] = ()) -> str:
    """The plan's table, :meth:`sacplan.plan.Plan.summary` (one formatter for the CLI and Python)."""
    return plan.summary(extra)


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


_WARNED: set[str] = set()


def _one_line_warning(message: Any, category: Any, *_: Any, **__: Any) -> None:
    """Print a warning as one line on stderr, once per distinct text."""
    text = _one_line(message)
    if text not in _WARNED:
        _WARNED.add(text)
        print(f"sacplan: warning: {text}", file=sys.stderr, flush=True)


def resolve_job(args: argparse.Namespace) -> tuple[ModelSpec, Any, str, dict[str, Any]]:
    """Resolve model/device/budget *before* the (slow) collection, so bad arguments fail fast."""
    from sacplan.units import parse_budget

    spec = load_model_spec(args.model or DEFAULT_MODEL, layers=args.layers)
    batch, seq = args.batch, args.seq
    if spec.preset is None:
        given = [f for f, v in (("--batch", batch), ("--seq", seq)) if v is not None]
        if given:
            raise _UsageError(
                f"{' and '.join(given)} apply to presets only; a file model's factory makes its own inputs "
                "(return dict(model=..., inputs=...) with the shapes you want)"
            )
    else:  # the preset's defaults, resolved here so the header states them
        batch = spec.preset.default_batch if batch is None else batch
        if spec.preset.default_seq is not None:
            seq = spec.preset.default_seq if seq is None else seq
        elif seq is not None:
            raise _UsageError(f"--seq does not apply to {spec.preset.name} (an image model); use --batch")
    check_mesh_args(args, spec)
    dtype = args.dtype if args.dtype is not None else (DEFAULT_DTYPE if spec.preset is not None else None)
    if getattr(args, "mixed_precision", None):
        dtype = args.mixed_precision  # the compute dtype; the master parameters are fp32
    device = target_device(args.device)
    # Parsed here only to fail fast; the *string* goes to solve(), because an int below 1 MiB would be
    # re-read there as GiB (see sacplan.units.parse_budget).
    budget = getattr(args, "budget", None)
    budget = DEFAULT_BUDGET if budget is None else budget
    parse_budget(budget, capacity_bytes=device.memory_bytes)
    if args.world_size is not None and args.world_size < 1:
        raise _UsageError(f"--world-size must be at least 1, got {args.world_size}")
    return spec, device, budget, {"batch": batch, "seq": seq, "dtype": dtype}


def _collect_tree(args: argparse.Namespace, spec: ModelSpec, device: Any, knobs: dict[str, Any]) -> Any:
    from sacplan.tree import ModuleTree

    if mesh_requested(args):
        return ModuleTree(collect_on_mesh(args, spec, device, knobs, _progress(args)))
    stats = spec.collect(device, dtype=knobs["dtype"], batch=knobs["batch"], seq=knobs["seq"], progress=_progress(args))
    return ModuleTree(shard_for_world_size(stats, args))


def _collective_lines(tree: Any) -> list[str]:
    """The per-rank collective buffers, as their own line, when the stats are per rank."""
    d = tree.stats.meta.get("distributed")
    if not d:
        return []
    if d.get("mode") == "ddp":
        return [f"DDP x{tree.stats.world_size}: gradient buckets {d.get('gradient_bucket_bytes', 0) / 2**30:.3f} GiB per rank"]
    if d.get("mode") == "mesh":
        dims = " x ".join(f"{k} {v}" for k, v in d["mesh"].items())
        return [f"mesh {dims}: rank {d['rank']} of {d['world_size']} (the largest shards), observed on PyTorch's fake "
                "process group; the same plan for every rank"]
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
    from sacplan.solver import solve

    spec, device, budget, knobs = resolve_job(args)
    if getattr(args, "pp", None) is not None:  # one plan per pipeline stage
        from sacplan.pipeline.cli import plan_pipeline

        return plan_pipeline(args, spec, device, budget, knobs)
    tree = _collect_tree(args, spec, device, knobs)
    if not args.quiet:
        print("sacplan: solving", file=sys.stderr, flush=True)
    plan = solve(tree, budget, solver=args.solver, **_limit(args))  # FSDP units: the stats' own (solve's default)
    cert = None
    if args.certify:
        from sacplan.solver import certify

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
            print(f"\nbest possible at this budget: {cert.summary(reference_ms=plan.extra_ms or None)}"
                  + (" (percentages: of this plan's extra step time)" if plan.extra_ms else ""))
        if args.output:
            print(f"\nplan written to {args.output}")
        print("\n" + "\n".join(next_steps(args, plan)))
    return EXIT_OK


def next_steps(args: argparse.Namespace, plan: Any) -> list[str]:
    """What to do with the plan just printed: save it, apply it in training, check it on a real step."""
    model = args.model or DEFAULT_MODEL
    out = args.output or "plan.json"
    lines = ["next:"]
    if not args.output:
        lines.append(f"  save it:      rerun with -o {out}")
    if not plan.decisions:
        lines.append("  nothing to apply: the step fits the budget without checkpointing")
        return lines
    lines.append(f"  apply it:     sacplan.apply_plan(model, sacplan.load_plan({out!r}, model=model)) in your training script")
    lines.append(f"  check it:     sacplan validate {model} --plan {out} --on cuda   (real steps on this machine's GPU; "
                 "--on cpu where the model fits this machine's memory)")
    return lines


def _check_plot_path(path: str) -> None:
    """Fail fast on a ``--plot`` path matplotlib could not write: missing folder or unknown extension."""
    p = Path(path)
    if not p.parent.is_dir():
        raise _UsageError(f"--plot {path!r}: folder {str(p.parent)!r} does not exist; create it or choose another path")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # plot_pareto says how to install it
    kinds = FigureCanvasBase.get_supported_filetypes()
    if p.suffix.lower().lstrip(".") not in kinds:
        raise _UsageError(f"--plot {path!r}: unknown picture type {p.suffix or '(none)'!r}; use one of "
                          f"{', '.join('.' + k for k in sorted(kinds))}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from sacplan.budget_sweep import sweep

    spec, device, _, knobs = resolve_job(args)
    if args.points < 2:
        raise _UsageError(f"--points must be at least 2, got {args.points}")
    budgets = None
    if args.budgets:
        from sacplan.units import parse_budget

        budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
        for b in budgets:
            parse_budget(b, capacity_bytes=device.memory_bytes)  # fail fast on a bad one
    if args.plot:
        _check_plot_path(args.plot)
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
        print(devices_table())
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    from sacplan.models import list_models

    presets = list_models()
    if args.json:
        _dump([{"name": p.name, "description": p.description, "default_batch": p.default_batch,
                "default_seq": p.default_seq} for p in presets])
        return EXIT_OK
    rows = [("model", "default inputs", "description")]
    for p in presets:
        inputs = f"batch {p.default_batch}" + (f" x seq {p.default_seq}" if p.default_seq is not None else "")
        rows.append((p.name, inputs, p.description))
    w = [max(len(r[i]) for r in rows) for i in range(2)]
    print("\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]}" for r in rows))
    print("\nor your own model: path/to/file.py:factory (see `sacplan plan --help`)")
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from sacplan.plan import load_plan
    from sacplan.validation import validate

    if args.device is not None:
        raise _UsageError(
            "validate runs real steps on this machine: use --on cpu or --on cuda (--device names a target GPU; "
            "the plan's target is fixed when it is made)"
        )
    spec = load_model_spec(args.model, layers=args.layers)
    if spec.preset is None and (args.batch is not None or args.seq is not None):
        raise _UsageError("--batch/--seq apply to presets only; a file model's factory makes its own inputs")
    plan = load_plan(args.plan)
    if spec.preset is None and args.dtype is not None:
        raise _UsageError("--dtype applies to presets only; a file model's factory builds it in its own dtype")
    dtype = (args.dtype or DEFAULT_DTYPE) if spec.preset is not None else None  # as `sacplan plan` built it
    model_fn, inputs_fn, loss_fn, opt = spec.validation_fns(args.batch, args.seq, dtype)
    kw: dict[str, Any] = {"device": args.on, "progress": _progress(args), "check_fingerprint": not args.no_fingerprint_check,
                          "compile": args.compile}
    if loss_fn is not None:
        kw["loss_fn"] = loss_fn
    if opt is not None:
        kw["optimizer"] = opt
    try:
        report = validate(model_fn, inputs_fn, plan, **kw)
    except PlanMismatchError as e:
        why = ("module names or parameter shapes differ" if "fingerprint" in str(e) else _one_line(e).rstrip("."))
        force = "" if args.no_fingerprint_check else (
            "; or, if you changed only something the plan does not depend on, add --no-fingerprint-check")
        raise _UsageError(
            f"{args.plan} was made for {plan.model_name or 'another model'} ({len(plan.decisions)} modules "
            f"checkpointed), not {spec.label} ({why}; no real step was run): run `sacplan validate "
            f"{plan.model_name or 'MODEL'} --plan {args.plan}`, or make a plan for this model with "
            f"`sacplan plan {args.model} -o PLAN.json`{force}"
        ) from e
    print(report.summary())
    if report.grads_compared and not report.grads_match:
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
                       help=f"preset name (`sacplan models`) or path/to/file.py:factory (see below; default: "
                            f"{DEFAULT_MODEL}, batch 3, seq 8192, {DEFAULT_DTYPE})")
    else:
        p.add_argument("model", metavar="MODEL", help="preset name (`sacplan models`) or path/to/file.py:factory (see below)")
    p.add_argument("--device", default=DEFAULT_DEVICE, help="target GPU (see `sacplan devices`; default h100)")
    p.add_argument("--batch", type=_positive_int, default=None, help="batch size (presets only; default: the preset's)")
    p.add_argument("--seq", type=_positive_int, default=None, help="sequence length (Llama presets only; default: the preset's)")
    p.add_argument("--dtype", default=None, help="parameter dtype: bf16, fp16, fp32 (default bf16 for presets)")
    p.add_argument("--layers", type=_positive_int, default=None, help="override the preset's number of layers")
    p.add_argument("--world-size", type=_positive_int, default=None,
                   help="ranks (simulated, no process group needed); sizes become per rank (FSDP2 unless --ddp)")
    p.add_argument("--fsdp-units", default=None, metavar="FQN,FQN",
                   help="FSDP2 units (comma-separated module names; default: each repeated block + the root)")
    p.add_argument("--ddp", action="store_true", help="DDP replicas with gradient buckets instead of FSDP2")
    add_mesh_args(p)  # --tp, --dp-shard, --mixed-precision (sacplan.cli_mesh)
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

    p = sub.add_parser("plan", help="collect, solve and print a plan", epilog=FACTORY_CONTRACT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(p, optional_model=True)
    p.add_argument("--budget", default=None,
                   help="per-GPU memory budget: 60GiB, 64GB, 60 (GiB) or 80%% of the device (default 80%%)")
    p.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="write the plan file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--certify", action="store_true",
                   help="also solve over every plan (every module a unit, whole save-list fronts) and print the "
                        "best possible recompute and a lower bound beside this plan's")
    from sacplan.pipeline.cli import add_pipeline_args

    add_pipeline_args(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("sweep", help="recompute time versus budget (Pareto front)", epilog=FACTORY_CONTRACT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
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

    p = sub.add_parser("devices", help="list known target GPUs (for --device)")
    p.add_argument("--json", action="store_true", help="print the devices as JSON")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("models", help="list built-in model presets (for MODEL)")
    p.add_argument("--json", action="store_true", help="print the presets as JSON")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("validate", help="run real steps with and without a plan and compare with the prediction")
    p.add_argument("model", metavar="MODEL", help="preset name or path/to/file.py:factory (keep it small)")
    p.add_argument("--plan", required=True, metavar="PLAN.json")
    p.add_argument("--on", choices=("cpu", "cuda"), default="cpu", help="where to run the real steps (default cpu)")
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)  # refused with a pointer to --on
    p.add_argument("--batch", type=_positive_int, default=None)
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--layers", type=_positive_int, default=None)
    p.add_argument("--dtype", default=None, help="a preset's parameter dtype: the one its plan was made with "
                                                 f"(default {DEFAULT_DTYPE}, as `sacplan plan`)")
    p.add_argument("--compile", nargs="?", const=True, default=False, choices=("blocks", "model"),
                   help="run both steps compiled (torch.compile, Inductor): each repeated block as torchtitan does "
                        "(default), or the whole model ('--compile model'); the plan is applied first")
    p.add_argument("--no-fingerprint-check", action="store_true",
                   help="apply a plan whose model fingerprint (module names, parameter shapes) differs from MODEL's")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
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
    _WARNED.clear()  # once per distinct text within one run of the CLI
    try:
        from sacplan.solver.progress import progress_to  # inside the try: Ctrl-C during imports exits 130 too

        with warnings.catch_warnings(), progress_to(None if getattr(args, "quiet", False) else sys.stderr):
            warnings.showwarning = _one_line_warning  # no raw Python warning text (file:line, source line)
            return int(args.func(args))
    except InfeasibleBudgetError as e:
        smaller = "a smaller batch in your factory's inputs" if is_file_model(getattr(args, "model", None)) else "lower --batch/--seq"
        print(
            f"sacplan: error: budget {fmt_bytes(e.budget_bytes)} is infeasible; minimum feasible budget is "
            f"{fmt_bytes(e.min_feasible_bytes)} (raise --budget, {smaller}, or raise --world-size)",
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
