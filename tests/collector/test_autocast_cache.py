"""Autocast's weight cache keeps a checkpointed call's saved weight cast until the forward ends.

``Linear(32, 64) -> Linear(64, 32)`` (no biases) on an (8, 32) fp32 batch that needs no gradient, forward and loss
under CPU bf16 autocast (a ``train_step``). Linear ``1``'s input (Linear ``0``'s bf16 output) needs a gradient, so
its ``mm`` saves the bf16 copy of its weight: 64·32·2 = 4,096 B, the whole of ``1``'s activations. Linear ``0``'s
input needs none: its weight's copy is saved by nothing (autocast's cache alone holds it; not an activation).

Checkpointing ``1`` discards its weight copy for the backward, but autocast's cache holds the copy until the
context exits, after the loss: the forward events after ``1``'s forward (the root's end, the loss) keep the 4,096
B; the backward events before ``1``'s backward begins get them off.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.evaluate import event_peaks, module_outcome
from sacplan.solver.problem import SacProblem
from sacplan.stats import ModelStats, Phase
from sacplan.timeline import Timeline
from sacplan.tree import ModuleTree

CAST = 64 * 32 * 2  # bytes of Linear 1's weight in bf16


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))


def _step(model: nn.Module, args: tuple, opt: object) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*args).float().square().mean()
    loss.backward()


def _stats() -> ModelStats:
    return collect(_build, (torch.randn(8, 32),), device=CPU, optimizer=False, train_step=_step)


def test_cache_held_by_hand() -> None:
    stats = _stats()
    assert stats.module("1").act_bytes == (CAST,)
    assert stats.module("1").cache_held == (CAST,)
    assert stats.module("").cache_held == (CAST,)  # the root encloses the call
    assert stats.module("0").cache_held == ()  # its weight's copy is saved by nothing: not an activation at all


def test_the_loss_is_a_forward_event() -> None:
    """The stretch from the root's forward end to the backward's first op (the loss, under autocast) is forward."""
    stats = _stats()
    n = len(stats.fw_post_order)  # every forward ended: only the loss runs then (the root's end is at n - 1)
    assert [e.phase for e in stats.events if e.fw_done == n and e.bw_started == 0] == [Phase.FW, Phase.BW]


def test_forward_events_keep_the_cached_cast_backward_ones_do_not() -> None:
    stats = _stats()
    tree = ModuleTree(stats)
    tl = Timeline.of(stats)
    peaks = np.asarray(event_peaks(tree, {"1": (CAST,)}), dtype=float)
    after_fw = stats.fw_post_order.index("1") + 1  # fw_done once 1's forward has ended
    fw_after = [i for i, e in enumerate(stats.events) if e.phase == Phase.FW and e.fw_done >= after_fw]
    bw_before = [i for i, e in enumerate(stats.events) if e.phase == Phase.BW and e.bw_started == 0]
    assert fw_after and bw_before
    np.testing.assert_array_equal(peaks[fw_after], tl.base[fw_after])
    np.testing.assert_array_equal(peaks[bw_before], tl.base[bw_before] - CAST)
    # the solver's evaluation agrees, event by event
    problem = SacProblem(tree, ac_units=["1"])
    assert [c.fqn for c in problem.candidates] == ["1"]
    assert problem.fw_over.tolist() == [CAST] and problem.bw_over.tolist() == [0.0]
    np.testing.assert_array_equal(problem.peaks([1.0], [1.0]), peaks)


def test_cache_held_survives_json_and_old_files_read_as_empty() -> None:
    d = _stats().to_dict()
    assert ModelStats.from_dict(d).module("1").cache_held == (CAST,)
    for m in d["modules"]:
        del m["cache_held"]
    assert ModelStats.from_dict(d).module("1").cache_held == ()


def test_a_cached_cast_is_never_saved() -> None:
    """Naming Linear 1's weight cast in a save list keeps nothing: autocast's cache holds it through the forward
    anyway, and the memory model frees it at backward events only (a kept one would be counted twice)."""
    ops = _stats().module("1").ops
    assert [(o.name, o.cached_cast) for o in ops] == [
        ("aten._to_copy.default", True), ("aten.t.default", False), ("aten.mm.default", False)]
    out = module_outcome(_stats().module("1"), frozenset({("aten._to_copy.default", 0)}))
    assert out.saved_keys == frozenset() and out.discard_bytes == (CAST,)
