"""FSDP2 / DDP on CPU (gloo, 2 and 4 processes): per-rank peak vs :func:`sacplan.distributed.shard_stats`.

Each rank builds the same small Llama (fp32), applies a sacplan plan solved on the *per-rank* stats
(``shard_stats`` of stats collected for the CPU spec) before or after wrapping it with ``fully_shard``
(each block, then the root) or DDP (``apply_plan`` on the DDP wrapper), and runs training steps on its own
batch. Ranks rendezvous on a FileStore in the test's ``tmp_path`` (no TCP port race). Checked:

* gradients (``full_tensor`` of the DTensor grads for FSDP) equal the single-process unsharded model's on
  the concatenated batch (mean loss: the ranks' mean of means, which is what reduce-scatter/all-reduce
  averaging gives);
* the plan is in force: the step's FLOPs exceed the unplanned model's by exactly the plan's
  ``recompute_flops``;
* the per-rank peak of a later step (optimizer state exists, as in ``collect``), measured by sacplan's
  :class:`~sacplan.collector.tracker.StepRecorder` on the real tensors (as ``sacplan.validation.tracker_step_peak``),
  is within 5% of the prediction, and so are the CPU allocator events of ``torch.profiler`` (with 4 ranks,
  up to the frees it provably cannot see: see the bound in the test and ``_mp.traced_cpu_memory``).

FSDP2 allocates and frees unsharded parameters and its flat all-gather buffers by ``UntypedStorage.resize_``,
which no dispatch mode sees; the StepRecorder hooks ``resize_`` while it records, so it measures them too.
Every rank's figures are printed (shown by pytest when a case fails).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.distributed import _mp

pytestmark = pytest.mark.distributed

LAYERS, BATCH, SEQ = 4, 2, 64


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _tokens(rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _wrap(model, mode: str, buckets: dict[int, torch.Tensor]):
    """FSDP2 (each block, then the root) or DDP around ``model``; the module to call."""
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for blk in model.layers:
            fully_shard(blk)
        fully_shard(model)
        return model
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    runner = DDP(model)  # gradient_as_bucket_view=False (default): buckets are a second copy of the grads

    def record_buckets(state, bucket):  # the buckets persist between steps: count them as live state
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    runner.register_comm_hook(None, record_buckets)
    return runner


def _measure(rank: int, ws: int, mode: str, order: str, plan_dict: dict, tmp: str) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from sacplan.apply import applied_plan, apply_plan
    from sacplan.collector.records import INPUT, OPT, OTHER, PARAM
    from sacplan.collector.runtime import RuntimeModel, flop_mapping
    from sacplan.collector.tracker import StepRecorder
    from sacplan.devices import CPU
    from sacplan.models import get_model
    from sacplan.plan import Plan
    from sacplan.measurement import live_bytes

    plan = Plan.from_dict(plan_dict)
    t_start = time.perf_counter()
    buckets: dict[int, torch.Tensor] = {}
    preset = get_model("llama-tiny")
    vocab = preset.config.vocab_size
    torch.manual_seed(0)
    ref = preset.build(n_layers=LAYERS)
    torch.manual_seed(0)
    model = preset.build(n_layers=LAYERS)
    if order == "before":
        apply_plan(model, plan)
    runner = _wrap(model, mode, buckets)
    if order == "after":
        # FSDP2: the root is an FSDPLlama whose blocks are FSDPTransformerBlocks; DDP: the wrapper itself
        assert apply_plan(runner, plan) is runner
    assert applied_plan(model) is plan
    toks = _tokens(rank, vocab)
    # reference: unsharded single-process model, all ranks' batches, mean loss
    all_toks = torch.cat([_tokens(r, vocab) for r in range(ws)])
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
        preset.loss_fn(ref(all_toks), all_toks).backward()
    ref_flops = fc.get_total_flops()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    # step 1: gradients and recomputed FLOPs
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
        preset.loss_fn(runner(toks), toks).backward()
    assert ref_flops % ws == 0
    recompute_flops = fc.get_total_flops() - ref_flops // ws
    max_diff, ok = 0.0, True
    for (n, p), (n2, pr) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        max_diff = max(max_diff, float((g - pr.grad).abs().max()))
        ok = ok and torch.allclose(g, pr.grad, rtol=1e-4, atol=1e-6)
    opt.step()
    opt.zero_grad(set_to_none=True)

    def step() -> None:
        loss = preset.loss_fn(runner(toks), toks)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # step 2 unmeasured: DDP rebuilds its buckets in the step after the first
    state = [_local(p) for p in model.parameters()] + list(buckets.values())
    state += [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    # step 3: the StepRecorder on the real tensors
    rec = StepRecorder(model, CPU, RuntimeModel(CPU))
    with rec:
        rec.register([_local(p) for p in model.parameters()], PARAM)
        rec.register([_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)], OPT)
        rec.register((toks,), INPUT)
        rec.register(list(buckets.values()), OTHER)
        rec.close_segment()
        rec.recording = True
        step()
        rec.close_segment("other")
    # steps 4+: the allocator's own events (profiler) as a cross-check. A step in which the profiler missed
    # a free (one that a gloo worker thread made: see _mp.traced_cpu_memory) leaves bytes at its end; such a
    # reading is not trusted and the step is measured again (up to 4 times, all ranks together: they run
    # collectives), keeping each rank's cleanest.
    import torch.distributed as dist

    live = live_bytes(state + [toks])
    readings = []
    for _ in range(4):
        readings.append(_mp.traced_cpu_memory(step, Path(tmp)))
        dirty = torch.tensor([int(readings[-1]["end"] != 0 or readings[-1]["unseen_free"] != 0)])
        dist.all_reduce(dirty, op=dist.ReduceOp.MAX)
        if not dirty.item():
            break
    prof = min(readings, key=lambda p: (abs(p["end"]) + p["unseen_free"], p["peak"]))
    return dict(grads_ok=ok, max_grad_diff=max_diff, recompute_flops=recompute_flops,
                tracker_peak=rec.step_peak, tracker_where=rec.step_peak_where, profiler_peak=live + prof["peak"],
                profiler_end=prof["end"], unseen_free=prof["unseen_free"], profiler_steps=len(readings),
                profiler_peaks=[live + p["peak"] for p in readings], seconds=time.perf_counter() - t_start)


def _worker(rank: int, ws: int, rdzv: str, mode: str, order: str, plan_dict: dict, tmp: str, q) -> None:
    _mp.init(rank, ws, rdzv)
    _mp.guarded(rank, q, lambda: _measure(rank, ws, mode, order, plan_dict, tmp))


@pytest.fixture(scope="module")
def cpu_stats():
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.models import get_model

    preset = get_model("llama-tiny")
    stats = collect(lambda: preset.build(n_layers=LAYERS), _tokens(0, preset.config.vocab_size),
                    device=CPU, loss_fn=preset.loss_fn)
    with torch.device("meta"):
        meta_model = preset.build(n_layers=LAYERS)
    return stats, meta_model


def _plan_for(per_rank):
    from sacplan.distributed import check_units
    from sacplan.solver import baseline_peak, min_feasible_budget, solve
    from sacplan.tree import ModuleTree

    tree = ModuleTree(per_rank)
    units = per_rank.meta["distributed"].get("units")
    fsdp_units = [u for u in units if u] if units else None
    base = baseline_peak(tree)
    lo = min_feasible_budget(tree, fsdp_units=fsdp_units)
    budget = lo + (base - lo) // 2
    plan = solve(tree, budget, fsdp_units=fsdp_units)
    check_units(tree, [d.fqn for d in plan.decisions], fsdp_units)
    assert plan.decisions, "the budget should need checkpointing"
    assert plan.predicted_peak_bytes <= budget
    return plan


@pytest.mark.parametrize(
    "mode,ws,order",
    [
        ("fsdp", 2, "before"),
        ("fsdp", 2, "after"),
        ("ddp", 2, "before"),
        ("ddp", 2, "after"),
        ("fsdp", 4, "before"),
        pytest.param("fsdp", 4, "after", marks=pytest.mark.slow),  # 10 s; 4 ranks: "before" in the default run
    ],
)
def test_per_rank_peak_and_grads(cpu_stats, tmp_path, mode, ws, order):
    """Plan applied before or after wrapping: gradients, recomputed FLOPs and per-rank peak as predicted."""
    from sacplan.distributed import shard_stats

    stats, meta_model = cpu_stats
    per_rank = shard_stats(stats, ws, mode=mode, model=meta_model)
    assert per_rank.world_size == ws
    plan = _plan_for(per_rank)
    predicted = plan.predicted_peak_bytes
    planned_flops = sum(d.recompute_flops for d in plan.decisions)
    results = _mp.spawn(_worker, ws, tmp_path, mode, order, plan.to_dict(), str(tmp_path))
    lines, failures = [], []
    for r in results:
        tr_err = (r["tracker_peak"] - predicted) / r["tracker_peak"]
        pr_err = (r["profiler_peak"] - predicted) / r["profiler_peak"]
        # Frees the profiler cannot see (see _mp.traced_cpu_memory) leave its running sum high by up to what
        # it still holds after this steady-state step, so the true peak lies in [peak - end, peak].
        low_err = (r["profiler_peak"] - max(0, r["profiler_end"]) - predicted) / r["profiler_peak"]
        lines.append(
            f"{mode} ws={ws} {order} rank {r['rank']}: predicted {predicted}, tracker {r['tracker_peak']} "
            f"({tr_err:+.2%}) at {r['tracker_where']}, profiler {r['profiler_peak']} ({pr_err:+.2%}; unseen frees "
            f"{r['unseen_free']}, end {r['profiler_end']}, {r['profiler_steps']} step(s): {r['profiler_peaks']}), "
            f"recomputed FLOPs {r['recompute_flops']} "
            f"(plan {planned_flops}), max |grad diff| {r['max_grad_diff']:.2e}, {r['seconds']:.1f}s"
        )
        if not r["grads_ok"]:
            failures.append(f"rank {r['rank']}: gradients differ from the reference by {r['max_grad_diff']}")
        if r["recompute_flops"] != planned_flops:
            failures.append(f"rank {r['rank']}: recomputed {r['recompute_flops']} FLOPs, the plan {planned_flops}")
        if abs(tr_err) > 0.05:
            failures.append(f"rank {r['rank']}: tracker peak {r['tracker_peak']} vs predicted {predicted}")
        clean = r["profiler_end"] == 0 and r["unseen_free"] == 0
        if ws <= 2 or clean:
            prof_ok = abs(pr_err) <= 0.05
        else:
            # 4 ranks on 2 cores: a gloo worker thread sometimes drops a collective's last reference to its
            # tensors (an FSDP2 all-gather or reduce-scatter buffer), a free the profiler never records, which
            # read +3% to +8% here while the tracker stayed at -0.4%. When no clean step was measured, the
            # true peak lies in [peak - end, peak]: that interval must meet the 5% band around the prediction.
            prof_ok = pr_err >= -0.05 and low_err <= 0.05
        if not prof_ok:
            failures.append(f"rank {r['rank']}: profiler peak {r['profiler_peak']} vs predicted {predicted}")
    print("\n".join(lines))
    assert not failures, "\n".join(failures + lines)


# ----------------------------------------------------------------------------------- no process group
def test_shard_stats_scaling_and_errors(cpu_stats):
    from sacplan.distributed import check_units, each_block_units, shard_stats
    from sacplan.errors import ConfigError
    from sacplan.tree import ModuleTree

    stats, meta_model = cpu_stats
    assert each_block_units(stats) == [""] + [f"layers.{i}" for i in range(LAYERS)]
    peaks = [shard_stats(stats, n, model=meta_model).peak_bytes for n in (1, 2, 8, 64)]
    assert peaks[1] > peaks[2] > peaks[3]
    s8 = shard_stats(stats, 8, model=meta_model)
    info = s8.meta["distributed"]
    assert info["mode"] == "fsdp" and info["allgather_peak_bytes"] > 0 and info["shapes"].startswith("exact")
    approx = shard_stats(stats, 8)
    assert approx.meta["distributed"]["shapes"].startswith("approximate")
    assert abs(approx.peak_bytes - s8.peak_bytes) / s8.peak_bytes < 0.01
    no_reshard = shard_stats(stats, 8, model=meta_model, reshard_after_forward=False)
    assert no_reshard.peak_bytes > s8.peak_bytes
    ddp = shard_stats(stats, 8, mode="ddp")
    assert ddp.peak_bytes == stats.peak_bytes + stats.grad_bytes
    with pytest.raises(ConfigError):
        shard_stats(stats, 0)
    with pytest.raises(ConfigError, match="did you mean"):
        shard_stats(stats, 2, fsdp_units=["layers.O"])
    with pytest.raises(ConfigError):
        shard_stats(stats, 2, mode="tp")
    with pytest.raises(ConfigError):
        shard_stats(s8, 2)
    tree = ModuleTree(stats)
    check_units(tree, ["layers.0"], ["layers.0", "layers.1"])
    with pytest.raises(ConfigError, match="nested inside"):
        check_units(tree, [""], ["layers.0"])
    with pytest.raises(ConfigError):
        check_units(tree, ["layers.9"], ["layers.0"])
    # callable units
    s = shard_stats(stats, 2, fsdp_units=lambda f, m: m.module_type == "TransformerBlock", model=meta_model)
    assert s.meta["distributed"]["units"] == each_block_units(stats)
