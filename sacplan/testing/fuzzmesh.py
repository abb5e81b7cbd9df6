"""Differential check of one fuzz model under FSDP2 with mixed precision on 2 real gloo ranks.

The multi-rank twin of :mod:`sacplan.testing.fuzzcheck`. For a :class:`MeshCase` (a
:class:`~sacplan.testing.fuzzmodels.ModelSpec`, a mixed-precision policy, a budget fraction):

1. **Prediction** (this process): ``collect(..., mesh={"dp_shard": 2}, parallelize=...)`` runs rank 0's step on
   PyTorch's fake process group; :func:`shard_model` applies ``fully_shard`` to every top-level child of the
   model's body and then to the root, with the case's ``MixedPrecisionPolicy``. The plan is
   ``solve(tree, lo + f·(hi − lo), fsdp_units=...)`` between the minimum feasible budget ``lo`` and the
   no-checkpointing peak ``hi`` (bytes, for the CPU allocator).
2. **Measurement** (2 spawned gloo ranks, FileStore rendezvous in a temporary folder): each rank builds the
   model (same weights everywhere), applies the plan before ``fully_shard`` (README, "Multi-GPU"; or after it,
   as the case draws), and runs its own batch (:func:`rank_inputs`) without and with the plan: one step whose FLOPs are counted
   (``FlopCounterMode``) and whose local gradient shards and buffers are kept, then the least StepRecorder
   peak of :data:`MEASURED_STEPS` steps (gloo's worker threads free a collective's buffers when they get to
   it, so one step can hold one a little longer than the schedule needs).
3. **Checks per rank** (:func:`mesh_failures`): measured peak within :data:`PEAK_TOLERANCE` of the prediction,
   without and with the plan; local gradient shards and buffers bitwise equal with and without the plan;
   recomputed FLOPs (planned step minus unplanned step) exactly the plan's.

The step is forward, loss, backward, then AdamW's step when the case has an optimizer, and
``zero_grad(set_to_none=True)``; without one (``collect(..., optimizer=False)``, as in
:mod:`sacplan.testing.fuzzcheck`) the activations are more of the peak at fuzz sizes.

Peaks are sacplan's :class:`~sacplan.collector.tracker.StepRecorder` on the real tensors (DTensor local shards,
``resize_`` of FSDP2's buffers; the CPU RNG state ``torch.utils.checkpoint`` stashes registered as it is made),
as the multi-rank tests measure them: the CPU allocator's own events (``torch.profiler``) miss the frees gloo's
worker threads make.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from sacplan.collector.calling import as_inputs, call_model
from sacplan.testing.fuzzmodels import CHECKED, Grammar, ModelSpec, Picker, draw_spec, hypothesis_picker
from sacplan.testing.fuzzmodules import build_model, loss_fn, make_inputs

__all__ = ["MESH_GRAMMAR", "POLICIES", "WORLD_SIZE", "PEAK_TOLERANCE", "MeshCase", "MeshPrediction", "RankResult",
           "InvalidMeshModel", "case_strategy", "check_case", "compute_dtype_step", "draw_case", "measure", "mesh_failures", "mp_policy", "predict", "rank_inputs", "shard_model"]


#: Ranks of the data-parallel mesh ``{"dp_shard": 2}``.
WORLD_SIZE = 2
#: Mixed-precision policies drawn: none (fp32), bf16 parameters with fp32 reduce (torchtitan's default), bf16
#: parameters with bf16 reduce.
POLICIES = ("none", "bf16-fp32", "bf16-bf16")
#: Largest |measured − predicted| / measured per-rank peak accepted.
PEAK_TOLERANCE = 0.01
#: Steps measured per model; the least peak is compared (see the module docstring).
MEASURED_STEPS = 5

#: The grammar drawn here: :data:`~sacplan.testing.fuzzmodels.CHECKED` without the weight tying of two ``Linear``
#: of a feature model (the input stage and a body layer would share one parameter across two ``fully_shard``
#: units, which FSDP2 refuses); a token model's tying stays (embedding and head both live in the root unit).
MESH_GRAMMAR: Grammar = dataclasses.replace(CHECKED, feature_tie=False)


class InvalidMeshModel(Exception):
    """The model's own unplanned step fails (torch refuses it in its compute dtype, e.g. an fp32 BatchNorm running
    mean with bf16 activations): nothing to compare against."""


@dataclass(frozen=True)
class MeshCase:
    """One example: the model, FSDP2's mixed-precision policy (:data:`POLICIES`), the budget fraction
    (0: minimum feasible budget, 1: the no-checkpointing peak) and, under a bf16 policy, whether the parallelize
    function casts the floating-point buffers to the compute dtype (FSDP2 leaves buffers as they are: an fp32
    BatchNorm running mean with bf16 activations is refused by torch, an fp32 attention mask is not).

    ``optimizer``: the step ends with AdamW (``foreach``, sacplan's default) on the local shards, else with
    ``zero_grad`` only; ``reshard``: ``reshard_after_forward`` of the body's units (the root's is FSDP2's own);
    ``order``: the plan applied ``"before"`` or ``"after"`` ``fully_shard``; ``group``: the body's first two
    children are one unit (``fully_shard([a, b])``, as torchtitan groups ``[norm, output]``) when it has two."""

    spec: ModelSpec
    policy: str = "none"
    fraction: float = 0.5
    cast_buffers: bool = False
    optimizer: bool = False
    reshard: bool = True
    order: str = "before"
    group: bool = False


def draw_case(pick: Picker, grammar: Grammar = MESH_GRAMMAR) -> MeshCase:
    """A random :class:`MeshCase`: a model of ``grammar`` (a token model's vocabulary made odd half the time, so
    FSDP2 pads the embedding's dim-0 shards), a policy, a budget fraction in hundredths and the knobs."""
    spec = draw_spec(pick, grammar)
    if spec.vocab and pick.choice((False, True)):
        spec = dataclasses.replace(spec, vocab=spec.vocab - 1)
    policy = pick.choice(POLICIES)
    fraction = pick.integer(0, 100) / 100
    cast = policy != "none" and pick.choice((True, False))
    return MeshCase(spec, policy, fraction, cast_buffers=cast, optimizer=pick.choice((False, True)),
                    reshard=pick.choice((True, False)), order=pick.choice(("before", "after")),
                    group=len(spec.layers) > 1 and pick.choice((False, True)))


def case_strategy(grammar: Grammar = MESH_GRAMMAR) -> Any:
    """A hypothesis strategy of :class:`MeshCase` (hypothesis is imported here: only tests need it)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable[[Any], Any]) -> MeshCase:
        return draw_case(hypothesis_picker(draw), grammar)

    return cases()


def mp_policy(name: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` of a :data:`POLICIES` name (None for ``"none"``).

    Raises:
        ValueError: an unknown name.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes = {"none": None, "bf16-fp32": (torch.bfloat16, torch.float32), "bf16-bf16": (torch.bfloat16, torch.bfloat16)}
    if name not in dtypes:
        raise ValueError(f"unknown mixed-precision policy {name!r}; one of {POLICIES}")
    pair = dtypes[name]
    return None if pair is None else MixedPrecisionPolicy(param_dtype=pair[0], reduce_dtype=pair[1])


def cast_floating_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point buffer of ``model`` in ``dtype`` (in place of the module's attribute)."""
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.to(dtype)


def shard_model(model: nn.Module, mesh: Any, case: MeshCase) -> nn.Module:
    """``fully_shard`` every top-level child of ``model.body`` (the first two together with ``case.group``), then
    the root, on ``mesh`` with the case's policy and ``reshard_after_forward`` (``case.cast_buffers``: the
    floating-point buffers first cast to the policy's compute dtype)."""
    from torch.distributed.fsdp import fully_shard

    kw: dict[str, Any] = {"mesh": mesh}
    mp = mp_policy(case.policy)
    if mp is not None:
        kw["mp_policy"] = mp
        if case.cast_buffers:
            cast_floating_buffers(model, mp.param_dtype)
    children = list(model.body)  # type: ignore[union-attr]
    units: list[Any] = [children[:2]] + children[2:] if case.group and len(children) > 1 else children
    for unit in units:
        fully_shard(unit, reshard_after_forward=case.reshard, **kw)
    fully_shard(model, **kw)
    return model


def rank_inputs(spec: ModelSpec, rank: int) -> Any:
    """Rank ``rank``'s batch: the spec's inputs drawn from a seed of its own (same shapes on every rank)."""
    return make_inputs(dataclasses.replace(spec, seed=spec.seed + 7919 * rank))


def compute_dtype_step(case: MeshCase) -> None:
    """One single-process step of the model in FSDP2's compute dtypes (parameters in the policy's
    ``param_dtype``, floating-point inputs cast to it as the root unit casts them, buffers cast when the case
    says so): a cheap screen for models torch refuses, before any rank is spawned.

    Raises:
        InvalidMeshModel: the step fails.
    """
    from torch.utils._pytree import tree_map

    mp = mp_policy(case.policy)
    model = build_model(case.spec)
    args = as_inputs(rank_inputs(case.spec, 0))
    if mp is not None:
        for p in model.parameters():
            p.data = p.data.to(mp.param_dtype)
        if case.cast_buffers:
            cast_floating_buffers(model, mp.param_dtype)
        args = tree_map(lambda t: t.to(mp.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        args)
    try:
        loss_fn(case.spec)(call_model(model, args), args).backward()
    except RuntimeError as e:
        raise InvalidMeshModel(f"{type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------------------ prediction
@dataclass(frozen=True)
class MeshPrediction:
    """Rank 0's prediction (bytes, FLOPs).

    Attributes:
        lo, hi: minimum feasible budget and the no-checkpointing peak.
        budget: the budget solved for.
        plan: the plan (:class:`~sacplan.plan.Plan`).
    """

    lo: int
    hi: int
    budget: int
    plan: Any

    @property
    def recompute_flops(self) -> int:
        return sum(d.recompute_flops for d in self.plan.decisions)


def predict(case: MeshCase) -> MeshPrediction:
    """Collect rank 0's step on the fake process group and solve at the case's budget fraction."""
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.distributed import unit_modules
    from sacplan.solver import baseline_peak, min_feasible_budget, solve
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes

    spec = case.spec
    stats = collect(lambda: build_model(spec), rank_inputs(spec, 0), device=CPU, loss_fn=loss_fn(spec),
                    optimizer=None if case.optimizer else False, mesh={"dp_shard": WORLD_SIZE},
                    parallelize=lambda m, mesh: shard_model(m, mesh, case))
    tree = ModuleTree(stats)
    units = unit_modules(stats)
    lo, hi = int(min_feasible_budget(tree, fsdp_units=units)), int(baseline_peak(tree))
    budget = lo + round(case.fraction * (hi - lo))
    plan = solve(tree, Bytes(budget), fsdp_units=units)
    return MeshPrediction(lo, hi, budget, plan)


# ------------------------------------------------------------------------------------------ measurement
@dataclass(frozen=True)
class RankResult:
    """One rank's figures (bytes, FLOPs); ``error`` is set instead when the rank failed."""

    rank: int
    plain_peak: int = 0
    planned_peak: int = 0
    plain_where: tuple = ()
    planned_where: tuple = ()
    plain_flops: int = 0
    planned_flops: int = 0
    grads_equal: bool = False
    buffers_equal: bool = False
    error: str = ""
    plain_error: bool = False


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _finish_step(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """The end of a step: the optimizer's (when there is one), then the gradients dropped."""
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)


def _one_step(model: nn.Module, opt: torch.optim.Optimizer | None, spec: ModelSpec, args: Any, seed: int) -> None:
    torch.manual_seed(seed)
    loss_fn(spec)(call_model(model, args), args).backward()
    _finish_step(model, opt)


def _peak(model: nn.Module, opt: torch.optim.Optimizer | None, step: Callable[[], None], args: Any) -> tuple[int, tuple]:
    """StepRecorder peak of ``step()`` on the real tensors (local shards), with the CPU RNG state that
    ``torch.utils.checkpoint`` stashes per region (made outside the dispatcher) registered as it is made."""
    from sacplan.collector.runtime import RuntimeModel
    from sacplan.collector.tracker import StepRecorder
    from sacplan.devices import CPU
    from sacplan.measurement import register_state, rng_states_registered

    rec = StepRecorder(model, CPU, RuntimeModel(CPU))
    with rng_states_registered(rec), rec:
        register_state(rec, model, opt, args)
        step()
        rec.close_segment("other")
    return int(rec.step_peak), tuple(rec.step_peak_where)


def _run(case: MeshCase, mesh: Any, args: Any, plan: Any) -> dict[str, Any]:
    """One model's figures on this rank: FLOPs, gradient shards and buffers of a counted step, least peak."""
    from torch.utils.flop_counter import FlopCounterMode

    from sacplan.apply import apply_plan
    from sacplan.collector.arguments import default_optimizer
    from sacplan.collector.runtime import flop_mapping

    spec = case.spec
    model = build_model(spec)
    if plan is not None and case.order == "before":
        apply_plan(model, plan)
    shard_model(model, mesh, case)
    if plan is not None and case.order == "after":
        apply_plan(model, plan)
    opt = default_optimizer(model.parameters()) if case.optimizer else None
    torch.manual_seed(spec.seed)
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
        loss_fn(spec)(call_model(model, args), args).backward()
    grads = [None if p.grad is None else _local(p.grad).detach().clone() for p in model.parameters()]
    _finish_step(model, opt)
    buffers = [b.detach().clone() for b in model.buffers()]
    peaks = [_peak(model, opt, lambda: _one_step(model, opt, spec, args, spec.seed + 1), args)
             for _ in range(MEASURED_STEPS)]
    peak, where = min(peaks, key=lambda pw: pw[0])
    return dict(flops=fc.get_total_flops(), grads=grads, buffers=buffers, peak=peak, where=where)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def _measure(rank: int, case: MeshCase, plan_dict: dict) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from sacplan.plan import Plan

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp_shard",))
    args = as_inputs(rank_inputs(case.spec, rank))
    try:
        plain = _run(case, mesh, args, None)
    except RuntimeError as e:
        return dict(error=f"unplanned step: {type(e).__name__}: {e}", plain_error=True)
    planned = _run(case, mesh, args, Plan.from_dict(plan_dict))
    return dict(plain_peak=plain["peak"], planned_peak=planned["peak"], plain_where=plain["where"],
                planned_where=planned["where"], plain_flops=plain["flops"], planned_flops=planned["flops"],
                grads_equal=_same(plain["grads"], planned["grads"]),
                buffers_equal=_same(plain["buffers"], planned["buffers"]))


def rank_worker(rank: int, ws: int, rdzv: str, case: MeshCase, plan_dict: dict, q: Any) -> None:
    """One spawned rank (:func:`sacplan.gloo_ranks.spawn_ranks`): join gloo, measure, report, leave."""
    from sacplan.gloo_ranks import join_gloo, report_and_exit

    join_gloo(rank, ws, rdzv)
    report_and_exit(rank, q, lambda: _measure(rank, case, plan_dict))


def measure(case: MeshCase, plan: Any) -> list[RankResult]:
    """Both ranks' figures for ``plan`` (spawned, FileStore in a temporary folder).

    Raises:
        InvalidMeshModel: the unplanned step failed on a rank.
        RuntimeError: a rank died without reporting.
    """
    from sacplan.gloo_ranks import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="sacplan-meshfuzz-") as d:
        reports, died = spawn_ranks(rank_worker, WORLD_SIZE, Path(d) / "rdzv", case, plan.to_dict())
    results = [RankResult(**r) for r in reports]
    if any(r.plain_error for r in results):
        raise InvalidMeshModel("; ".join(r.error for r in results if r.plain_error))
    if len(results) != WORLD_SIZE:
        raise RuntimeError(f"only ranks {[r.rank for r in results]} reported ({died})")
    return results


# ------------------------------------------------------------------------------------------ checks
def mesh_failures(pred: MeshPrediction, results: list[RankResult]) -> list[str]:
    """What did not hold, per rank (empty: every check passed)."""
    out = []
    for r in results:
        if r.error:
            out.append(f"rank {r.rank}: {r.error}")
            continue
        e0 = (r.plain_peak - pred.hi) / r.plain_peak
        e1 = (r.planned_peak - pred.plan.predicted_peak_bytes) / r.planned_peak
        if abs(e0) > PEAK_TOLERANCE:
            out.append(f"rank {r.rank}: unplanned peak off by {e0:+.2%} (measured {r.plain_peak} B at "
                       f"{r.plain_where}, predicted {pred.hi} B)")
        if abs(e1) > PEAK_TOLERANCE:
            out.append(f"rank {r.rank}: planned peak off by {e1:+.2%} (measured {r.planned_peak} B at "
                       f"{r.planned_where}, predicted {pred.plan.predicted_peak_bytes} B)")
        if not r.grads_equal:
            out.append(f"rank {r.rank}: local gradient shards differ with the plan")
        if not r.buffers_equal:
            out.append(f"rank {r.rank}: buffers after the planned step differ (recomputation updated them)")
        measured = r.planned_flops - r.plain_flops
        if measured != pred.recompute_flops:
            out.append(f"rank {r.rank}: recomputed FLOPs {measured} measured, {pred.recompute_flops} predicted")
    return out


def _label(d: Any) -> str:
    return d.fqn if d.saved_ops is None else f"{d.fqn}[{', '.join(map(str, d.saved_ops))}]"


def check_case(case: MeshCase) -> str:
    """Predict, measure on 2 gloo ranks and check; a readable account of the failures ('' when all passed), with
    the case to paste into a regression test.

    Raises:
        InvalidMeshModel: the model's own unplanned step fails (in one process or on the ranks).
    """
    compute_dtype_step(case)
    pred = predict(case)
    results = measure(case, pred.plan)
    fails = mesh_failures(pred, results)
    if not fails:
        return ""
    lines = [f"case = {case!r}",
             f"budget {pred.budget} B (lo {pred.lo}, hi {pred.hi}), checkpointed "
             f"{[_label(d) for d in pred.plan.decisions]}, predicted peak {pred.plan.predicted_peak_bytes} B:"]
    return "\n".join(lines + [f"  - {f}" for f in fails])
