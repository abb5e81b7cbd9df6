"""The usual alternatives to sacplan, built as :class:`~sacplan.plan.Plan` objects for one tree, and a real
CPU measurement of any of them.

Alternatives (all for the same :class:`~sacplan.tree.ModuleTree`):

1. ``no_ac_plan``: no activation checkpointing.
2. ``full_ac_plan``: full checkpointing of every block (the repeated TransformerBlock / residual blocks:
   the non-leaf children, of one module type, of the node with the most such children, see :func:`find_blocks`).
3. ``torchtitan_op_sac_plan``: op-level SAC of every block with torchtitan's fixed save list ("selective op"):
   attention ops are saved, matmuls (``aten.mm``/``addmm``/``bmm``/``_scaled_mm``) are saved except every
   second one (torchtitan counts mms per block and recomputes the even-numbered ones: the 2nd, 4th, ...),
   everything else is recomputed. ``save_list_plan`` saves *all* matmuls and attention.
   ``every_other_block_plan``: full checkpointing of every second block (torchtitan's "selective layer"
   with ``ac_freq=2`` wraps blocks 1, 3, 5, ... counting from 0).
4. ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` (min-cut partitioner,
   backend ``aot_eager`` on CPU): :func:`measure` with ``compile_budget=``; measured only, not a Plan.
5. ``reference_milp_plan``: PyTorch's reference ``torch.distributed._tools.sac_ilp.sac_milp`` on the same
   numbers (``tree.to_torch_module_info()`` → ``parse_module_info``), its ``{fqn: discard ratio}`` realised
   with sacplan's op-level selection (:func:`sacplan.solver.select_ops`).
6. sacplan's own :func:`sacplan.solver.solve` (not built here).

:func:`measure` runs a real CPU training step (forward + backward, no optimizer) and reports the peak
(profiler allocator events, :mod:`sacplan.validation`'s method), the activation bytes saved for backward,
the recomputed FLOPs (``FlopCounterMode`` step minus the step without checkpointing) and the step time.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sacplan.collector.calling import as_inputs, as_loss, call_model
from sacplan.collector.runtime import flop_mapping
from sacplan.evaluate import Choice, predict
from sacplan.opgroups import forced_saves, named_saves
from sacplan.opnames import ATTENTION, op_keys
from sacplan.plan import ModuleDecision, Plan
from sacplan.blocks import repeated_blocks
from sacplan.tree import ModuleTree

__all__ = [
    "MATMULS",
    "find_blocks",
    "plan_from_choices",
    "no_ac_plan",
    "full_ac_plan",
    "every_other_block_plan",
    "save_list_plan",
    "torchtitan_op_sac_plan",
    "torchtitan_choices",
    "reference_milp_plan",
    "measure",
    "h100_ms",
    "COMPILE_BUDGETS",
]

#: Matmul families torchtitan's save list names (``aten.mm`` in practice; the others counted alike).
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._scaled_mm.default")
COMPILE_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2)
#: H100-SXM dense bf16 peak (NVIDIA whitepaper) and the efficiency used to turn FLOPs into ms.
H100_BF16_FLOPS = 989.4e12
H100_EFFICIENCY = 0.75


def h100_ms(flops: float) -> float:
    """Milliseconds ``flops`` take on an H100 at 75 % of the bf16 dense peak."""
    return float(flops) / (H100_BF16_FLOPS * H100_EFFICIENCY) * 1e3


# ------------------------------------------------------------------------------------------ blocks
def find_blocks(tree: ModuleTree) -> list[str]:
    """The repeated blocks (:func:`sacplan.blocks.repeated_blocks`): what the hand-written baselines checkpoint."""
    return list(repeated_blocks(tree.stats))


# ------------------------------------------------------------------------------------------ plans
def plan_from_choices(tree: ModuleTree, choices: Mapping[str, Choice], label: str, budget_bytes: int | None = None) -> Plan:
    """A :class:`Plan` (``apply_plan`` accepts it) realising ``choices`` (fqn → :data:`~sacplan.evaluate.Choice`).

    ``saved_ops`` lists the module's ops (from its :class:`~sacplan.stats.OpStat` list) whose
    ``(family, occurrence)`` key is in the choice; ``None`` choices are full checkpoints.
    """
    pred = predict(tree, choices)
    st = tree.stats
    decisions = []
    outcomes = {o.fqn: o for o in pred.modules}  # what predict evaluated for each module
    for fqn, choice in sorted(choices.items(), key=lambda kv: tree.index_of(kv[0])):
        ms = tree.node(fqn).stats
        out = outcomes[fqn]
        A = ms.tradeoff.max_discard_bytes if ms.tradeoff is not None else 0
        d0 = out.discard_bytes[0] if out.discard_bytes else 0
        if choice is None:
            saved = forced_saves(ms.ops, ms.recompute_stop)
        else:
            saved = named_saves(ms.ops, ms.recompute_stop, choice)
        decisions.append(
            ModuleDecision(
                fqn=fqn,
                discard_ratio=1.0 if choice is None else (min(1.0, d0 / A) if A > 0 else 0.0),
                discard_bytes=d0,
                recompute_ms=out.recompute_ms,
                recompute_flops=out.recompute_flops,
                saved_ops=saved,
                calls=ms.calls,
                preserve_rng_state=ms.draws_random,
                dispatch_ms=out.dispatch_ms,
            )
        )
    return Plan(
        decisions=tuple(decisions),
        budget_bytes=int(budget_bytes if budget_bytes is not None else pred.peak_bytes),
        predicted_peak_bytes=pred.peak_bytes,
        baseline_peak_bytes=pred.baseline_peak_bytes,
        recompute_ms=pred.recompute_ms,
        baseline_step_ms=float(st.step_ms),
        status=label,
        objective_ms=pred.recompute_ms + pred.dispatch_ms,
        bound_ms=pred.recompute_ms + pred.dispatch_ms,
        gap=0.0,
        solver="",
        build_s=0.0,
        solve_s=0.0,
        world_size=st.world_size,
        device_name=st.device.name,
        model_name=st.model_name,
        fingerprint=st.fingerprint,
        meta={"alternative": label},
    )


def no_ac_plan(tree: ModuleTree) -> Plan:
    return plan_from_choices(tree, {}, "no AC")


def full_ac_plan(tree: ModuleTree, blocks: Iterable[str] | None = None) -> Plan:
    blocks = find_blocks(tree) if blocks is None else list(blocks)
    return plan_from_choices(tree, {b: None for b in blocks}, "full AC")


def every_other_block_plan(tree: ModuleTree, blocks: Iterable[str] | None = None) -> Plan:
    """Full checkpointing of blocks 1, 3, 5, ... (torchtitan ``selective layer``, ``ac_freq=2``)."""
    blocks = find_blocks(tree) if blocks is None else list(blocks)
    return plan_from_choices(tree, {b: None for b in blocks[1::2]}, "every-other-block AC")


def save_list_plan(tree: ModuleTree, blocks: Iterable[str] | None = None, families: Iterable[str] = MATMULS + (ATTENTION,)) -> Plan:
    """Op-level SAC of every block saving every op of ``families`` (all matmuls and attention by default)."""
    from sacplan.evaluate import save_list_choices

    blocks = find_blocks(tree) if blocks is None else list(blocks)
    return plan_from_choices(tree, save_list_choices(tree, blocks, families), "op SAC (all mm+attn)")


def torchtitan_choices(tree: ModuleTree, blocks: Iterable[str]) -> dict[str, Choice]:
    """torchtitan's selective-op rule per block: save attention, and matmuls 1, 3, 5, ... (recompute 2, 4, ...)."""
    out: dict[str, Choice] = {}
    for b in blocks:
        keys = op_keys(tree.node(b).stats.ops)
        chosen = set()
        mm_count = 0
        for k in keys:
            if k[0] == ATTENTION:
                chosen.add(k)
            elif k[0] in MATMULS:
                mm_count += 1
                if mm_count % 2 == 1:  # torchtitan: save unless mm_count is even
                    chosen.add(k)
        out[b] = frozenset(chosen)
    return out


