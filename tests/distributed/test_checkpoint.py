"""A plan changes no checkpoint: ``state_dict`` and distributed checkpoints (DCP) are the same with and without.

``apply_plan`` only replaces ``forward`` on module instances, so parameter and buffer names, values and
the FSDP2 sharded state dicts must not move. Checked on one process (``state_dict`` / ``load_state_dict``,
before and after ``remove_plan``) and on 2 gloo ranks with FSDP2: ``torch.distributed.checkpoint`` saved
from a planned model loads into an unplanned one and back, with the same metadata keys and shapes as a
checkpoint saved without a plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sacplan.apply import apply_plan, remove_plan
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.models import get_model
from sacplan.solver import solve
from sacplan.tree import ModuleTree
from tests.distributed import _mp

LAYERS, BATCH, SEQ = 2, 2, 64


def _plan(name: str, frac: float):
    preset = get_model(name)
    build = (lambda: preset.build(n_layers=LAYERS)) if name.startswith("llama") else preset.build
    args = preset.example_inputs(BATCH, SEQ) if name.startswith("llama") else preset.example_inputs(8)
    stats = collect(build, args, device=CPU, loss_fn=preset.loss_fn)
    plan = solve(ModuleTree(stats), int(stats.peak_bytes * frac))
    assert plan.decisions
    return preset, build, args, plan


@pytest.mark.parametrize("name,frac", [("llama-tiny", 0.85), ("cnn-tiny", 0.8)])
def test_state_dict_unchanged(name, frac):
    preset, build, args, plan = _plan(name, frac)
    torch.manual_seed(0)
    plain = build()
    torch.manual_seed(0)
    planned = build()
    sd0 = plain.state_dict()
    apply_plan(planned, plan)
    sd1 = planned.state_dict()
    assert list(sd1) == list(sd0)
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    # a training step (BatchNorm statistics move) keeps them equal, and each loads into the other strictly
    for m in (plain, planned):
        torch.manual_seed(1)
        preset.loss_fn(m(*args), args).backward()
    sd0, sd1 = plain.state_dict(), planned.state_dict()
    assert list(sd1) == list(sd0)
    for k in sd0:  # BatchNorm statistics updated once (recomputation replays no buffer update)
        assert torch.equal(sd0[k], sd1[k]), k
    fresh = build()
    apply_plan(fresh, plan)
    assert not fresh.load_state_dict(sd0, strict=True).missing_keys
    assert all(torch.equal(v, sd0[k]) for k, v in fresh.state_dict().items())
    plain.load_state_dict(sd1, strict=True)
    remove_plan(planned)
    assert list(planned.state_dict()) == list(sd0)


# ------------------------------------------------------------------------------------- DCP, 2 ranks
def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Flattened state dict with DTensors gathered (tensors only), for comparisons."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(x, torch.Tensor):
            out[prefix[:-1]] = (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().clone()

    walk("", sd)
    return out


def _dcp(rank: int, ws: int, plan_dict: dict, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from sacplan.apply import applied_plan
    from sacplan.plan import Plan

    plan = Plan.from_dict(plan_dict)
    preset = get_model("llama-tiny")
    gen = torch.Generator().manual_seed(1000 + rank)
    toks = torch.randint(0, preset.config.vocab_size, (BATCH, SEQ), generator=gen)

    def build(with_plan: bool):
        torch.manual_seed(0)
        model = preset.build(n_layers=LAYERS)
        if with_plan:
            apply_plan(model, plan)
        for blk in model.layers:
            fully_shard(blk)
        fully_shard(model)
        assert (applied_plan(model) is plan) == with_plan
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model, opt) -> None:
        preset.loss_fn(model(toks), toks).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state(model, opt) -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    def load(model, opt, path: Path) -> None:
        sd = state(model, opt)
        dcp.load(sd, checkpoint_id=str(path))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])

    def metadata(path: Path) -> dict[str, list[int]]:
        md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: list(getattr(v, "size", ())) for k, v in md.items()}

    tmp_path = Path(tmp)
    planned, plain = build(True), build(False)
    for m in (planned, plain):
        train(*m)
    dcp.save(state(*planned), checkpoint_id=str(tmp_path / "with-plan"))
    dcp.save(state(*plain), checkpoint_id=str(tmp_path / "without-plan"))
    report: dict[str, Any] = {}
    a, b = _full(state(*planned)), _full(state(*plain))
    report["same_keys_live"] = list(a) == list(b)
    report["trained_max_diff"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    md_plan, md_plain = metadata(tmp_path / "with-plan"), metadata(tmp_path / "without-plan")
    report["metadata_keys"] = len(md_plan)
    report["same_metadata"] = md_plan == md_plain
    # with plan -> without plan, and back: loaded values are exactly the saved ones
    for name, (src, dst_plan, path) in {
        "plan->plain": (a, False, tmp_path / "with-plan"),
        "plain->plan": (b, True, tmp_path / "without-plan"),
    }.items():
        dst = build(dst_plan)
        load(*dst, path)
        got = _full(state(*dst))
        report[f"{name} same_keys"] = list(got) == list(src)
        report[f"{name} exact"] = all(torch.equal(got[k], src[k]) for k in src)
        # and training goes on identically from the loaded state
        train(*dst)
        ref = planned if name == "plan->plain" else plain
        train(*ref)
        got, want = _full(state(*dst)), _full(state(*ref))
        report[f"{name} next_step_max_diff"] = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    return report


def _dcp_worker(rank: int, ws: int, rdzv: str, plan_dict: dict, tmp: str, q: Any) -> None:
    _mp.init(rank, ws, rdzv)
    _mp.guarded(rank, q, lambda: _dcp(rank, ws, plan_dict, tmp))


@pytest.mark.distributed
def test_fsdp2_distributed_checkpoint_unchanged(tmp_path):
    from sacplan.distributed import shard_stats

    preset = get_model("llama-tiny")
    x = torch.randint(0, preset.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000))
    stats = collect(lambda: preset.build(n_layers=LAYERS), x, device=CPU, loss_fn=preset.loss_fn)
    with torch.device("meta"):
        meta = preset.build(n_layers=LAYERS)
    per_rank = shard_stats(stats, 2, model=meta)
    units = [u for u in per_rank.meta["distributed"]["units"] if u]
    tree = ModuleTree(per_rank)
    plan = solve(tree, int(per_rank.peak_bytes * 0.9), fsdp_units=units)
    assert plan.decisions
    for r in _mp.spawn(_dcp_worker, 2, tmp_path, plan.to_dict(), str(tmp_path)):
        assert r["same_keys_live"] and r["same_metadata"] and r["metadata_keys"] > 0, r
        assert r["trained_max_diff"] < 1e-6, r
        for name in ("plan->plain", "plain->plan"):
            assert r[f"{name} same_keys"] and r[f"{name} exact"], (name, r)
            assert r[f"{name} next_step_max_diff"] < 1e-6, (name, r)
