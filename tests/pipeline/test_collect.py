"""collect_pipeline on fakes (in-process, fake process group): per-rank stats over the schedule's real order, and
per-rank plans on them. The real-step checks (gloo ranks) are in test_gloo.py."""

from __future__ import annotations

import pytest
import torch

from sacplan.errors import ConfigError
from sacplan.evaluate import predict
from sacplan.pipeline import collect_pipeline
from sacplan.solver import min_feasible_budget, solve
from sacplan.timeline import Timeline
from sacplan.tree import ModuleTree
from sacplan.units import Bytes
from sacplan.validation import plan_choices
from tests.pipeline._stages import batch, stage_fns

M = 4


@pytest.fixture(scope="module")
def one_f_one_b():
    return collect_pipeline(stage_fns(2, blocks=1), batch(4 * M), schedule="1F1B", microbatches=M, device="cpu")


def test_each_rank_runs_every_microbatch_in_the_schedules_order(one_f_one_b):
    """Every module call of every microbatch is one call in the rank's orders; the first stage of two under 1F1B
    starts a forward after a backward began (F0 F1 B0 F2 …), so its timeline has interleaved events."""
    for r, s in enumerate(one_f_one_b):
        info = dict(s.meta["pipeline"])
        assert len(info.pop("stage_fingerprints")) == 2
        assert info == dict(schedule="Schedule1F1B", microbatches=M, rank=r, num_ranks=2, stages=[r], num_stages=2)
        assert s.meta["pipeline"]["stage_fingerprints"][r] == s.fingerprint  # a single-stage rank is its stage
        assert s.modules[0].fqn == "" and s.modules[0].calls == M
        assert s.fw_post_order.count("blocks.0") == M == s.bw_pre_order.count("blocks.0")
        assert len(set(s.modules[1].act_bytes)) == 1  # identical microbatches
    assert Timeline.of(one_f_one_b[0]).mixed.any()


def _max_in_flight(stats) -> int:
    """Most microbatches whose stage forward finished and whose stage backward had not begun, over the events."""
    tl = Timeline.of(stats)
    done = [0]
    for f in stats.fw_post_order:
        done.append(done[-1] + (f == ""))
    begun = [0]
    for f in stats.bw_pre_order:
        begun.append(begun[-1] + (f == ""))
    return max(done[int(a)] - begun[int(b)] for a, b in zip(tl.fw_pos, tl.bw_pos))


def test_microbatches_in_flight_follow_the_schedule(one_f_one_b):
    """1F1B: stage i of p holds up to p - i microbatches (2 on the first stage, 1 on the last); GPipe holds all M.
    The GPipe first stage peaks higher with the same per-call activations."""
    assert [_max_in_flight(s) for s in one_f_one_b] == [2, 1]
    gpipe = collect_pipeline(stage_fns(2, blocks=1), batch(4 * M), schedule="GPipe", microbatches=M, device="cpu")
    assert [_max_in_flight(s) for s in gpipe] == [M, M]
    assert not Timeline.of(gpipe[0]).mixed.any()  # all forwards, then all backwards
    assert gpipe[0].modules[0].act_bytes == one_f_one_b[0].modules[0].act_bytes
    assert gpipe[0].peak_bytes > one_f_one_b[0].peak_bytes


def test_each_rank_gets_a_plan_within_its_budget(one_f_one_b):
    """solve(ModuleTree(stats[r]), budget) plans rank r; its prediction is the timeline's for the plan (the MILP's
    interleaved rows and the timeline agree), and the plan changes every in-flight microbatch (one decision per
    module: the decided module's every call is discarded)."""
    assert min_feasible_budget(ModuleTree(one_f_one_b[0])) < one_f_one_b[0].peak_bytes  # two in flight: room to save
    for s in one_f_one_b:
        tree = ModuleTree(s)
        lo = min_feasible_budget(tree)
        budget = int(lo + 0.3 * (s.peak_bytes - lo))
        plan = solve(tree, Bytes(budget))
        assert plan.predicted_peak_bytes <= budget
        assert bool(plan.decisions) == (lo < s.peak_bytes)
        assert predict(tree, plan_choices(plan)).peak_bytes == plan.predicted_peak_bytes


def test_interleaved_rank_holds_its_stages_under_one_module():
    stats = collect_pipeline(stage_fns(4, blocks=1), batch(4 * M), schedule="interleaved-1f1b", microbatches=M,
                             num_ranks=2, device="cpu")
    assert [s.meta["pipeline"]["stages"] for s in stats] == [[0, 2], [1, 3]]
    names = {m.fqn for m in stats[1].modules}
    assert {"", "stage1", "stage3", "stage3.head", "stage1.blocks.0"} <= names
    assert stats[1].module("stage1").calls == M == stats[1].module("stage3").calls


def _bad_stage():
    return torch.nn.Flatten(0, -1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="zero-bubble"), "unknown pipeline schedule"),
    (dict(schedule="Interleaved1F1B"), "pass num_ranks"),
    (dict(num_ranks=3), "one stage per rank: 2 stages need 2 ranks"),
    (dict(schedule="Interleaved1F1B", num_ranks=2), "at least 2 per rank"),
    (dict(microbatches=0), "microbatches must be an integer >= 1"),
])
def test_bad_arguments_say_what_to_do(kwargs, match):
    kw = dict(schedule="1F1B", microbatches=M, device="cpu") | kwargs
    with pytest.raises(ConfigError, match=match):
        collect_pipeline(stage_fns(2, blocks=1), batch(4 * M), **kw)


def test_a_stage_that_does_not_take_the_previous_output_is_named():
    fns = stage_fns(2, blocks=1)
    with pytest.raises(ConfigError, match="pipeline stage 1 failed on its input"):
        collect_pipeline([fns[0], lambda: torch.nn.Linear(7, 7)], batch(4 * M), microbatches=M, device="cpu")


def test_refuses_inside_a_running_process_group(tmp_path):
    """The fake process group must be the process's default one: inside a running job, say where to plan instead."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="before torch.distributed.init_process_group"):
            collect_pipeline(stage_fns(2, blocks=1), batch(4 * M), microbatches=M, device="cpu")
    finally:
        dist.destroy_process_group()


def test_checkpoint_held_inputs_count_forwards_after_a_backward():
    """A bf16 RMSNorm saves its float32 copy of the input, not the input: checkpointed, the region holds its bf16
    input (1 x 64 x 64 x 2 = 8,192 bytes per microbatch) until its backward. Under 1F1B the first rank runs
    F0 F1 B0 F2 B1 F3 …: microbatches 2 and 3 free that input in forwards that run after a backward began, and
    hold it as much as microbatches 0 and 1."""
    from sacplan.models import get_model
    from sacplan.pipeline.presets import preset_pipeline

    fns, toks, loss = preset_pipeline(get_model("llama-tiny"), 2, batch=4, seq=64, dtype=torch.bfloat16)
    stats = collect_pipeline(fns, toks, schedule="1F1B", microbatches=4, loss_fn=loss, target=toks, device="cpu")
    assert stats[0].module("layers.0.ffn_norm").held_input_bytes == (8192,) * 4
    assert stats[1].module("layers.1.ffn_norm").held_input_bytes == (8192,) * 4
