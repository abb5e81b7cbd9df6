"""Field-by-field validation of a plan file's ``plan`` object (see ``docs/plan-schema.md``).

:func:`check_plan_body` runs before :meth:`sacplan.plan.Plan.from_dict` when a file is loaded, so a hand-edited
or damaged file is refused with a :class:`~sacplan.errors.PlanError` naming the field and its bad value,
instead of a plan that applies something nobody planned (negative sizes, NaN ratios, unknown ops, a module
listed twice or inside another checkpointed module).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from sacplan.errors import PlanError
from sacplan.fqns import inside

#: Keys of one decision object and of the plan object (``Plan.to_dict``); any other key is refused (typos).
DECISION_KEYS = frozenset(
    {"fqn", "checkpoint", "discard_ratio", "discard_bytes", "recompute_ms", "recompute_flops", "saved_ops", "calls",
     "preserve_rng_state", "dispatch_ms"}
)
PLAN_KEYS = frozenset(
    {
        "schema", "version", "decisions", "budget_bytes", "predicted_peak_bytes", "baseline_peak_bytes",
        "recompute_ms", "baseline_step_ms", "status", "objective_ms", "bound_ms", "gap", "solver", "build_s",
        "solve_s", "world_size", "device_name", "model_name", "fingerprint", "per_module_peak",
        "min_feasible_bytes", "meta",
    }
)
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v: Any, lo: int) -> None:
    if not _is_int(v) or v < lo:
        raise PlanError(f"field {name!r} must be an integer >= {lo}, got {_short(v)}")


def check_version(where: str, v: Any, newest: int) -> None:
    """Raise :class:`PlanError` unless ``v`` is a version this sacplan reads: an integer in ``1..newest``.

    ``where`` names the field in the message (``"plan file 'p.json': field 'version'"``).
    """
    if not _is_int(v) or v < 1:
        raise PlanError(f"{where} must be an integer >= 1, got {_short(v)}")
    if v > newest:
        raise PlanError(f"{where} is {v}, newer than this sacplan supports ({newest}); upgrade sacplan")


def _num(v: Any) -> float | None:
    """A JSON number or one of the strings ``"inf"``, ``"-inf"``, ``"nan"`` as a float; None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:
            return math.inf
    if isinstance(v, str) and v in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[v]
    return None


def _float(name: str, v: Any, ok: Callable[[float], bool], want: str) -> None:
    x = _num(v)
    if x is None or math.isnan(x) or not ok(x):
        raise PlanError(f"field {name!r} must be {want}, got {_short(v)}")


def _finite_nonneg(name: str, v: Any) -> None:
    _float(name, v, lambda x: math.isfinite(x) and x >= 0, "a finite number >= 0")


def _str(name: str, v: Any) -> None:
    if not isinstance(v, str):
        raise PlanError(f"field {name!r} must be a string, got {_short(v)}")


def _unknown_keys(name: str, d: dict[str, Any], allowed: frozenset[str]) -> None:
    extra = sorted(str(k) for k in d if k not in allowed)
    if extra:
        raise PlanError(f"{name} has unknown field(s) {', '.join(map(repr, extra))} (allowed: {', '.join(sorted(allowed))})")


def _check_saved_ops(where: str, ops: Any, resolve: Callable[[str], bool]) -> None:
    if ops is None:
        return
    if not isinstance(ops, list):
        raise PlanError(f"field {where}.saved_ops must be a list of [index, name, occurrence] or null, got {_short(ops)}")
    for j, op in enumerate(ops):
        if not isinstance(op, list) or len(op) != 3:
            raise PlanError(f"field {where}.saved_ops[{j}] must be [index, name, occurrence], got {_short(op)}")
        i, n, o = op
        _int(f"{where}.saved_ops[{j}][0] (index)", i, 0)
        _str(f"{where}.saved_ops[{j}][1] (op name)", n)
        _int(f"{where}.saved_ops[{j}][2] (occurrence)", o, 0)
        if not resolve(n):
            raise PlanError(
                f"field {where}.saved_ops[{j}] names op {n!r}, which this torch does not know; re-plan, or import "
                "the library that defines the op before loading the plan"
            )


def _ancestor(a: str, b: str) -> bool:
    """True when module ``a`` contains module ``b`` (``""`` is the root)."""
    return a != b and inside(b, a)


