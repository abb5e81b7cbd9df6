"""sacplan against the usual alternatives, measured on real CPU steps of a small Llama.

At budgets set to the *measured* peaks of full AC per block, every-other-block AC, torchtitan's fixed
op save list and the "save every matmul and attention output" list, sacplan's plan must measure a peak no
higher (1 % tolerance for the profiler) and recompute no more FLOPs. Where the no-AC peak does not fit, sacplan's recompute at the full-AC peak must be at most a
third of full AC's, unless the lower bound over every plan proves that out of reach (then sacplan must be within
2% of that bound).

sacplan minimises recompute *time* on the tree's device. On the CPU spec most of a block's time is memory-bound
pointwise ops, so a time-optimal plan may recompute more FLOPs than torchtitan's save list (it recomputes a
matmul-heavy feed-forward instead of pointwise ops: 0.16 ms vs 0.31 ms predicted, but 54.5 vs 37.7 MFLOP on
this model). The FLOP comparisons therefore plan on stats collected for :data:`FLOP_SPEC` (the same exact CPU
sizes, runtime = FLOPs: infinite bandwidth), i.e. with FLOPs as the objective; the time comparison uses the
CPU roofline stats.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sacplan import alternatives as alt
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.models import get_model
from sacplan.models.llama import Llama
from sacplan.evaluate import predict
from sacplan.solver import solve
from sacplan.validation import plan_choices
from sacplan.tree import ModuleTree

_PRESET = get_model("llama-tiny")
_CFG = _PRESET.config.with_(n_layers=4, dropout=0.0)
#: Exact CPU sizes with runtime proportional to FLOPs (the solver's objective becomes recomputed FLOPs).
# Keeps the name "CPU": host-only size rules (oneDNN conv workspaces) are keyed on it.
FLOP_SPEC = dataclasses.replace(CPU, hbm_bandwidth=1e30)


def _model() -> Llama:
    return Llama(_CFG)


def _inputs() -> tuple:
    return _PRESET.example_inputs(2, 128)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    tree = ModuleTree(collect(_model, _inputs(), device=CPU, loss_fn=_PRESET.loss_fn, optimizer=False))
    torch.manual_seed(0)
    ftree = ModuleTree(collect(_model, _inputs(), device=FLOP_SPEC, loss_fn=_PRESET.loss_fn, optimizer=False))
    no_ac = alt.measure(_model, _inputs, _PRESET.loss_fn, None)
    alts = {}
    for make in (alt.full_ac_plan, alt.every_other_block_plan, alt.torchtitan_op_sac_plan, alt.save_list_plan):
        plan = make(tree)
        alts[make.__name__] = (plan, _run(plan))
    return tree, ftree, no_ac, alts


def _run(plan):
    return alt.measure(_model, _inputs, _PRESET.loss_fn, plan)


def test_blocks_are_the_transformer_layers(setup):
    tree = setup[0]
    assert alt.find_blocks(tree) == [f"layers.{i}" for i in range(4)]


def test_torchtitan_rule_saves_attention_and_odd_mms(setup):
    tree = setup[0]
    ch = alt.torchtitan_choices(tree, ["layers.0"])["layers.0"]
    mms = sorted(k for k in ch if k[0] == "aten.mm.default")
    assert mms == [("aten.mm.default", i) for i in (0, 2, 4, 6)]  # 7 mms per block: 1st, 3rd, 5th, 7th saved
    assert any(k[0] == "<attention>" for k in ch)


_ALTS = ["full_ac_plan", "every_other_block_plan", "torchtitan_op_sac_plan", "save_list_plan"]


@pytest.mark.parametrize("name", _ALTS)
def test_sacplan_no_worse_at_alternatives_peak(setup, name):
    """Equal memory: sacplan (FLOP objective) measures no higher a peak and recomputes no more FLOPs."""
    tree, ftree, no_ac, alts = setup
    plan, m_alt = alts[name]
    assert m_alt["peak_bytes"] < no_ac["peak_bytes"]
    # The measured FLOPs are the plan's own (the measurement is of the plan we think it is).
    assert m_alt["recompute_flops"] == sum(d.recompute_flops for d in plan.decisions)
    ours = solve(ftree, m_alt["peak_bytes"])
    m_ours = _run(ours)
    assert m_ours["peak_bytes"] <= m_alt["peak_bytes"] * 1.01, (m_ours, m_alt)
    assert m_ours["recompute_flops"] <= m_alt["recompute_flops"], (m_ours, m_alt)


@pytest.mark.parametrize("name", _ALTS)
def test_sacplan_time_no_worse_on_cpu_roofline(setup, name):
    """Equal memory, sacplan's own objective (predicted recompute time on the CPU roofline): no worse."""
    tree, _ftree, _no_ac, alts = setup
    plan, m_alt = alts[name]
    ours = solve(tree, m_alt["peak_bytes"])
    assert ours.recompute_ms <= plan.recompute_ms * (1 + 1e-9)
    assert _run(ours)["peak_bytes"] <= m_alt["peak_bytes"] * 1.01


def test_recompute_at_full_ac_peak_is_a_third_or_provably_out_of_reach(setup):
    """Where the no-AC peak does not fit: at full AC's peak, sacplan recomputes at most a third of full AC's
    FLOPs, or no plan at all can and sacplan is within 2% of the best plan there is.

    "No plan can" is decided by :func:`~sacplan.solver.certify`: the MILP over every module (leaves and the
    root too) with each one's whole Pareto front of save lists, proven optimal — the least recompute of any
    plan under the memory model. On this model that is 42.3% of full AC (checkpoint the RMSNorm leaves
    alone, keep most of each block); sacplan's default plan is the same.
    """
    from sacplan.solver import certify

    tree, ftree, no_ac, alts = setup
    full, m_full = alts["full_ac_plan"]
    assert no_ac["peak_bytes"] > m_full["peak_bytes"]  # the no-AC peak does not fit
    ours = solve(ftree, m_full["peak_bytes"])
    m_ours = _run(ours)
    assert m_ours["peak_bytes"] <= m_full["peak_bytes"] * 1.01
    assert m_ours["recompute_flops"] == sum(d.recompute_flops for d in ours.decisions)
    full_ms = predict(ftree, plan_choices(full)).recompute_ms  # FLOP_SPEC: ms proportional to FLOPs
    cert = certify(ftree, m_full["peak_bytes"])
    assert cert.lower_bound_ms <= cert.best_ms + 1e-12 and cert.best_ms <= ours.recompute_ms * (1 + 1e-9)
    if 3 * m_ours["recompute_flops"] > m_full["recompute_flops"]:
        assert cert.proven, cert
        assert 3 * cert.best_ms > full_ms, f"a third of full AC is reachable ({cert.summary(full_ms)}), sacplan did not reach it"
        assert ours.recompute_ms <= 1.02 * cert.best_ms, (ours.recompute_ms, cert)
