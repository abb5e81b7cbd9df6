"""The result of planning: which modules to checkpoint, how much of each to discard, which ops to save.

A :class:`Plan` is what :func:`sacplan.solver.solve` returns and what ``apply``/``validate``/``export`` read.
Every field is JSON-able through :meth:`Plan.to_dict` / :meth:`Plan.from_dict` (sizes in int bytes,
times in float milliseconds).

Plan files (versioned JSON): :meth:`Plan.save` writes them atomically; :func:`load_plan`, in the section at
the end of this file, reads and validates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from sacplan.errors import ConfigError, PlanError
from sacplan.plancheck import check_plan_body, check_version
from sacplan.stats import Phase
from sacplan.units import fmt_bytes

#: Version of the dict layout produced by :meth:`Plan.to_dict` (2: decisions carry ``dispatch_ms``; version 1 plans
#: read as 0 there, and a sacplan that knows only version 1 says that the plan is newer instead of refusing the key).
PLAN_SCHEMA_VERSION = 2



def peak_advice(phase: str, module: str) -> list[str]:
    """Where a step's no-checkpointing peak sits (``phase``, ``module``: :attr:`ModelStats.peak_phase` and
    ``peak_module``) and, when checkpointing cannot lower it, what would (lines)."""
    label = {Phase.FW: "forward", Phase.BW: "backward", Phase.OTHER: "optimizer step / loss"}.get(phase, phase)
    lines = [f"no-checkpointing peak: {label}" + ("" if phase == Phase.OTHER else f", in {module or '<top level>'}")]
    if phase == Phase.OTHER:
        lines.append(
            "checkpointing cannot lower that peak (no activations are live there): parameters, gradients and "
            "optimizer state are; a fused or 8-bit optimizer, sharding them (FSDP, world_size=N / --world-size N) "
            "or more ranks would"
        )
    return lines


def _ms(x: float) -> str:
    """Milliseconds for people: three significant digits, no ``0.000 ms`` for a small nonzero time."""
    if x == 0:
        return "0 ms"
    if abs(x) >= 100:
        return f"{x:.0f} ms"
    return f"{x:.3g} ms"


def _json_float(x: float) -> float | str:
    """Floats for JSON: inf/nan spelled as strings (JSON has no literal for them)."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _float(x: Any) -> float:
    return float(x)  # float("inf") / float("nan") parse the strings written by _json_float


