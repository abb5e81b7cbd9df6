"""Non-reentrant checkpoint holds a region's inputs until its backward: inputs nothing else saves cost memory.

``Linear(32, 64) -> [Dropout(0.5) -> Linear(64, 64) -> GELU -> Linear(64, 64)] -> Linear(64, 512) -> GELU ->
Linear(512, 32)`` on a (256, 32) fp32 batch. The inner
block's input (the first Linear's output, 256·64·4 = 65,536 B) is saved by nothing (dropout saves only its mask,
the inner Linear saves dropout's output), so the step frees it in the forward; checkpointing the block (or the
dropout) keeps it alive until the block's backward instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.solver import min_feasible_budget, solve
from sacplan.tree import ModuleTree
from sacplan.validation import validate


def _model() -> nn.Module:
    block = nn.Sequential(nn.Dropout(0.5), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    return nn.Sequential(nn.Linear(32, 64), block, nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 32))


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(256, 32),)


def test_held_input_bytes_by_hand() -> None:
    stats = collect(_model, _inputs(), device=CPU, optimizer=False)
    held = 256 * 64 * 4
    assert stats.module("1").held_input_bytes == (held,)
    assert stats.module("1.0").held_input_bytes == (held,)  # the same storage
    # Linear 0's input is the step's input (not an activation); the other Linears save their own inputs.
    for fqn in ("0", "1.1", "1.2", "1.3", "2", "3", "4"):
        assert stats.module(fqn).held_input_bytes == (0,), fqn


def test_plan_checkpointing_the_dropout_is_predicted_exactly() -> None:
    torch.manual_seed(0)
    tree = ModuleTree(collect(_model, _inputs(), device=CPU, optimizer=False))
    budget = min_feasible_budget(tree, ac_units=["1"])
    assert budget < tree.stats.peak_bytes
    plan = solve(tree, f"{budget}B", ac_units=["1"])
    assert [d.fqn for d in plan.decisions] == ["1"]
    r = validate(_model, _inputs, plan, optimizer=False, device="cpu")
    # Without the held input the prediction was 65,536 B (of ~350 KB) short.
    assert abs(r.peak_error) < 0.005, r.summary()
    assert r.predicted_peak_bytes <= budget


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_solver_and_evaluator_count_held_inputs_alike() -> None:
    """The MILP's event peaks (``SacProblem.peaks``) equal ``evaluate.event_peaks`` for every antichain of
    fully checkpointed modules (held inputs and the host's stashed RNG state included), on a 2-layer
    ``nn.TransformerEncoder`` whose second layer holds its input when checkpointed."""
    import itertools

    import numpy as np

    from sacplan.evaluate import event_peaks
    from sacplan.solver.problem import SacProblem

    tree = ModuleTree(collect(_encoder, (torch.randn(4, 16, 32),), device=CPU, optimizer=False))
    assert tree.node("layers.1").stats.held_input_bytes[0] > 0
    P = SacProblem(tree)
    fqns = [c.fqn for c in P.candidates]
    tried = 0
    for k in range(1, 4):
        for pick in itertools.combinations(range(len(fqns)), k):
            y = np.zeros(len(fqns))
            y[list(pick)] = 1.0
            if not P.nesting_ok(y):
                continue
            discards = {fqns[s]: tuple(P.candidates[s].act_bytes) for s in pick}
            assert P.peaks(y, y).tolist() == pytest.approx(event_peaks(tree, discards), abs=1e-6), discards
            tried += 1
    assert tried >= 10
