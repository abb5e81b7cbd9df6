"""A plan's checkpoint around compiled blocks: the eager prediction, the fallback bound, the compiled step traced on
fakes, and the measured compiled step (bytes), for the fuzz regression of seed 13
(tests/fuzz/test_regressions.py ``test_compiled_blocks_inside_a_selective_region``).

    PYTHONPATH=$PWD python3 benchmarks/compiled_enclosing_bound.py

The bound is :func:`sacplan.compiled_saves.with_compiled_saves` on the eager step (what validate falls back to
when a region cannot be traced on fakes); the traced prediction is :func:`sacplan.compiled_partition.compiled_step`
(what validate uses when it can); the measurement is :func:`sacplan.validate` with ``compile=True``.
"""

from __future__ import annotations

import warnings

import torch

from sacplan.blocks import repeated_blocks
from sacplan.collector import collect
from sacplan.compiled_partition import compiled_step
from sacplan.compiled_saves import with_compiled_saves
from sacplan.devices import CPU
from sacplan.evaluate import predict
from sacplan.solver import min_feasible_budget, solve
from sacplan.testing.fuzzcheck import step_arguments
from sacplan.testing.fuzzmodels import Layer, ModelSpec
from sacplan.testing.fuzzmodules import build_model, make_inputs
from sacplan.tree import ModuleTree
from sacplan.units import Bytes
from sacplan.validation import plan_choices, validate

SPEC = ModelSpec(layers=(Layer("list", children=(Layer("norm", act="silu", option=2, heads=4, kv_heads=4),) * 2),),
                 dim=128, batch=4, seq=32, seed=9283, loss="mse_loss", optimizer="adamw")


def main() -> None:
    kw = dict(step_arguments(SPEC), device=CPU)
    stats = collect(lambda: build_model(SPEC), make_inputs(SPEC), **kw)
    tree = ModuleTree(stats)
    lo, hi = int(min_feasible_budget(tree)), int(stats.peak_bytes)
    plan = solve(tree, Bytes(lo + round(0.26 * (hi - lo))))
    blocks = repeated_blocks(stats)
    print(f"plan: {[d.fqn for d in plan.decisions]}, compiled blocks {list(blocks)}")
    rows = {
        "eager prediction": predict(tree, plan_choices(plan)).peak_bytes,
        "fallback bound (with_compiled_saves)": predict(ModuleTree(with_compiled_saves(stats, blocks)),
                                                        plan_choices(plan)).peak_bytes,
        "traced on fakes (compiled_step)": compiled_step(lambda: build_model(SPEC), make_inputs(SPEC), blocks, plan,
                                                         **kw).peak_bytes,
    }
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = validate(lambda: build_model(SPEC), lambda: make_inputs(SPEC), plan, device="cpu", seed=SPEC.seed,
                       timed_steps=0, compile=True, **step_arguments(SPEC))
    measured = rep.planned.peak_bytes
    for name, b in rows.items():
        print(f"{name:40s} {b:>9,d} B  {(b - measured) / measured:+.2%} vs measured")
    print(f"{'measured (validate, compile=True)':40s} {measured:>9,d} B")


if __name__ == "__main__":
    main()