def torchtitan_op_sac_plan(tree: ModuleTree, blocks: Iterable[str] | None = None) -> Plan:
    blocks = find_blocks(tree) if blocks is None else list(blocks)
    return plan_from_choices(tree, torchtitan_choices(tree, blocks), "op SAC (torchtitan)")


def reference_milp_plan(
    tree: ModuleTree, budget_bytes: int, *, world_size: int = 1, ac_units: list[str] | None = None
) -> tuple[Plan | None, dict[str, Any]]:
    """PyTorch's reference ``sac_milp`` at ``budget_bytes`` (passed in GiB) realised with ``select_ops``.

    Returns ``(plan or None when the reference finds none, info)``; ``info`` holds the reference's raw
    decisions, its recompute estimate and peak, and the solve time.
    """
    from torch.distributed._tools.ilp_utils import parse_module_info
    from torch.distributed._tools.sac_ilp import sac_milp as ref_sac_milp

    from sacplan.solver.ops import max_saved_bytes_for, select_ops

    info_dict = tree.to_torch_module_info()
    graph = parse_module_info(info_dict)
    t0 = time.perf_counter()
    alias = None if ac_units is None else [(tree.stats.modules[0].module_type or "Model") + "." + f for f in ac_units]
    with contextlib.redirect_stdout(None):
        decisions, rec_ms, peak = ref_sac_milp(graph, budget_bytes / 2**30, world_size=world_size, ac_units=alias)
    info = {"decisions": dict(decisions), "recompute_ms": rec_ms, "peak": peak, "solve_s": time.perf_counter() - t0}
    if peak == -1 and not decisions:
        return None, info
    choices: dict[str, Choice] = {}
    for tfqn, ratio in decisions.items():
        fqn = ModuleTree.torch_fqn_to_sacplan(tfqn)
        ms = tree.node(fqn).stats
        t = ms.tradeoff
        if t is None:
            continue
        A = t.max_discard_bytes
        ratio = float(min(1.0, max(0.0, ratio)))
        if ratio >= 1.0 - 1e-12 or not ms.ops:
            choices[fqn] = None
            continue
        sel = select_ops(ms.ops, max_saved_bytes_for(ratio, A), recompute_stop=ms.recompute_stop)
        keys = op_keys(ms.ops)
        pos = {o.index: p for p, o in enumerate(ms.ops)}
        choices[fqn] = frozenset(keys[pos[i]] for i in sel.saved)
    plan = plan_from_choices(tree, choices, "reference sac_milp", budget_bytes)
    return plan, info