def check_decisions(decisions: Any, resolve: Callable[[str], bool]) -> None:
    """Validate ``plan.decisions`` (a list of decision objects); see :func:`check_plan_body`."""
    if not isinstance(decisions, list):
        raise PlanError(f"field 'plan.decisions' must be a list, got {_short(decisions)}")
    seen: list[str] = []
    for k, d in enumerate(decisions):
        w = f"plan.decisions[{k}]"
        if not isinstance(d, dict):
            raise PlanError(f"field {w!r} must be an object, got {_short(d)}")
        if "fqn" not in d:
            raise PlanError(f"field {w!r} has no 'fqn'")
        fqn = d["fqn"]
        _str(f"{w}.fqn", fqn)
        w = f"{w} (module {fqn!r})"
        _unknown_keys(w, d, DECISION_KEYS)
        for key in ("discard_ratio", "discard_bytes", "recompute_ms"):
            if key not in d:
                raise PlanError(f"field {w}.{key} is missing")
        for key in ("checkpoint", "preserve_rng_state"):
            if not isinstance(d.get(key, True), bool):
                raise PlanError(f"field {w}.{key} must be true or false, got {_short(d[key])}")
        _float(f"{w}.discard_ratio", d["discard_ratio"], lambda x: 0.0 <= x <= 1.0, "a number in [0, 1]")
        _int(f"{w}.discard_bytes", d["discard_bytes"], 0)
        _finite_nonneg(f"{w}.recompute_ms", d["recompute_ms"])
        _finite_nonneg(f"{w}.dispatch_ms", d.get("dispatch_ms", 0.0))
        _int(f"{w}.recompute_flops", d.get("recompute_flops", 0), 0)
        _int(f"{w}.calls", d.get("calls", 1), 1)
        _check_saved_ops(w, d.get("saved_ops"), resolve)
        for other in seen:
            if other == fqn:
                raise PlanError(f"module {fqn!r} is listed twice in 'plan.decisions'; keep one decision per module")
            if _ancestor(other, fqn) or _ancestor(fqn, other):
                outer, inner = (other, fqn) if _ancestor(other, fqn) else (fqn, other)
                raise PlanError(
                    f"'plan.decisions' checkpoints module {inner!r} inside checkpointed module {outer or '<root>'!r}; "
                    "decisions must not be nested: re-plan"
                )
        seen.append(fqn)


def check_plan_body(body: dict[str, Any], resolve: Callable[[str], bool], plan_version: int) -> None:
    """Validate every field of a plan file's ``plan`` object; raise :class:`PlanError` naming the first bad one.

    Args:
        body: the parsed ``plan`` object.
        resolve: ``op name -> bool``, whether an op name in ``saved_ops`` is known to this torch.
        plan_version: the newest ``plan.version`` this sacplan reads.
    """
    _unknown_keys("'plan'", body, PLAN_KEYS)
    if body.get("schema", "sacplan.plan") != "sacplan.plan":
        raise PlanError(f"field 'plan.schema' must be 'sacplan.plan', got {_short(body.get('schema'))}")
    check_version("field 'plan.version'", body.get("version", plan_version), plan_version)
    check_decisions(body["decisions"], resolve)
    _int("plan.budget_bytes", body["budget_bytes"], 1)
    _int("plan.predicted_peak_bytes", body["predicted_peak_bytes"], 0)
    _int("plan.baseline_peak_bytes", body["baseline_peak_bytes"], 0)
    for key in ("recompute_ms", "baseline_step_ms", "objective_ms", "build_s", "solve_s"):
        _finite_nonneg(f"plan.{key}", body[key])
    _float("plan.bound_ms", body["bound_ms"], lambda x: x < math.inf, "a number or '-inf'")
    _float("plan.gap", body["gap"], lambda x: x >= 0, "a number >= 0 or 'inf'")
    for key in ("status", "solver", "device_name", "model_name", "fingerprint"):
        _str(f"plan.{key}", body[key])
    _int("plan.world_size", body["world_size"], 1)
    pmp = body.get("per_module_peak", {})
    if not isinstance(pmp, dict):
        raise PlanError(f"field 'plan.per_module_peak' must be an object {{module: bytes}}, got {_short(pmp)}")
    for k, x in pmp.items():
        _int(f"plan.per_module_peak[{k!r}]", x, 0)
    mfb = body.get("min_feasible_bytes")
    if mfb is not None:
        _int("plan.min_feasible_bytes", mfb, 1)
    if not isinstance(body.get("meta", {}), dict):
        raise PlanError(f"field 'plan.meta' must be an object, got {_short(body.get('meta'))}")
