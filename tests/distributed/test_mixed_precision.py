"""FSDP2 with bf16 mixed precision (fp32 master shards, bf16 compute, fp32 reduce) on CPU gloo, 2 ranks.

The prediction is :func:`sacplan.distributed.shard_stats` with FSDP2's own ``MixedPrecisionPolicy`` on stats
collected in the compute dtype (bf16) and the fp32 model for the master shapes; the measurement is the
per-rank StepRecorder peak of a real step (see ``_fsdp_run``). Checked per rank, without and with a plan:
peak within 1%; gradients bitwise equal with vs without the plan, and close to a single-process reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import _fsdp_run, _mp

pytestmark = pytest.mark.distributed

LAYERS, BATCH, SEQ = 2, 2, 64


def _tokens(rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _shard(model, units: str):
    """FSDP2 each block, then (``units == "grouped"``) [norm, output] as one unit as torchtitan does, then the root."""
    from torch.distributed.fsdp import fully_shard

    mp = _policy()
    for blk in model.layers:
        fully_shard(blk, mp_policy=mp)
    if units == "grouped":
        fully_shard([model.norm, model.output], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp)
    return model


def _measure(rank: int, ws: int, units: str, order: str, plan_dict: dict) -> dict:
    from sacplan.models import get_model

    preset = get_model("llama-tiny")
    vocab = preset.config.vocab_size
    toks = _tokens(rank, vocab)

    def reference() -> list[torch.Tensor]:  # single process, fp32, all ranks' batches: mean of means
        torch.manual_seed(0)
        ref = preset.build(n_layers=LAYERS)
        all_toks = torch.cat([_tokens(r, vocab) for r in range(ws)])
        preset.loss_fn(ref(all_toks), all_toks).backward()
        return [p.grad for p in ref.parameters()]

    return _fsdp_run.measure_rank(
        lambda: preset.build(n_layers=LAYERS), lambda m: _shard(m, units), preset.loss_fn, toks, plan_dict,
        order, reference=reference, rtol=0.05, atol=2e-3,  # bf16 compute vs the fp32 reference
    )


def worker(rank: int, ws: int, rdzv: str, units: str, order: str, plan_dict: dict, q) -> None:
    _mp.init(rank, ws, rdzv)
    _mp.guarded(rank, q, lambda: _measure(rank, ws, units, order, plan_dict))


def per_rank_stats(units: str, ws: int = 2):
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.distributed import shard_stats
    from sacplan.models import get_model

    preset = get_model("llama-tiny")
    # parameters in the compute dtype, buffers (the rotary table) in their own, as FSDP2 casts them
    stats = collect(lambda: preset.build(torch.bfloat16, n_layers=LAYERS), _tokens(0, preset.config.vocab_size),
                    device=CPU, loss_fn=preset.loss_fn)
    with torch.device("meta"):
        meta_model = preset.build(n_layers=LAYERS)
    fsdp_units = "each block" if units == "blocks" else [f"layers.{i}" for i in range(LAYERS)] + [("norm", "output")]
    raf = {("norm", "output"): False} if units == "grouped" else None
    return shard_stats(stats, ws, model=meta_model, mp_policy=_policy(), fsdp_units=fsdp_units,
                       **({"reshard_after_forward": raf} if raf else {}))


def plan_for(per_rank):
    from sacplan.solver import baseline_peak, min_feasible_budget, solve
    from sacplan.tree import ModuleTree

    tree = ModuleTree(per_rank)
    base = baseline_peak(tree)
    lo = min_feasible_budget(tree)
    plan = solve(tree, lo + (base - lo) // 2)
    assert plan.decisions, "the budget should need checkpointing"
    return plan, base


@pytest.mark.parametrize(
    "units,order",
    [pytest.param("blocks", "before", marks=pytest.mark.slow), ("grouped", "after")],  # ~20 s each on 2 busy cores
)
def test_bf16_mixed_per_rank_peak(tmp_path, units, order):
    per_rank = per_rank_stats(units)
    plan, base = plan_for(per_rank)
    results = _mp.spawn(worker, 2, tmp_path, units, order, plan.to_dict())
    _fsdp_run.check_ranks(f"{units} {order}", results, plan, base)


# ----------------------------------------------------------------------------------- no process group
@pytest.fixture(scope="module")
def bf16_stats():
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.models import get_model

    preset = get_model("llama-tiny")
    stats = collect(lambda: preset.build(torch.bfloat16, n_layers=LAYERS), _tokens(0, preset.config.vocab_size),
                    device=CPU, loss_fn=preset.loss_fn)
    with torch.device("meta"):
        meta_model = preset.build(n_layers=LAYERS)
    return stats, meta_model


def test_master_shards_follow_the_model_dtype(bf16_stats):
    """Sharded params / optimizer state are fp32 (twice the collected bf16 bytes / N); all-gathers stay bf16."""
    from sacplan.distributed import shard_stats

    stats, meta_model = bf16_stats
    mixed = shard_stats(stats, 2, model=meta_model, mp_policy=_policy())
    pure = shard_stats(stats, 2, model=meta_model)  # pure bf16 training: shards in bf16
    info = mixed.meta["distributed"]
    assert info["master_dtype"] == "torch.float32" and info["param_dtype"] == "torch.bfloat16"
    assert pure.meta["distributed"]["master_dtype"] == "torch.bfloat16"
    assert mixed.param_bytes == 2 * pure.param_bytes == stats.param_bytes  # fp32 half = bf16 whole (even dims)
    assert mixed.optimizer_bytes == 2 * pure.optimizer_bytes
    blk = info["per_unit"]["layers.0"]
    assert blk["unsharded_bytes"] == blk["param_bytes"]  # bf16 all-gathered = bf16 collected
    assert blk["reduce_scatter_bytes"] == 2 * blk["param_bytes"]  # fp32 reduce of N x shard
    # the same with the dtypes given directly, and without the model (fp32 master assumed)
    direct = shard_stats(stats, 2, model=meta_model, param_dtype="bf16", reduce_dtype=torch.float32)
    assert direct.peak_bytes == mixed.peak_bytes
    assert shard_stats(stats, 2, mp_policy=_policy()).meta["distributed"]["master_dtype"] == "torch.float32"


def test_group_units_and_errors(bf16_stats):
    from sacplan.distributed import check_units, shard_stats, unit_modules
    from sacplan.errors import ConfigError
    from sacplan.tree import ModuleTree

    stats, meta_model = bf16_stats
    units = ["layers.0", "layers.1", ("norm", "output")]
    g = shard_stats(stats, 2, model=meta_model, mp_policy=_policy(), fsdp_units=units,
                    reshard_after_forward={("norm", "output"): False})
    info = g.meta["distributed"]
    assert info["units"] == ["", "layers.0", "layers.1", ["norm", "output"]]
    assert info["reshard_after_forward"] == {"layers.0": True, "layers.1": True, "norm+output": False}
    assert unit_modules(g) == ["layers.0", "layers.1", "norm", "output"]
    grp = info["per_unit"]["norm+output"]
    assert grp["param_bytes"] == 2 * (64 + 64 * 256)  # RMSNorm weight + output projection, bf16
    assert info["per_unit"][""]["param_bytes"] == 2 * 256 * 64  # the root keeps tok_embeddings
    check_units(ModuleTree(g), ["layers.0"], unit_modules(g))
    with pytest.raises(ConfigError, match="nested inside"):
        check_units(ModuleTree(g), [""], unit_modules(g))
    with pytest.raises(ConfigError, match="two FSDP units"):
        shard_stats(stats, 2, fsdp_units=["norm", ("norm", "output")])
    with pytest.raises(ConfigError, match="disjoint"):
        shard_stats(stats, 2, fsdp_units=[("layers.0", "layers.0.attention")])
    with pytest.raises(ConfigError, match="did you mean"):
        shard_stats(stats, 2, fsdp_units=[("norm", "outptu")])
    with pytest.raises(ConfigError, match="not one of the FSDP units"):
        shard_stats(stats, 2, fsdp_units=units, reshard_after_forward={"norm": False})
    with pytest.raises(ConfigError, match="either mp_policy"):
        shard_stats(stats, 2, mp_policy=_policy(), param_dtype="bf16")
    with pytest.raises(ConfigError, match="MixedPrecisionPolicy"):
        shard_stats(stats, 2, mp_policy="bf16")
    with pytest.raises(ConfigError, match="collect with dtype='float32'"):
        shard_stats(stats, 2, param_dtype=torch.float32)  # collected in bf16


def test_collect_passes_the_policy_to_the_simulated_path(bf16_stats):
    """collect(world_size=2, mp_policy=...) collects in bf16 and shards with fp32 masters (exact shapes)."""
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.distributed import shard_stats
    from sacplan.models import get_model

    _, meta_model = bf16_stats
    preset = get_model("llama-tiny")
    kw = dict(device=CPU, loss_fn=preset.loss_fn)
    toks = _tokens(0, preset.config.vocab_size)
    via_collect = collect(lambda: preset.build(n_layers=LAYERS), toks, world_size=2, mp_policy=_policy(), **kw)
    stats = collect(lambda: preset.build(n_layers=LAYERS), toks, dtype=torch.bfloat16, **kw)  # buffers cast too
    direct = shard_stats(stats, 2, model=meta_model, mp_policy=_policy())
    info = via_collect.meta["distributed"]
    assert info["master_dtype"] == "torch.float32" and info["shapes"].startswith("exact")
    assert via_collect.peak_bytes == direct.peak_bytes and via_collect.param_bytes == direct.param_bytes
