"""FSDP2 / DDP on CPU (gloo, 2 and 4 processes): per-rank peak vs :func:`sacplan.distributed.shard_stats`.

Each rank builds the same small Llama (fp32), applies a sacplan plan solved on the *per-rank* stats
(``shard_stats`` of stats collected for the CPU spec), wraps it with ``fully_shard`` (each block, then the
root) or DDP, and runs training steps on its own batch. Checked:

* gradients (``full_tensor`` of the DTensor grads for FSDP) equal the single-process unsharded model's on
  the concatenated batch (mean loss: the ranks' mean of means, which is what reduce-scatter/all-reduce
  averaging gives);
* the per-rank peak of a later step (optimizer state exists, as in ``collect``), measured by sacplan's
  :class:`~sacplan.collect.tracker.StepRecorder` on the real tensors (as ``sacplan.validate._tracker_peak``)
  and cross-checked by the CPU allocator events of ``torch.profiler``, is within 5% of the prediction.

FSDP2 allocates and frees unsharded parameters and its flat all-gather buffers by ``UntypedStorage.resize_``,
which no dispatch mode sees; the StepRecorder hooks ``resize_`` while it records, so it measures them too.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

pytestmark = pytest.mark.distributed

LAYERS, BATCH, SEQ = 4, 2, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _tokens(rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _worker(rank: int, ws: int, port: int, mode: str, plan_dict, q) -> None:
    import torch.distributed as dist

    from sacplan.apply import apply_plan
    from sacplan.collect.runtime import RuntimeModel
    from sacplan.collect.tracker import INPUT, OPT, OTHER, PARAM, StepRecorder
    from sacplan.devices import CPU
    from sacplan.models import get_model
    from sacplan.plan import Plan
    from sacplan.validate import _cpu_profiled_peak, _live_bytes

    plan = Plan.from_dict(plan_dict)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    buckets: dict[int, torch.Tensor] = {}
    try:
        preset = get_model("llama-tiny")
        vocab = preset.config.vocab_size
        torch.manual_seed(0)
        ref = preset.build(n_layers=LAYERS)
        torch.manual_seed(0)
        model = preset.build(n_layers=LAYERS)
        apply_plan(model, plan)
        if mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for blk in model.layers:
                fully_shard(blk)
            fully_shard(model)
            runner = model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            runner = DDP(model)  # gradient_as_bucket_view=False (default): buckets are a second copy of the grads
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def record_buckets(state, bucket):  # the buckets persist between steps: count them as live state
                buckets[bucket.index()] = bucket.buffer()
                return allreduce_hook(state, bucket)

            runner.register_comm_hook(None, record_buckets)
        toks = _tokens(rank, vocab)
        # reference: unsharded single-process model, all ranks' batches, mean loss
        all_toks = torch.cat([_tokens(r, vocab) for r in range(ws)])
        preset.loss_fn(ref(all_toks), all_toks).backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        # step 1: gradients
        preset.loss_fn(runner(toks), toks).backward()
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
        # step 4: the allocator's own events (profiler) as a cross-check
        prof_peak = _cpu_profiled_peak(step, _live_bytes(state + [toks]))
        q.put(dict(rank=rank, grads_ok=ok, max_grad_diff=max_diff, tracker_peak=rec.step_peak,
                   tracker_where=rec.step_peak_where, profiler_peak=prof_peak))
    except Exception as e:  # pragma: no cover - reported to the parent
        import traceback

        q.put(dict(rank=rank, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cpu_stats():
    from sacplan.collect import collect
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
    from sacplan.solve import baseline_peak, min_feasible_budget, solve
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


def _run(mode: str, ws: int, plan) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(_worker, args=(ws, _free_port(), mode, plan.to_dict(), q), nprocs=ws, join=True)
    out = []
    while not q.empty():
        out.append(q.get())
    assert len(out) == ws
    errors = [r["error"] for r in out if "error" in r]
    assert not errors, errors[0]
    return sorted(out, key=lambda r: r["rank"])


@pytest.mark.parametrize(
    "mode,ws",
    [
        ("fsdp", 2),
        ("ddp", 2),
        # 4 processes on a 2-core machine: the tracker matches to 0.01%, but the profiler cross-check has seen
        # +8% on one rank when the machine is loaded (timing-dependent all-gather overlap); run with -m slow.
        pytest.param("fsdp", 4, marks=pytest.mark.slow),
    ],
)
def test_per_rank_peak_and_grads(cpu_stats, mode, ws):
    from sacplan.distributed import shard_stats

    stats, meta_model = cpu_stats
    per_rank = shard_stats(stats, ws, mode=mode, model=meta_model)
    assert per_rank.world_size == ws
    plan = _plan_for(per_rank)
    predicted = plan.predicted_peak_bytes
    t0 = time.perf_counter()
    results = _run(mode, ws, plan)
    for r in results:
        tr_err = (r["tracker_peak"] - predicted) / r["tracker_peak"]
        pr_err = (r["profiler_peak"] - predicted) / r["profiler_peak"]
        print(f"{mode} ws={ws} rank {r['rank']}: predicted {predicted}, tracker {r['tracker_peak']} ({tr_err:+.2%}) "
              f"at {r['tracker_where']}, profiler {r['profiler_peak']} ({pr_err:+.2%}), "
              f"max |grad diff| {r['max_grad_diff']:.2e}, {time.perf_counter() - t0:.1f}s")
        assert r["grads_ok"], f"rank {r['rank']}: gradients differ from the reference by {r['max_grad_diff']}"
        assert abs(tr_err) <= 0.05, f"rank {r['rank']}: tracker peak {r['tracker_peak']} vs predicted {predicted}"
        assert abs(pr_err) <= 0.05, f"rank {r['rank']}: profiler peak {r['profiler_peak']} vs predicted {predicted}"


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
