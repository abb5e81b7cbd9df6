"""Pipeline parallelism composed with FSDP2 / TP on fakes: ``collect_pipeline(mesh=, parallelize=)`` and the CLI's
``--pp`` with ``--tp/--dp-shard`` (tiny Llama stages, in-process, PyTorch's fake process group)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import sacplan
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import ConfigError
from sacplan.models import get_model
from sacplan.models.llama import next_token_loss
from sacplan.models.llama_parallel import parallelize_llama
from sacplan.pipeline import collect_pipeline, solve_pipeline
from sacplan.pipeline.mesh import mesh_stage_io, pipeline_dims
from sacplan.pipeline.presets import preset_pipeline
from sacplan.solver import min_feasible_budget
from sacplan.tree import ModuleTree
from sacplan.units import Bytes

# torchtitan's layout hands on outputs through to_local() (views): FSDP2 warns, nothing writes to them in place
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")

PRESET = get_model("llama-tiny")  # dim 64, 4 heads, 2 KV heads, 2 layers, vocab 256
M, SEQ = 2, 32
PAR = functools.partial(parallelize_llama, reshard_after_forward=False)  # torchtitan's FSDP2 under PP


def _job(stages: int = 2, **overrides):
    return preset_pipeline(PRESET, stages, batch=2 * M, seq=SEQ, dtype=None, overrides=overrides or None)


def _collect(mesh: dict, stages: int = 2, schedule: str = "1F1B", num_ranks: int | None = None, **overrides):
    fns, toks, loss = _job(stages, **overrides)
    return collect_pipeline(fns, toks, schedule=schedule, microbatches=M, num_ranks=num_ranks, loss_fn=loss,
                            target=toks, device=CPU, mesh=mesh, parallelize=PAR)


@pytest.fixture(scope="module")
def pp2_dp2_tp2():
    return _collect({"dp_shard": 2, "tp": 2})


def _solve_halfway(stats):
    budgets = []
    for s in stats:
        lo = min_feasible_budget(ModuleTree(s))
        budgets.append(Bytes(int(lo + 0.5 * (s.peak_bytes - lo))))
    return solve_pipeline(stats, budgets), budgets


def test_each_pipeline_rank_is_coordinate_zero_of_the_composed_mesh(pp2_dp2_tp2):
    for r, s in enumerate(pp2_dp2_tp2):
        d = s.meta["distributed"]
        assert d["mesh"] == {"pp": 2, "dp_shard": 2, "tp": 2} and s.world_size == 8
        assert d["rank"] == 4 * r and d["coordinate"] == {"pp": r, "dp_shard": 0, "tp": 0}
        assert s.meta["pipeline"]["rank"] == r and s.modules[0].calls == M
    # FSDP2's units per stage: the first stage has no [norm, output] group
    assert pp2_dp2_tp2[0].meta["distributed"]["units"] == ["", "layers.0"]
    assert pp2_dp2_tp2[1].meta["distributed"]["units"] == ["", "layers.1", ["norm", "output"]]
    assert not dist.is_initialized()


def test_stage_boundary_is_the_sequence_shard_under_sequence_parallelism():
    """torchtitan's TP plan hands the next stage its sequence shard (S / tp), so PipelineStage is built with it."""
    fns, toks, _ = _job()
    io = mesh_stage_io(fns, toks, M, None, pipeline_dims(2, {"tp": 2}), PAR)
    assert io[0].inputs[0].shape == (2, SEQ) and io[0].outputs[0].shape == (2, SEQ // 2, 64)
    assert io[1].inputs[0].shape == (2, SEQ // 2, 64) and io[1].outputs[0].shape == (2, SEQ, 256)  # full logits
    assert not dist.is_initialized()


def _stage_alone(i: int, mesh: dict, io):
    """The 2-D collect of stage ``i`` alone (no pipeline) on the same mesh, fed one microbatch's boundary."""
    fns, toks, _ = _job()
    x = toks[:2] if i == 0 else torch.randn(io[i].inputs[0].shape)
    loss = (lambda out, args: next_token_loss(out, toks[:2])) if i == 1 else (lambda out, args: out.float().mean())
    return collect(fns[i], x, device=CPU, loss_fn=loss, mesh=mesh, parallelize=PAR)


def test_per_stage_state_bytes_equal_the_2d_collect_of_the_stage(pp2_dp2_tp2):
    """Parameters, gradients and optimizer state of every pipeline rank are its stage's FSDP x TP shards: the
    same bytes as collect(mesh=...) of that stage module without pipelining; and they are sharded (a quarter of
    the TP/FSDP-split weights, the norms split by FSDP only)."""
    mesh = {"dp_shard": 2, "tp": 2}
    fns, toks, _ = _job()
    io = mesh_stage_io(fns, toks, M, None, pipeline_dims(2, mesh), PAR)
    for i, s in enumerate(pp2_dp2_tp2):
        alone = _stage_alone(i, mesh, io)
        assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (alone.param_bytes, alone.grad_bytes, alone.optimizer_bytes)
        full = fns[i]()
        norms = sum(p.numel() for n, p in full.named_parameters() if "norm" in n)
        split = sum(p.numel() for p in full.parameters()) - norms
        assert s.param_bytes == 4 * (split // 4 + norms // 2)
        assert s.grad_bytes == s.param_bytes and s.optimizer_bytes >= 2 * s.param_bytes


def test_composed_ranks_solve_within_their_budgets(pp2_dp2_tp2, tmp_path):
    plan, budgets = _solve_halfway(pp2_dp2_tp2)
    assert plan.num_ranks == 2 and plan.rank_stages == ((0,), (1,))
    for p, b in zip(plan.plans, budgets):
        assert p.predicted_peak_bytes <= int(b) and p.decisions
    out = plan.save(tmp_path / "pp.json")
    loaded = sacplan.load_plan(out)
    fns, _, _ = _job()
    stage = fns[1]()
    sacplan.apply_plan(stage, loaded, stage=1)  # checked against the unparallelized stage module
    with pytest.raises(sacplan.PlanMismatchError, match="not pipeline stage 0"):
        sacplan.apply_plan(fns[1](), loaded, stage=0)


def test_pp2_tp2_collects_and_solves():
    stats = _collect({"tp": 2})
    assert [s.meta["distributed"]["units"] for s in stats] == [[], []]  # no fully_shard
    plan, budgets = _solve_halfway(stats)
    assert all(p.predicted_peak_bytes <= int(b) for p, b in zip(plan.plans, budgets))
    # TP only: every Linear / Embedding weight halved, the norms whole
    full = _job()[0][0]()
    norms = sum(p.numel() for n, p in full.named_parameters() if "norm" in n)
    assert stats[0].param_bytes == 4 * ((sum(p.numel() for p in full.parameters()) - norms) // 2 + norms)


def test_interleaved_rank_parallelizes_each_of_its_stages():
    """Interleaved1F1B: the rank module holds two stages; each is parallelized on its own (its own FSDP2 root)."""
    stats = _collect({"dp_shard": 2}, stages=4, schedule="Interleaved1F1B", num_ranks=2, n_layers=4)
    assert stats[0].meta["pipeline"]["stages"] == [0, 2]
    assert stats[0].meta["distributed"]["units"] == ["stage0", "stage0.layers.0", "stage2", "stage2.layers.2"]
    plan, budgets = _solve_halfway(stats)
    assert all(p.predicted_peak_bytes <= int(b) for p, b in zip(plan.plans, budgets))


@pytest.mark.parametrize("mesh, kw, msg", [
    ({"tp": 3}, {}, "tensor parallel degree 3 does not divide n_heads=4: pick a TP degree dividing it"),
    ({"pp": 2, "tp": 2}, {}, "drop 'pp': num_ranks is the pipeline's size"),
    ({"tp": 2}, {"parallelize": None}, "mesh= and parallelize= go together"),
    ({"tp": 0}, {}, "mesh['tp'] must be an integer >= 1"),
])
def test_impossible_layouts_are_config_errors(mesh, kw, msg):
    fns, toks, loss = _job()
    args = dict(microbatches=M, loss_fn=loss, target=toks, device=CPU, mesh=mesh, parallelize=PAR) | kw
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        collect_pipeline(fns, toks, **args)
    assert not dist.is_initialized()


def test_a_stage_handing_on_a_dtensor_is_told_to_hand_on_local_tensors():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

    def keep_dtensor(stage, mesh):  # every stage returns a DTensor
        style = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False)
        return parallelize_module(stage, mesh, style)

    fns, toks, loss = _job()
    with pytest.raises(ConfigError, match="pipeline stage 0 must return .*DTensor.*local tensors"):
        collect_pipeline(fns, toks, microbatches=M, loss_fn=loss, target=toks, device=CPU, mesh={"tp": 2},
                         parallelize=keep_dtensor)
    assert not dist.is_initialized()
