"""``collect(mesh=..., parallelize=...)`` on the fake process group vs real gloo ranks (CPU, spawned, FileStore).

The prediction runs :func:`sacplan.models.llama_parallel.parallelize_llama` (torchtitan's TP plan with
sequence parallelism, FSDP2 each block + [norm, output] + root) on PyTorch's fake process group as rank 0;
each real rank runs the same function on a gloo ``DeviceMesh`` (see ``_fsdp_run``). Checked per rank, without
and with the plan solved on the fake rank's stats: StepRecorder peak within 1% of the prediction; gradients
bitwise equal with vs without the plan; full gradients close to a single-process model on all data-parallel
batches. Layouts: TP 2; FSDP 2 x TP 2 (4 ranks); FSDP 2 with bf16 mixed precision.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import _fsdp_run, _mp

pytestmark = pytest.mark.distributed

LAYERS, BATCH, SEQ = 2, 2, 64
LAYOUTS = {  # name: (dp_shard, tp, bf16 mixed precision)
    "tp2": (1, 2, False),
    "fsdp2xtp2": (2, 2, False),
    "fsdp2-bf16": (2, 1, True),
}


def _tokens(dp_rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _policy(mixed: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None


def _measure(rank: int, ws: int, layout: str, plan_dict: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from sacplan.models import get_model
    from sacplan.models.llama_parallel import parallelize_llama

    dp, tp, mixed = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    preset = get_model("llama-tiny")
    vocab = preset.config.vocab_size
    toks = _tokens(mesh.get_local_rank("dp_shard"), vocab)  # TP ranks of one data-parallel rank share a batch

    def reference() -> list[torch.Tensor]:  # single process, fp32, every data-parallel batch: mean of means
        torch.manual_seed(0)
        ref = preset.build(n_layers=LAYERS)
        all_toks = torch.cat([_tokens(r, vocab) for r in range(dp)])
        preset.loss_fn(ref(all_toks), all_toks).backward()
        return [p.grad for p in ref.parameters()]

    tol = dict(rtol=0.05, atol=2e-3) if mixed else dict(rtol=1e-4, atol=1e-6)
    return _fsdp_run.measure_rank(
        lambda: preset.build(n_layers=LAYERS), lambda m: parallelize_llama(m, mesh, mp_policy=_policy(mixed)),
        preset.loss_fn, toks, plan_dict, "before", reference=reference, **tol,
    )


def worker(rank: int, ws: int, rdzv: str, layout: str, plan_dict: dict, q) -> None:
    _mp.init(rank, ws, rdzv)
    _mp.guarded(rank, q, lambda: _measure(rank, ws, layout, plan_dict))


def predicted(layout: str):
    """Stats of rank 0 on the fake process group, and a plan halfway between the minimum and no checkpointing."""
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.distributed import unit_modules
    from sacplan.models import get_model
    from sacplan.models.llama_parallel import parallelize_llama
    from sacplan.solver import baseline_peak, min_feasible_budget, solve
    from sacplan.tree import ModuleTree

    dp, tp, mixed = LAYOUTS[layout]
    preset = get_model("llama-tiny")
    stats = collect(lambda: preset.build(n_layers=LAYERS), _tokens(0, preset.config.vocab_size), device=CPU,
                    loss_fn=preset.loss_fn, mesh={"dp_shard": dp, "tp": tp},
                    parallelize=lambda m, mesh: parallelize_llama(m, mesh, mp_policy=_policy(mixed)))
    tree = ModuleTree(stats)
    units = unit_modules(stats)
    base = baseline_peak(tree)
    lo = min_feasible_budget(tree, fsdp_units=units)
    plan = solve(tree, lo + (base - lo) // 2, fsdp_units=units)
    return stats, plan, base


@pytest.mark.parametrize(
    "layout",
    ["tp2", pytest.param("fsdp2xtp2", marks=pytest.mark.slow), pytest.param("fsdp2-bf16", marks=pytest.mark.slow)],
)
def test_fake_mesh_rank_matches_real_ranks(tmp_path, layout):
    stats, plan, base = predicted(layout)
    assert plan.decisions, "the budget should need checkpointing"
    dp, tp, _ = LAYOUTS[layout]
    assert stats.world_size == dp * tp and stats.meta["distributed"]["rank"] == 0
    _fsdp_run.check_ranks(layout, _mp.spawn(worker, dp * tp, tmp_path, layout, plan.to_dict()), plan, base)


@pytest.mark.slow
def test_example_trains_on_four_ranks():
    """examples/train_2d_llama.py: plans on the fake group, trains 3 steps on 4 gloo ranks, peaks within 1%."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "examples/train_2d_llama.py"], cwd=root, capture_output=True, text=True,
                         timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = re.findall(r"rank (\d): measured peak ([\d.]+) MiB, predicted ([\d.]+) MiB", out.stdout)
    assert sorted(int(r) for r, _, _ in peaks) == [0, 1, 2, 3], out.stdout
    assert all(abs(float(m) - float(p)) / float(m) < 0.01 for _, m, p in peaks), out.stdout
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]
