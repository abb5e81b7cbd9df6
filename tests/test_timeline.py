"""The one memory model (sacplan.timeline) on the hand-written step of sacplan.testing.synthetic.hand_tree.

hand_tree: fw_post_order = (b0, b1, ""), bw_pre_order = ("", b1, b0); events:
  0 fw    fw_done=3     10 GiB (+ state)
  1 rc b1 bw_started=2  10 GiB (+ state), recompute transient 1 GiB
  2 bw b0 bw_started=3   6 GiB (+ state)
  3 other                3 GiB (+ state)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sacplan.errors import ConfigError
from sacplan.evaluate import event_peaks
from sacplan.solver.problem import SacProblem
from sacplan.testing.synthetic import GiB, hand_tree
from sacplan.timeline import BW, FW, OTHER, RC, Timeline, call_entries
from sacplan.tree import ModuleTree


def test_events_read_by_hand():
    tl = Timeline.of(hand_tree().stats)
    assert tl.phase.tolist() == [FW, RC, BW, OTHER]
    assert tl.base.tolist() == [10 * GiB, 10 * GiB, 6 * GiB, 3 * GiB]
    assert tl.pos.tolist() == [3, 2, 3, 0] and tl.extra.tolist() == [0, GiB, 0, 0]
    assert tl.fw_entries == (("b0", 0), ("b1", 0), ("", 0)) and tl.bw_entries == (("", 0), ("b1", 0), ("b0", 0))
    # stats without bw_done: at an rc event only the recomputed call is inside its backward
    assert tl.held(np.array([0.0, 7.0, 0.0])).tolist() == [0, 7, 0, 0]


def test_peaks_of_b0_fully_discarded_by_hand():
    """b0 frees 4 GiB after its forward and gets it back at its backward start (bw_pre position 2): the loss and
    b1's rc event drop to 6 GiB, b0's backward and the optimizer are unchanged (the worked example's minimum)."""
    tl = Timeline.of(hand_tree().stats)
    m = tl.peaks(np.array([4.0, 0, 0]) * GiB, np.array([0, 0, 4.0]) * GiB)
    assert m.tolist() == [6 * GiB, 6 * GiB, 6 * GiB, 3 * GiB]
    assert event_peaks(hand_tree(), {"b0": [4 * GiB]}) == [6 * GiB, 6 * GiB, 6 * GiB, 3 * GiB]
    # b1 checkpointed too: its rc event (b1 begun: only b0 still discarded) adds the 1 GiB transient: 10 - 4 + 1
    assert event_peaks(hand_tree(), {"b0": [4 * GiB], "b1": [4 * GiB]}) == [2 * GiB, 7 * GiB, 6 * GiB, 3 * GiB]


def test_running_sums_and_freed_by_hand():
    """b0 frees 4 GiB, b1 3 GiB: F = (0, 4, 7, 7) along fw_post_order; G (not yet got back) along bw_pre_order
    (root, b1, b0) = (7, 7, 4, 0). The loss (fw_done 3) counts F[3], b1's rc event (bw_started 2) G[2], b0's
    backward (bw_started 3) G[3]; 2-D inputs give one column per input column (the solver's linear forms)."""
    tl = Timeline.of(hand_tree().stats)
    fw, bw = np.array([4.0, 3.0, 0.0]), np.array([0.0, 3.0, 4.0])
    F, G = tl.running(fw, bw)
    assert F.tolist() == [0, 4, 7, 7] and G.tolist() == [7, 7, 4, 0]
    assert tl.freed(fw, bw).tolist() == [7, 4, 0, 0]
    cols = tl.freed(np.stack([fw, 2 * fw], axis=1), np.stack([bw, 2 * bw], axis=1))
    assert cols.tolist() == [[7, 14], [4, 8], [0, 0], [0, 0]]


@pytest.mark.parametrize("collected, planned, base0", [(1, 1, 12.0), (1, 4, 10.5), (2, 1, 14.0), (2, 2, 12.0)])
def test_state_scales_with_the_planned_world_size(collected, planned, base0):
    """2 GiB of state collected at ``collected`` ranks is 2·collected/planned GiB per rank at ``planned``: more
    ranks shed state, fewer ranks hold more (evaluate ignored the second case before the timeline was shared)."""
    tree = hand_tree(state_bytes=2 * GiB, world_size=collected)
    assert Timeline.of(tree.stats, planned).base[0] == base0 * GiB
    assert event_peaks(tree, {}, planned)[0] == base0 * GiB
    assert SacProblem(tree, planned).baseline_peak() == base0 * GiB


def test_no_events_is_the_whole_step_peak_which_nothing_changes():
    tree = hand_tree()
    bare = ModuleTree(dataclasses.replace(tree.stats, events=()))
    assert event_peaks(bare, {"b0": [4 * GiB]}) == [10 * GiB]
    assert SacProblem(bare).peak([1, 1], [1, 1]) == 10 * GiB


def _pipelined_stage():
    """A first pipeline stage of two under 1F1B with 3 microbatches (F0 F1 B0 F2 B1 B2), written by hand.

    One block ``b`` (4 GiB per call, extra 1 GiB at its rc events) under the root, every call listed:
    fw_post_order = (b, "", b, "", b, ""), bw_pre_order = ("", b, "", b, "", b). Events (base GiB):
      0 fw after F0        fw_done=2 bw_started=0  10
      1 fw after F1        fw_done=4 bw_started=0  18
      2 rc b in B0         fw_done=4 bw_started=2  18   interleaved: mb1 in flight, mb0 re-materialised
      3 fw after F2        fw_done=6 bw_started=2  18   interleaved: mb1 and mb2 in flight
      4 rc b in B1         fw_done=6 bw_started=4  14
      5 bw b in B2         fw_done=6 bw_started=6   6
      6 other                                       2
    """
    from sacplan.stats import MemoryEvent, Phase, TradeOff
    from sacplan.testing.synthetic import manual_stats

    tr = TradeOff(max_discard_bytes=4 * GiB, full_recompute_ms=10.0, points=((0.0, 0.2), (1.0, 1.0)),
                  slopes=(0.8,), intercepts=(0.2,))
    ev = [
        MemoryEvent(Phase.FW, "", 0, 2, 0, 10 * GiB, 0),
        MemoryEvent(Phase.FW, "", 1, 4, 0, 18 * GiB, 0),
        MemoryEvent(Phase.RC, "b", 0, 4, 2, 18 * GiB, 0, 1 * GiB),
        MemoryEvent(Phase.FW, "", 2, 6, 2, 18 * GiB, 0),
        MemoryEvent(Phase.RC, "b", 1, 6, 4, 14 * GiB, 0, 1 * GiB),
        MemoryEvent(Phase.BW, "b", 2, 6, 6, 6 * GiB, 0),
        MemoryEvent(Phase.OTHER, "", 0, 6, 6, 2 * GiB, 0),
    ]
    st = manual_stats([("", None, (0, 0, 0), None), ("b", "", (4 * GiB,) * 3, tr)],
                      ("b", "", "b", "", "b", ""), ("", "b", "", "b", "", "b"), ev)
    return ModuleTree(st)


def test_interleaved_events_count_the_microbatches_in_flight_by_hand():
    """b fully discarded (4 GiB per call): F = (0,4,4,8,8,12,12), B = (0,0,4,4,8,8,12). Forward-only and
    backward-only events read F or G as before; the interleaved ones F[fw_done] - B[bw_started]: event 2 frees mb1's
    4 GiB (not G[2] = 8: mb2 has not run), event 3 mb1's and mb2's 8 GiB (not F[6] = 12: mb0 is back)."""
    tree = _pipelined_stage()
    tl = Timeline.of(tree.stats)
    assert tl.mixed.tolist() == [False, False, True, True, False, False, False]
    fw = np.array([4.0, 0, 4, 0, 4, 0]) * GiB
    bw = np.array([0.0, 4, 0, 4, 0, 4]) * GiB
    assert (tl.freed(fw, bw) / GiB).tolist() == [4, 8, 4, 8, 4, 0, 0]
    # b checkpointed (its rc events add the 1 GiB transient): 6, 10, 15, 10, 11, 6, 2
    assert event_peaks(tree, {"b": [4 * GiB] * 3}) == [g * GiB for g in (6, 10, 15, 10, 11, 6, 2)]


def test_solver_rows_hold_the_interleaved_events():
    """The MILP's rows for interleaved events (F_kf + G_kb - G_0): the smallest peak is event 2's 18 - 4 + 1 = 15
    GiB at full discard (reading it as a backward-only event would give 11), and a plan for 16 GiB keeps every
    event, interleaved ones included, within it as the timeline evaluates it."""
    from sacplan.solver import min_feasible_budget, solve

    tree = _pipelined_stage()
    assert min_feasible_budget(tree) == pytest.approx(15 * GiB, rel=1e-6)
    plan = solve(tree, 16 * GiB)
    assert [d.fqn for d in plan.decisions] == ["b"]
    r = plan.decisions[0].discard_ratio
    assert r == pytest.approx(0.75, abs=1e-3)  # event 2: 18 - 4r + 1 <= 16
    assert max(event_peaks(tree, {"b": [int(r * 4 * GiB)] * 3})) <= 16 * GiB + 1
    assert plan.predicted_peak_bytes <= 16 * GiB + 1


@pytest.mark.parametrize("ws", [0, -1, 1.5, True, "2"])
def test_world_size_must_be_a_positive_integer(ws):
    with pytest.raises(ConfigError, match="world_size must be an integer >= 1"):
        Timeline.of(hand_tree().stats, ws)


def test_call_entries_count_occurrences():
    assert call_entries(["a", "b", "a", "", "a"]) == (("a", 0), ("b", 0), ("a", 1), ("", 0), ("a", 2))
