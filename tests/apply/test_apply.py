"""apply_plan / remove_plan: exact recompute, unchanged gradients, reversibility, refusal of wrong plans."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from sacplan.apply import applied_plan, apply_plan, remove_plan
from sacplan.collector.runtime import flop_mapping
from sacplan.errors import PlanMismatchError, UnsupportedModelError
from sacplan.solver import solve


def _step(model, args, loss_fn, seed=1):
    torch.manual_seed(seed)
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
        loss_fn(model(*args), args).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops(), grads


@pytest.mark.parametrize("frac", [0.9, 0.75, 0.6])
def test_recompute_flops_exact_and_grads_bitwise_with_dropout(llama_setup, frac):
    model_fn, inputs_fn, loss_fn, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * frac))
    assert plan.decisions, "the budget should need checkpointing"
    torch.manual_seed(0)
    model = model_fn()
    args = inputs_fn()
    f0, g0 = _step(model, args, loss_fn)
    apply_plan(model, plan)
    f1, g1 = _step(model, args, loss_fn)
    assert f1 - f0 == sum(d.recompute_flops for d in plan.decisions)
    assert g0.keys() == g1.keys()
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k


def test_cnn_inplace_relu_and_batchnorm(cnn_setup):
    model_fn, inputs_fn, loss_fn, tree = cnn_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.8))
    torch.manual_seed(0)
    model = model_fn()
    args = inputs_fn()
    # BatchNorm running stats are updated in forward only, not again on recompute.
    f0, g0 = _step(model, args, loss_fn)
    stats_before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_plan(model, plan)
    f1, g1 = _step(model, args, loss_fn)
    assert f1 - f0 == sum(d.recompute_flops for d in plan.decisions)
    for k in g0:
        assert torch.allclose(g0[k], g1[k], rtol=1e-5, atol=1e-6), k
    for k, v in model.state_dict().items():
        if k.endswith("num_batches_tracked"):
            assert int(v) == int(stats_before[k]) + 1


def test_apply_is_idempotent_reversible_and_keeps_state(llama_setup):
    model_fn, inputs_fn, loss_fn, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.7))
    model = model_fn()
    names = [n for n, _ in model.named_parameters()]
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {n: m.forward for n, m in model.named_modules()}
    apply_plan(model, plan)
    apply_plan(model, plan)
    assert applied_plan(model) is plan
    assert [n for n, _ in model.named_parameters()] == names
    assert model.state_dict().keys() == sd.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    wrapped = {d.fqn for d in plan.decisions}
    assert all("forward" in model.get_submodule(f).__dict__ for f in wrapped)
    remove_plan(model)
    assert applied_plan(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {n: m.forward.__func__ for n, m in model.named_modules()} == {n: f.__func__ for n, f in forwards.items()}


def test_apply_other_plan_replaces_first(llama_setup):
    model_fn, _, _, tree = llama_setup
    p1 = solve(tree, int(tree.stats.peak_bytes * 0.9))
    p2 = solve(tree, int(tree.stats.peak_bytes * 0.6))
    model = model_fn()
    apply_plan(model, p1)
    apply_plan(model, p2)
    wrapped = {n for n, m in model.named_modules() if "forward" in m.__dict__}
    assert wrapped == {d.fqn for d in p2.decisions}


def test_bf16_autocast_and_no_grad(llama_setup):
    model_fn, inputs_fn, loss_fn, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.7))
    torch.manual_seed(0)
    model = model_fn()
    args = inputs_fn()
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_fn(model(*args), args)
    ref.backward()
    g0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    apply_plan(model, plan)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss_fn(model(*args), args)
    out.backward()
    assert torch.equal(out, ref)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, g0[n]), n
    with torch.no_grad():  # inference path skips checkpointing
        model(*args)


def test_refuses_plan_for_another_model(llama_setup):
    _, _, _, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.7))
    from sacplan.models.llama import Llama
    from sacplan.models import get_model

    other = Llama(get_model("llama-tiny").config.with_(n_layers=3))
    with pytest.raises(PlanMismatchError, match="another model"):
        apply_plan(other, plan)
    assert applied_plan(other) is None


def test_refuses_missing_module_without_fingerprint(llama_setup):
    model_fn, _, _, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.7))
    bad = dataclasses.replace(plan, decisions=plan.decisions + (dataclasses.replace(plan.decisions[0], fqn="layers.99"),))
    with pytest.raises(PlanMismatchError, match="layers.99"):
        apply_plan(model_fn(), bad, check_fingerprint=False)


def test_kv_cache_on_is_refused(llama_setup):
    model_fn, _, _, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.7))
    model = model_fn()
    model.enable_kv_cache()
    with pytest.raises(UnsupportedModelError, match="cache"):
        apply_plan(model, plan)
    model.disable_kv_cache()
    apply_plan(model, plan)


def test_rng_state_kept_only_by_regions_that_draw_random_numbers(llama_setup):
    """A region without random ops is checkpointed with ``preserve_rng_state=False`` (no stashed state, no copy
    while recomputing; sacplan.devices.checkpoint_state_bytes); one with dropout keeps it. A plan made from a step
    without dropout, applied where the region draws random numbers after all, is refused at the first random op
    rather than replaying other random numbers."""
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.plan import ModuleDecision
    from sacplan.tree import ModuleTree

    from .conftest import llama_factory

    _, inputs_fn, loss_fn, tree = llama_setup  # dropout 0.1
    plan = solve(tree, int(tree.stats.peak_bytes * 0.7))
    assert any(d.preserve_rng_state for d in plan.decisions)
    assert all(d.preserve_rng_state == tree.node(d.fqn).stats.draws_random for d in plan.decisions)
    torch.manual_seed(0)
    tree0 = ModuleTree(collect(llama_factory(dropout=0.0), inputs_fn(), device=CPU, loss_fn=loss_fn))
    plan0 = solve(tree0, int(tree0.stats.peak_bytes * 0.7))
    assert plan0.decisions and not any(d.preserve_rng_state for d in plan0.decisions)
    d = plan0.decisions[0]
    assert ModuleDecision.from_dict(d.to_dict()) == d
    old = {k: v for k, v in d.to_dict().items() if k != "preserve_rng_state"}  # a plan written before the field
    assert ModuleDecision.from_dict(old).preserve_rng_state is True
    args = inputs_fn()
    model = apply_plan(llama_factory(dropout=0.1)(), plan0)
    with pytest.raises(PlanMismatchError, match="draws random numbers"):
        loss_fn(model(*args), args).backward()