# ------------------------------------------------------------------------------------------ measuring
_BASELINE_FLOPS: dict[Any, int] = {}
_FLOP_SINK: list[int] | None = None


def _counting_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
    """aot_eager's no-op compiler that also counts FLOPs of the graph when a sink is active."""

    def run(args: list) -> Any:
        a = list(args)
        args.clear()
        if _FLOP_SINK is not None:
            with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
                out = torch.fx.Interpreter(gm).run(*a)
            _FLOP_SINK[0] += int(fc.get_total_flops())
            return out
        return torch.fx.Interpreter(gm).run(*a)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile_backend() -> Any:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(
        fw_compiler=_counting_compiler,
        bw_compiler=_counting_compiler,
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )


@contextlib.contextmanager
def _activation_budget(budget: float):
    import torch._functorch.config as fconf

    old = fconf.activation_memory_budget
    fconf.activation_memory_budget = float(budget)
    try:
        yield
    finally:
        fconf.activation_memory_budget = old


_FW_END = "sacplan::forward_end"


def _profiled(fn: Callable[[], None], live_at_start: int) -> tuple[int, int]:
    """(peak bytes, bytes allocated and not freed by the end of the forward) of ``fn`` from the profiler's
    CPU allocator events (the method of :func:`sacplan.measurement.measure_step`)."""
    from torch.profiler import ProfilerActivity, profile

    from sacplan.collector.workspace import quiet_profiler_logs

    with quiet_profiler_logs(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    evs = list(prof.profiler.kineto_results.events())
    marks = [e.start_ns() for e in evs if e.name() == _FW_END]
    fw_end = min(marks) if marks else None
    mem = sorted(
        (e for e in evs if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
        key=lambda e: e.start_ns(),
    )
    cur = peak = 0
    fw = None
    for e in mem:
        if fw is None and fw_end is not None and e.start_ns() > fw_end:
            fw = cur
        cur += e.nbytes()
        peak = max(peak, cur)
    return live_at_start + peak, (cur if fw is None else fw)


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), st.nbytes())
    except (RuntimeError, NotImplementedError):
        return None