@dataclass(frozen=True)
class ModuleDecision:
    """How one module is checkpointed.

    Attributes:
        fqn: module name (root ``""``); every listed module is checkpointed, modules not listed are not.
        discard_ratio: fraction of the module's discardable activation bytes (``A``, per call) discarded,
            as realised (``discard_bytes / A``; ≥ the MILP's ratio after op-level rounding).
        discard_bytes: bytes discarded per call, as realised.
        recompute_ms: recomputation time over all calls in one step (op-level value when realised).
        recompute_flops: FLOPs recomputed over all calls in one step.
        saved_ops: ``(index, name, occurrence)`` of the forward ops whose outputs are *saved* under selective
            checkpointing; ``None`` means no op-level policy: a full checkpoint (save nothing) when
            ``discard_ratio == 1``, otherwise a ratio-only decision (``op_level=False``) that ``apply``
            realises itself.
        calls: forward calls of the module per step.
        preserve_rng_state: the region draws random numbers (:attr:`~sacplan.stats.ModuleStats.draws_random`), so
            ``apply`` checkpoints it with ``torch.utils.checkpoint``'s ``preserve_rng_state=True`` (recomputation
            replays the forward's random numbers; the state is stashed per call). False: it draws none, the
            region keeps no RNG state (nothing to replay: the same gradients, see
            :func:`~sacplan.devices.checkpoint_state_bytes`), and a forward that draws random numbers after all
            is refused. Plans without the field read as True.
        dispatch_ms: host time over all calls in one step that the selective-checkpoint mode adds to this region
            beyond plain checkpointing (:mod:`sacplan.sacmode`; 0 for a region ``apply`` runs plain). Plans without
            the field read as 0.
    """

    fqn: str
    discard_ratio: float = 1.0
    discard_bytes: int = 0
    recompute_ms: float = 0.0
    recompute_flops: int = 0
    saved_ops: tuple[tuple[int, str, int], ...] | None = None
    calls: int = 1
    preserve_rng_state: bool = True
    dispatch_ms: float = 0.0

    @property
    def full_checkpoint(self) -> bool:
        """True when nothing is saved inside the module (plain ``torch.utils.checkpoint``)."""
        return self.saved_ops is None and self.discard_ratio >= 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "discard_ratio": self.discard_ratio,
            "discard_bytes": self.discard_bytes,
            "recompute_ms": self.recompute_ms,
            "recompute_flops": self.recompute_flops,
            "saved_ops": None if self.saved_ops is None else [list(op) for op in self.saved_ops],
            "calls": self.calls,
            "preserve_rng_state": self.preserve_rng_state,
            "dispatch_ms": self.dispatch_ms,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModuleDecision":
        try:
            ops = d.get("saved_ops")
            return cls(
                fqn=str(d["fqn"]),
                discard_ratio=float(d["discard_ratio"]),
                discard_bytes=int(d["discard_bytes"]),
                recompute_ms=float(d["recompute_ms"]),
                recompute_flops=int(d.get("recompute_flops", 0)),
                saved_ops=None if ops is None else tuple((int(i), str(n), int(o)) for i, n, o in ops),
                calls=int(d.get("calls", 1)),
                preserve_rng_state=bool(d.get("preserve_rng_state", True)),
                dispatch_ms=float(d.get("dispatch_ms", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"invalid module decision {dict(d)!r}: {e}") from e


@dataclass(frozen=True)
class Plan:
    """A selective activation checkpointing plan for one model, target device, world size and budget.

    Attributes:
        decisions: checkpointed modules in forward pre-order.
        budget_bytes: the memory budget the plan was solved for.
        predicted_peak_bytes: predicted per-rank peak with the plan applied (realised discards).
        baseline_peak_bytes: predicted per-rank peak without checkpointing (same world size).
        recompute_ms: realised extra recomputation per step (sum over decisions); the selective mode's dispatch
            is apart (:attr:`dispatch_ms`).
        baseline_step_ms: estimated step time without checkpointing.
        status: ``"optimal"``, ``"time_limit"`` (best plan found, see ``gap``) or ``"not needed"``.
        objective_ms: the solver's objective: recomputation plus the selective mode's dispatch, ms per step.
        bound_ms: the solver's best lower bound on that objective.
        gap: relative gap ``(objective - bound) / objective`` (0 when proven optimal to tolerance).
        solver: back-end used (``"cbc"``, ``"highs"`` or ``""`` when no solve was needed).
        build_s, solve_s: seconds spent building and solving the MILP(s).
        world_size: ranks the sizes are per.
        device_name, model_name, fingerprint: provenance (the model's :class:`ModelStats`).
        per_module_peak: predicted peak bytes over each module's timeline events with the plan applied.
        min_feasible_bytes: smallest feasible budget when it was computed, else ``None``.
        meta: free-form details (problem sizes, candidate count, solver logs summary, ...).
    """

    decisions: tuple[ModuleDecision, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    recompute_ms: float
    baseline_step_ms: float
    status: str
    objective_ms: float
    bound_ms: float
    gap: float
    solver: str
    build_s: float
    solve_s: float
    world_size: int
    device_name: str
    model_name: str
    fingerprint: str
    per_module_peak: Mapping[str, int] = field(default_factory=dict)
    min_feasible_bytes: int | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decisions", tuple(self.decisions))
        object.__setattr__(self, "per_module_peak", MappingProxyType(dict(self.per_module_peak)))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle / ``copy.deepcopy`` support: the read-only mappings travel as plain dicts."""
        values = tuple(dict(v) if isinstance(v, MappingProxyType) else v for v in (getattr(self, f.name) for f in fields(self)))
        return (type(self), values)

    # -- queries ------------------------------------------------------------------------------------
    def decisions_dict(self) -> dict[str, float]:
        """``{fqn: discard_ratio}`` of checkpointed modules (PyTorch ``sac_milp``'s first return value)."""
        return {d.fqn: d.discard_ratio for d in self.decisions}

    def decision(self, fqn: str) -> ModuleDecision | None:
        for d in self.decisions:
            if d.fqn == fqn:
                return d
        return None

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return tuple(d.fqn for d in self.decisions)

    @property
    def saved_bytes(self) -> int:
        """Peak bytes the plan saves relative to no checkpointing."""
        return self.baseline_peak_bytes - self.predicted_peak_bytes

    @property
    def dispatch_ms(self) -> float:
        """Host ms per step the selective-checkpoint mode adds (sum over decisions, :mod:`sacplan.sacmode`)."""
        return float(sum(d.dispatch_ms for d in self.decisions))

    @property
    def extra_ms(self) -> float:
        """Estimated step time the plan adds: recomputation plus the selective mode's dispatch (ms)."""
        return self.recompute_ms + self.dispatch_ms

    @property
    def overhead(self) -> float:
        """The plan's extra step time (:attr:`extra_ms`) as a fraction of the baseline step time."""
        return self.extra_ms / self.baseline_step_ms if self.baseline_step_ms > 0 else 0.0

    def peak_advice(self) -> list[str]:
        """Where the no-checkpointing peak sits and, when checkpointing cannot lower it, what would (lines).

        Reads ``meta["baseline_peak_at"]`` (``[phase, module]`` of the collected step's peak; phase ``"other"`` is
        the optimizer step or the loss, where every activation is already freed).
        """
        where = self.meta.get("baseline_peak_at")
        if not where:
            return []
        return peak_advice(where[0], where[1])

    def summary(self, extra: Sequence[str] = ()) -> str:
        """A human-readable table of the plan (what ``sacplan plan`` and ``sacplan show`` print).

        Sizes are printed in the unit their magnitude calls for (GiB, MiB, KiB), times in ms with three
        significant digits. ``extra`` lines (e.g. batch and sequence length) go under the title.
        """
        step = self.baseline_step_ms + self.extra_ms
        gap = self.gap
        proved_by = self.meta.get("proved_by")
        name = "tree DP" if proved_by == "tree-dp" else self.solver
        solver = (
            f"{name}: {self.status}" + (f", gap {100 * gap:.3g}%" if math.isfinite(gap) else "")
            + (", proved by LP bounds" if proved_by == "lp" and self.status == "optimal" else "")
            if self.solver
            else self.status
        )
        lines = [
            f"SAC plan: {self.model_name or '<model>'} on {self.device_name or '<device>'}, world size {self.world_size}",
            *[f"  {x}" for x in extra],
            f"  budget               {fmt_bytes(self.budget_bytes)}",
            f"  no-AC baseline peak  {fmt_bytes(self.baseline_peak_bytes)}",
            f"  predicted peak       {fmt_bytes(self.predicted_peak_bytes)}  ({fmt_bytes(self.saved_bytes)} below the no-AC peak)",
            f"  step                 {_ms(step)}  ({_ms(self.baseline_step_ms)} + {_ms(self.recompute_ms)} recompute"
            + (f" + {_ms(self.dispatch_ms)} selective mode" if self.dispatch_ms > 0 else "")
            + f", {100 * self.overhead:.1f}% overhead)",
            f"  solver               {solver} (build {self.build_s:.2f} s, solve {self.solve_s:.2f} s)",
        ]
        if self.min_feasible_bytes is not None:
            lines.append(f"  minimum feasible     {fmt_bytes(self.min_feasible_bytes)}")
        lines += [f"  {line}" for line in self.peak_advice()]
        if not self.decisions:
            lines.append("  no module is checkpointed: the model fits the budget as is")
            return "\n".join(lines)
        w = max(6, *(len(d.fqn or "<root>") for d in self.decisions))
        lines.append("")
        lines.append(f"  {'module':<{w}}  {'calls':>5}  {'discard':>7}  {'freed':>10}  {'recompute':>11}  policy")
        for d in self.decisions:
            policy = "full" if d.full_checkpoint else ("ratio only" if d.saved_ops is None else f"save {len(d.saved_ops)} op(s)")
            lines.append(
                f"  {d.fqn or '<root>':<{w}}  {d.calls:>5}  {100 * d.discard_ratio:6.1f}%  "
                f"{fmt_bytes(d.discard_bytes * d.calls):>10}  {_ms(d.recompute_ms):>11}  {policy}"
            )
        freed = sum(d.discard_bytes * d.calls for d in self.decisions)
        total = f"total ({len(self.decisions)} modules)"
        lines.append(f"  {total:<{w}}  {'':>5}  {'':>7}  {fmt_bytes(freed):>10}  {_ms(self.recompute_ms):>11}")
        lines.append(
            "  freed: what a module drops after its forward (all its calls) until recomputation brings it back in its "
            f"backward; the peak falls by {fmt_bytes(self.saved_bytes)} (above): only what is dropped at the peak's moment counts"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    # -- dict round trip ----------------------------------------------------------------------------
    def to_dict(self, *, timings: bool = True) -> dict[str, Any]:
        """A JSON-able dict (``from_dict`` inverts it). ``timings=False`` writes the wall-clock figures
        (``build_s``, ``solve_s``, ``meta["timing_s"]``) as 0 / absent: what is left is the same, byte for byte, on
        every run and rank that plans the same stats and budget (issue 26)."""
        d: dict[str, Any] = {"schema": "sacplan.plan", "version": PLAN_SCHEMA_VERSION}
        for f in fields(self):
            v = getattr(self, f.name)
            if not timings and f.name in ("build_s", "solve_s"):
                v = 0.0
            elif not timings and f.name == "meta":
                v = {k: x for k, x in v.items() if k != "timing_s"}
            if f.name == "decisions":
                v = [x.to_dict() for x in v]
            elif f.name in ("per_module_peak",):
                v = {k: int(x) for k, x in v.items()}
            elif f.name == "meta":
                v = _jsonable(v)
            elif isinstance(v, float):
                v = _json_float(v)
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan dict must be a mapping (Plan.to_dict()), got {type(d).__name__}")
        if d.get("schema", "sacplan.plan") != "sacplan.plan":
            raise PlanError(f"not a sacplan plan (schema {d.get('schema')!r})")
        check_version("field 'version' of a plan", d.get("version", PLAN_SCHEMA_VERSION), PLAN_SCHEMA_VERSION)
        try:
            mfb = d.get("min_feasible_bytes")
            return cls(
                # Older files may say "checkpoint": true on every decision; a hand-written false drops it.
                decisions=tuple(
                    ModuleDecision.from_dict(x)
                    for x in d["decisions"]
                    if not (isinstance(x, Mapping) and not x.get("checkpoint", True))
                ),
                budget_bytes=int(d["budget_bytes"]),
                predicted_peak_bytes=int(d["predicted_peak_bytes"]),
                baseline_peak_bytes=int(d["baseline_peak_bytes"]),
                recompute_ms=_float(d["recompute_ms"]),
                baseline_step_ms=_float(d["baseline_step_ms"]),
                status=str(d["status"]),
                objective_ms=_float(d["objective_ms"]),
                bound_ms=_float(d["bound_ms"]),
                gap=_float(d["gap"]),
                solver=str(d["solver"]),
                build_s=_float(d["build_s"]),
                solve_s=_float(d["solve_s"]),
                world_size=int(d["world_size"]),
                device_name=str(d["device_name"]),
                model_name=str(d["model_name"]),
                fingerprint=str(d["fingerprint"]),
                per_module_peak={str(k): int(v) for k, v in d.get("per_module_peak", {}).items()},
                min_feasible_bytes=None if mfb is None else int(mfb),
                meta=dict(d.get("meta", {})),
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"invalid plan dict: {e}") from e

    # -- plan files -----------------------------------------------------------------------------------
    def save(self, path: Any) -> Any:
        """Write the plan as versioned JSON at ``path``, atomically (temp file in the same folder + rename).

        The file holds ``{"schema": "sacplan.plan-file", "version", "sacplan_version", "torch_version",
        "created" (UTC ISO 8601), "plan": Plan.to_dict()}``; see ``docs/plan-schema.md``.
        Returns the path written.
        """
        import datetime

        import torch

        import sacplan

        doc = {
            "schema": "sacplan.plan-file",
            "version": PLAN_FILE_VERSION,
            "sacplan_version": sacplan.__version__,
            "torch_version": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "plan": self.to_dict(),
        }
        return write_plan_document(path, doc)


def write_plan_document(path: Any, doc: Mapping[str, Any]) -> Any:
    """Write ``doc`` as indented JSON at ``path``, atomically (temp file in the same folder + rename): the plan
    files' writer (:meth:`Plan.save`, :meth:`sacplan.pipeline.plans.PipelinePlan.save`). Returns the path.

    Raises:
        ConfigError: the path is a folder or cannot be written (the reason named).
    """
    import json
    import os
    import tempfile
    from pathlib import Path

    p = Path(path)
    text = json.dumps(doc, indent=2, allow_nan=False)
    if p.is_dir():
        raise ConfigError(f"cannot write plan file {str(p)!r}: it is a directory; give a file name such as plan.json")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=str(p.parent))
    except OSError as e:  # read-only folder, a regular file in the path, ...
        raise ConfigError(
            f"cannot write plan file {str(p)!r}: {e.strerror or e} (folder {str(p.parent)!r}); choose a writable folder"
        ) from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # as open() would (mkstemp makes 0600)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):  # disk full, destination not replaceable...
            raise ConfigError(f"cannot write plan file {str(p)!r}: {e.strerror or e}") from None
        raise
    return p


def _jsonable(x: Any) -> Any:
    """Mappings/sequences/floats made JSON-safe (tuples become lists, inf/nan strings)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return _json_float(x)
    try:  # numpy scalars
        return _jsonable(x.item())
    except AttributeError:
        return str(x)


# =========================================================================================================
# Loading plan files (load_plan); Plan.save writes them.
# =========================================================================================================

#: Version of the plan *file* envelope written by :meth:`Plan.save`.
PLAN_FILE_VERSION = 1
_REQUIRED = (
    "decisions", "budget_bytes", "predicted_peak_bytes", "baseline_peak_bytes", "recompute_ms", "baseline_step_ms",
    "status", "objective_ms", "bound_ms", "gap", "solver", "build_s", "solve_s", "world_size", "device_name",
    "model_name", "fingerprint",
)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"bare {name} is not JSON (sacplan writes 'inf'/'nan' as strings)")


def known_op(name: str) -> bool:
    """Whether ``name`` (e.g. ``"aten.mm.default"``) is an op overload this torch knows."""
    import torch

    from sacplan.opnames import resolve_op

    try:
        return isinstance(resolve_op(name), torch._ops.OpOverload)
    except Exception:  # odd names can make torch.ops raise anything
        return False


def load_plan(path: Any, model: Any = None) -> Plan:
    """Read a plan file written by :meth:`Plan.save`, validating its schema.

    A pipeline plan file (:meth:`sacplan.pipeline.plans.PipelinePlan.save`) gives its
    :class:`~sacplan.pipeline.plans.PipelinePlan` (``model`` is then not checked: ``apply_plan(stage_module, plan,
    stage=i)`` checks each stage).

    Args:
        path: the JSON file.
        model: optional ``nn.Module``; when given, the plan must match it (fingerprint and module names).
            It may be wrapped (FSDP2 ``fully_shard``, DDP, ``torch.compile``, checkpoint wrappers): the model
            inside must match, as for :func:`~sacplan.apply.apply_plan`.

    Raises:
        PlanError: missing/damaged file, wrong schema, newer version, or an invalid field (named).
        PlanMismatchError: ``model`` given and the plan is for another model (the module or field is named).
    """
    import json
    import os
    from pathlib import Path

    from sacplan.errors import PlanMismatchError

    if not isinstance(path, (str, os.PathLike)) or str(path) == "":
        raise PlanError(f"load_plan needs the path of a plan file (str or pathlib.Path), got {type(path).__name__} {path!r:.60}")
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise PlanError(f"cannot read plan file {str(p)!r}: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"plan file {str(p)!r} is damaged: not UTF-8 text (byte {e.start}); write it with Plan.save") from e
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise PlanError(f"plan file {str(p)!r} is damaged (not valid JSON at line {e.lineno}, column {e.colno}): {e.msg}") from e
    except (ValueError, RecursionError) as e:  # NaN/Infinity literals, absurd nesting
        raise PlanError(f"plan file {str(p)!r} is damaged: {e}") from None
    if isinstance(doc, dict) and doc.get("schema") == "sacplan.plan":
        raise PlanError(
            f"{str(p)!r} holds `sacplan plan --json` output, not a plan file: write plan files with "
            "`sacplan plan ... -o plan.json` (or Plan.save)"
        )
    if isinstance(doc, dict) and doc.get("schema") == "sacplan.pipeline-plan-file":  # every stage of a pipeline
        from sacplan.pipeline.plans import pipeline_document

        return pipeline_document(doc, f"pipeline plan file {str(p)!r}")  # type: ignore[return-value]
    if not isinstance(doc, dict) or doc.get("schema") != "sacplan.plan-file":
        raise PlanError(f"{str(p)!r} is not a sacplan plan file (missing schema 'sacplan.plan-file')")
    check_version(f"plan file {str(p)!r}: field 'version'", doc.get("version"), PLAN_FILE_VERSION)
    body = doc.get("plan")
    if not isinstance(body, dict):
        raise PlanError(f"plan file {str(p)!r}: field 'plan' is missing or not an object")
    for name in _REQUIRED:
        if name not in body:
            raise PlanError(f"plan file {str(p)!r}: field 'plan.{name}' is missing")
    try:
        check_plan_body(body, known_op, PLAN_SCHEMA_VERSION)
    except PlanError as e:
        raise PlanError(f"plan file {str(p)!r}: {e}") from None
    try:
        plan = Plan.from_dict(body)
    except PlanError as e:
        raise PlanError(f"plan file {str(p)!r}: {e}") from e
    if model is not None:
        from sacplan.fingerprint import canonical_names, model_fingerprint

        # names and fingerprint of the model inside any FSDP2 / DDP / torch.compile / checkpoint wrappers
        names = set(canonical_names(model).values())
        missing = [d.fqn for d in plan.decisions if d.fqn not in names]
        if missing:
            raise PlanMismatchError(f"plan file {str(p)!r} checkpoints module {missing[0]!r}, which this model does not have")
        fp = model_fingerprint(model)
        if plan.fingerprint and fp != plan.fingerprint:
            raise PlanMismatchError(
                f"plan file {str(p)!r} was made for another model: field 'fingerprint' is {plan.fingerprint}, "
                f"this model's is {fp} (module names or parameter shapes differ)"
            )
    return plan
