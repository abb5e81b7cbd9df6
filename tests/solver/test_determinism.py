"""The same stats and budget give the same plan, byte for byte, on every run, in every process and under any load
(issue 26): ranks of a job that plan for themselves must agree, or their checkpointing (and collectives) differ.

Every search here is ended by counted work (branch-and-bound nodes, the tree and chain DPs' work units), never by the wall
clock, which is only a safety net: a competing process burning CPU must not change a byte of the plan. No
assertion is on wall-clock time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from sacplan.solver import SolverOptions, TimeLimitWarning, baseline_peak, min_feasible_budget, solve
from sacplan.solver import limits
from sacplan.testing.llama_tree import llama_tree

ROOT = Path(__file__).resolve().parents[2]

#: label -> (llama_tree blocks, budget as a fraction of the way from the minimum to the peak, SolverOptions
#: fields): searches stopped by their work limit (HiGHS's node count with count branching; CBC's maxNodes), the
#: MILP proving its optimum, the tree DP, the lines mode
CASES = {
    "work limit (highs)": (8, 0.3, dict(tree_dp=False, work_limit=5, solver="highs")),
    "work limit (cbc)": (32, 0.3, dict(tree_dp=False, work_limit=1, solver="cbc")),
    "milp optimum": (8, 0.3, dict(tree_dp=False)),
    "tree dp": (8, 0.3, dict()),
    "chain dp": (8, 0.1, dict()),
    "lines": (8, 0.3, dict(exact=False)),
}


def plan_json(case: str) -> str:
    """The plan of ``CASES[case]`` (a Llama tree planned for 2 ranks) as JSON without the wall-clock figures
    (``Plan.to_dict(timings=False)``)."""
    blocks, frac, options = CASES[case]
    tree = llama_tree(n_blocks=blocks, world_size=2)
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimeLimitWarning)
        plan = solve(tree, f"{int(lo + frac * (hi - lo))}B", options=SolverOptions(**options))
    return json.dumps(plan.to_dict(timings=False), sort_keys=True)


def _burner() -> subprocess.Popen:
    """A process keeping a core busy (the competing load)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_a_work_limit_stops_the_search_at_the_same_point_under_load():
    first = {c: plan_json(c) for c in CASES}
    stopped = json.loads(first["work limit (highs)"])
    assert stopped["status"] == "time_limit" and stopped["gap"] > 0  # the work limit did end that search
    assert stopped["meta"]["stopped_by"] == ["work limit: sacplan_sac"]
    assert json.loads(first["work limit (cbc)"])["meta"]["stopped_by"] == ["work limit: sacplan_sac"]
    assert json.loads(first["tree dp"])["meta"]["proved_by"] == "tree-dp"
    assert json.loads(first["chain dp"])["meta"]["proved_by"] == "chain-dp"
    burners = [_burner() for _ in range(2)]
    try:
        again = {c: plan_json(c) for c in CASES}
    finally:
        for b in burners:
            b.kill()
            b.wait()
    for c in CASES:
        assert again[c] == first[c], c


@pytest.mark.slow  # two fresh interpreters importing torch: ~10 s on a quiet 2-core host
def test_ranks_planning_for_themselves_get_the_same_bytes():
    """Two processes (two ranks), different hash seeds (set and dict orders), one CPU burner beside them: each
    plans the work-limited case and the tree DP's; the JSON is identical to this process's."""
    code = ("import json, sys, warnings; sys.path.insert(0, sys.argv[1]); warnings.simplefilter('ignore');"
            "from tests.solver.test_determinism import plan_json;"
            "print(json.dumps([plan_json('work limit (highs)'), plan_json('tree dp')]))")
    burner = _burner()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", code, str(ROOT)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(ROOT)})
                 for seed in (1, 2)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        burner.kill()
        burner.wait()
    assert all(p.returncode == 0 for p in procs)
    mine = [plan_json("work limit (highs)"), plan_json("tree dp")]
    for out in outs:
        assert json.loads(out) == mine


def test_the_wall_clock_safety_net_is_reported_loudly():
    """A wall-clock limit that fires is the one non-deterministic stop: the plan's meta names it and the warning
    says that ranks may differ."""
    tree = llama_tree(n_blocks=8, world_size=2)
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    budget = int(lo + 0.1 * (hi - lo))  # the count branching needs several nodes here: the clock cuts it
    with pytest.warns(TimeLimitWarning, match="NOT deterministic"):
        plan = solve(tree, f"{budget}B", options=SolverOptions(tree_dp=False, time_limit_s=1e-4, work_limit=None))
    assert any(s.startswith(limits.WALL_CLOCK) for s in plan.meta["stopped_by"])
    assert plan.predicted_peak_bytes <= budget


def test_work_limit_is_validated():
    from sacplan.errors import ConfigError

    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ConfigError, match="work_limit"):
            SolverOptions(work_limit=bad)
    assert SolverOptions(work_limit=None).work_limit is None
    assert SolverOptions().work_limit == limits.DEFAULT_WORK_NODES