def measure(
    model_fn: Callable[[], nn.Module],
    inputs_fn: Callable[[], Any],
    loss_fn: Callable[[Any, tuple], torch.Tensor],
    plan_or_none: Any = None,
    *,
    compile_budget: float | None = None,
    seed: int = 0,
    track: bool = False,
) -> dict[str, Any]:
    """Real CPU training step (forward + backward) of ``model_fn()`` with ``plan_or_none`` applied, or compiled
    with ``torch.compile(backend=aot_eager, min-cut partitioner)`` at ``activation_memory_budget=compile_budget``.

    Returns a dict with:

    * ``peak_bytes``: peak of the step (bytes live at its start + the profiler's allocator events);
    * ``saved_activation_bytes``: bytes live after the forward (loss computed, output dropped) above those
      live before it: what the step keeps for backward, including what checkpoint regions keep (their
      inputs, SAC-cached op outputs);
    * ``packed_bytes``: unique storages packed by ``saved_tensors_hooks`` during the forward (tensors
      saved inside a checkpoint region are packed by checkpoint's own hooks and are not seen here);
    * ``recompute_flops``: ``FlopCounterMode`` FLOPs of the step minus those of the same step without
      checkpointing (eager no-AC; for compile, compile at budget 1.0);
    * ``step_ms``: wall time of the profiled step; ``flops``: the step's FLOPs;
    * ``tracker_peak_bytes`` (``track=True``, eager only, else None): sacplan's tracker run on the real tensors
      of one more step, an independent cross-check of the profiler's peak.
    """
    from sacplan.apply import apply_plan
    from sacplan.measurement import live_bytes, state_tensors

    def build() -> nn.Module:
        torch.manual_seed(seed)
        m = model_fn()
        m.train()
        return m

    raw = inputs_fn()
    args = as_inputs(raw)
    loss = as_loss(loss_fn)
    model = build()
    plan = plan_or_none
    if plan is not None and getattr(plan, "decisions", ()):
        apply_plan(model, plan, check_fingerprint=False)
    ctx = _activation_budget(compile_budget) if compile_budget is not None else contextlib.nullcontext()
    with ctx:
        if compile_budget is not None:
            torch._dynamo.reset()
            fwd: Callable = torch.compile(model, backend=_compile_backend(), dynamic=False)
        else:
            fwd = model

        packed: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            k = _storage_key(t)
            if k is not None and k[0] != 0:
                packed[k] = k[1]
            return t

        def step(hooks: bool = False) -> None:
            torch.manual_seed(seed + 2)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hooks else contextlib.nullcontext():
                l = loss(call_model(fwd, args), args)
            with torch.profiler.record_function(_FW_END):
                pass
            l.backward()
            del l
            model.zero_grad(set_to_none=True)

        flops = _counted_step(step, compiled=compile_budget is not None)  # the warm-up step (compiles)
        live = live_bytes(state_tensors(model, None, args))
        t0 = time.perf_counter()
        peak, fw_delta = _profiled(lambda: step(hooks=True), live)
        step_ms = (time.perf_counter() - t0) * 1e3
        tracker_peak = None
        if track and compile_budget is None:
            from sacplan.measurement import tracker_step_peak

            tracker_peak = int(tracker_step_peak(model, args, step, None))
        state_keys = {_storage_key(t) for t in state_tensors(model, None, args)}
        packed_bytes = sum(v for k, v in packed.items() if k not in state_keys)
    base = _baseline_flops(model_fn, inputs_fn, loss_fn, plan, compile_budget, seed, flops)
    if compile_budget is not None:
        torch._dynamo.reset()
    return {
        "peak_bytes": int(peak),
        "saved_activation_bytes": int(fw_delta),
        "packed_bytes": int(packed_bytes),
        "recompute_flops": int(flops - base),
        "flops": int(flops),
        "step_ms": float(step_ms),
        "tracker_peak_bytes": tracker_peak,
    }


def _counted_step(step: Callable[[], None], compiled: bool) -> int:
    """FLOPs of one call of ``step``: ``FlopCounterMode`` eagerly; compiled, what the compile backend counted."""
    global _FLOP_SINK
    if compiled:
        _FLOP_SINK = [0]
        try:
            step()
            return _FLOP_SINK[0]
        finally:
            _FLOP_SINK = None
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
        step()
    return int(fc.get_total_flops())


def _baseline_flops(model_fn: Callable[[], nn.Module], inputs_fn: Callable[[], Any], loss_fn: Any, plan: Any,
                    compile_budget: float | None, seed: int, flops: int) -> int:
    """FLOPs of the same step without checkpointing (eager no-AC; compiled at budget 1.0), measured once per model
    and mode (``flops`` when this step is that one)."""
    base_key = (model_fn, id(inputs_fn), "compile" if compile_budget is not None else "eager")
    base = _BASELINE_FLOPS.get(base_key)
    if base is None:
        if compile_budget is None and (plan is None or not getattr(plan, "decisions", ())):
            base = flops
        elif compile_budget is not None and compile_budget >= 1.0:
            base = flops
        else:
            ref = measure(model_fn, inputs_fn, loss_fn, None, compile_budget=None if compile_budget is None else 1.0, seed=seed)
            base = ref["flops"]
        _BASELINE_FLOPS[base_key] = base
    return base


def ladder(lo: int, hi: int, n: int) -> list[int]:
    """``n`` budgets from ``lo`` to ``hi`` inclusive (integers)."""
    if n <= 1:
        return [int(hi)]
    return [int(round(lo + (hi - lo) * i / (n - 1))) for i in range(n)]

