"""`sacplan plan MODEL --pp N`: one plan per stage, one plan file (in-process, a tiny preset)."""

from __future__ import annotations

import pytest
import torch

import sacplan
from sacplan.cli import main
from sacplan.pipeline import PipelinePlan


def test_pp_prints_one_plan_per_stage_and_writes_one_file(tmp_path, capsys):
    out = tmp_path / "pp.json"
    rc = main(["plan", "llama-tiny", "--pp", "2", "--microbatches", "2", "--seq", "32", "--device", "h100",
               "--budget", "80%", "-q", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "pipeline plan: Schedule1F1B, 2 ranks, 2 stages, 2 microbatches" in text
    assert "== stage 0 (rank 0)" in text and "== stage 1 (rank 1)" in text
    assert "batch 2 (2 microbatches of 1), seq 32, dtype bf16" in text
    plan = sacplan.load_plan(out)
    assert isinstance(plan, PipelinePlan) and plan.rank_stages == ((0,), (1,))
    # stage 0 holds the embeddings and layer 0, stage 1 layer 1 and the head (global layer names)
    from sacplan.models import get_model
    from sacplan.pipeline.presets import preset_pipeline

    fns, _, _ = preset_pipeline(get_model("llama-tiny"), 2, batch=2, seq=32, dtype=None)
    names = [{n for n, _ in f().named_modules()} for f in fns]
    assert "tok_embeddings" in names[0] and "layers.0" in names[0] and "layers.1" in names[1] and "output" in names[1]


@pytest.mark.parametrize("argv, code, msg", [
    (["--pp", "2", "--microbatches", "3", "--batch", "4"], 2, "does not split into 3 microbatches"),
    (["--pp", "2", "--schedule", "zero-bubble"], 2, "unknown pipeline schedule"),
    (["--pp", "3"], 2, "3 pipeline stages need at least 3 layers"),
])
def test_pp_usage_errors_are_one_line(argv, code, msg, capsys):
    rc = main(["plan", "llama-tiny", "--seq", "32", "-q"] + argv)
    err = capsys.readouterr().err
    assert rc == code and msg in err and len(err.strip().splitlines()) == 1


def test_pp_on_a_cnn_preset_says_how_to_pipeline_your_own_model(capsys):
    assert main(["plan", "cnn-tiny", "--pp", "2", "-q"]) == 1
    assert "sacplan.collect_pipeline(stage_fns, inputs" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_pp_with_tp_and_dp_shard_plans_each_stage_on_the_composed_mesh(tmp_path, capsys):
    """--pp 2 --tp 2 --dp-shard 2: every stage collected as its rank of the 8-rank mesh (torchtitan's layout per
    stage), one plan file whose stages apply to the unparallelized stage modules."""
    out = tmp_path / "pp.json"
    rc = main(["plan", "llama-tiny", "--pp", "2", "--microbatches", "2", "--seq", "32", "--tp", "2", "--dp-shard", "2",
               "--device", "h100", "--budget", "80%", "-q", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "mesh pp 2 x dp_shard 2 x tp 2: each stage planned as its rank" in text
    assert "== stage 0 (rank 0)" in text and "== stage 1 (rank 1)" in text and "world size 8" in text
    plan = sacplan.load_plan(out)
    from sacplan.models import get_model
    from sacplan.pipeline.presets import preset_pipeline

    fns, _, _ = preset_pipeline(get_model("llama-tiny"), 2, batch=2, seq=32, dtype=None)
    for i, f in enumerate(fns):
        sacplan.apply_plan(f(), plan, stage=i)  # the stage's part, checked against the module


@pytest.mark.parametrize("argv, msg", [
    (["--pp", "2", "--tp", "3", "--seq", "48"], "tensor parallel degree 3 does not divide n_heads=4"),
    (["--pp", "3", "--tp", "2"], "3 pipeline stages need at least 3 layers"),
    (["--pp", "2", "--tp", "2", "--world-size", "2"], "drop --world-size"),
    (["--pp", "2", "--tp", "2", "--seq", "31"], "--seq 31 does not split into 2 sequence shards"),
])
def test_pp_with_impossible_mesh_layouts_are_one_line_errors(argv, msg, capsys):
    rc = main(["plan", "llama-tiny", "--seq", "32", "-q"] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1


def test_pipeline_ranks_under_world_size_keep_the_mixed_precision_policy():
    """--pp with --world-size and --mixed-precision: each stage is sharded as the one-stage path shards it, with
    FSDP2's policy (the pipeline path used to drop it: master weights planned as bf16)."""
    import argparse

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from sacplan.distributed import shard_stats
    from sacplan.models import get_model
    from sacplan.pipeline.cli import per_rank_stats

    p = get_model("llama-tiny")
    stats = sacplan.collect(p.build, p.example_inputs(2, 32), device="cpu", loss_fn=p.loss_fn, dtype=torch.bfloat16)
    args = argparse.Namespace(world_size=2, mixed_precision="bf16", fsdp_units=None, ddp=False)
    (mixed,) = per_rank_stats([stats], args)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    want = shard_stats(stats, 2, fsdp_units="each block", mode="fsdp", mp_policy=policy)
    plain = shard_stats(stats, 2, fsdp_units="each block", mode="fsdp")
    assert mixed.peak_bytes == want.peak_bytes != plain.peak_bytes


@pytest.mark.parametrize("argv, itemsize", [([], 2), (["--dtype", "fp32"], 4)], ids=["bf16", "fp32"])
def test_pp_stages_hold_the_dtype_asked_for_and_a_float32_rotary_table(monkeypatch, argv, itemsize, capsys):
    """As without --pp (ModelPreset.build): parameters in --dtype (bf16 by default), the rotary table float32 —
    llama-tiny's (max_seq_len 128, head_dim 16) is 128 x 8 x [cos, sin] x 4 bytes = 8,192 bytes in every stage
    (a multiple of the H100 allocator's 512-byte rounding, as each parameter's bytes are rounded)."""
    import sacplan.pipeline.collect as pipeline_collect
    from sacplan.devices import get_device
    from sacplan.models import get_model
    from sacplan.pipeline.presets import preset_pipeline

    got = []
    real = pipeline_collect.collect_pipeline

    def spy(*args, **kwargs):
        got.extend(real(*args, **kwargs))
        return got

    monkeypatch.setattr(pipeline_collect, "collect_pipeline", spy)
    assert main(["plan", "llama-tiny", "--pp", "2", "--microbatches", "2", "--seq", "32", "--device", "h100",
                 "--budget", "80%", "-q"] + argv) == 0
    capsys.readouterr()
    fns, _, _ = preset_pipeline(get_model("llama-tiny"), 2, batch=2, seq=32, dtype=None)
    assert len(got) == 2
    for stats, fn in zip(got, fns):
        root = stats.module("")
        assert root.buffer_bytes == 128 * 8 * 2 * 4
        h100 = get_device("h100")
        assert root.param_bytes == sum(h100.round_alloc(p.numel() * itemsize) for p in fn().parameters())
