"""apply's wrapper: aliasing under saved-tensor hooks, deepcopy / pickle / torch.save, duplicate decisions,
Hugging Face-style ``config.use_cache`` (issues 13 and 15)."""

from __future__ import annotations

import copy
import io
import pickle
import types

import pytest
import torch
from torch import nn

from sacplan.apply import applied_plan, apply_plan, remove_plan
from sacplan.errors import UnsupportedModelError
from sacplan.plan import ModuleDecision, Plan


def _plan(*fqns: str, saved_ops=None) -> Plan:
    """A real :class:`Plan` (no fingerprint: these models are built in the test) checkpointing ``fqns``."""
    return Plan(
        decisions=tuple(ModuleDecision(fqn=f, saved_ops=saved_ops) for f in fqns), budget_bytes=1, predicted_peak_bytes=1,
        baseline_peak_bytes=1, recompute_ms=0.0, baseline_step_ms=0.0, status="optimal", objective_ms=0.0, bound_ms=0.0,
        gap=0.0, solver="test", build_s=0.0, solve_s=0.0, world_size=1, device_name="cpu", model_name="test", fingerprint="",
    )


class SelfAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, x, x, need_weights=False)[0])


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _grads(model: nn.Module, x: torch.Tensor, hooks: bool) -> list[torch.Tensor]:
    torch.manual_seed(1)
    ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else torch.enable_grad()
    with ctx:
        model(x).sum().backward()
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("saved_ops", [None, ((0, "aten.addmm.default", 0),)])
def test_mha_self_attention_keeps_aliasing_under_saved_tensor_hooks(saved_ops):
    # Before: with saved-tensor hooks, recomputation got separate q/k/v tensors, MHA took its `query is not key`
    # branch and the selective cache missed ("aten.split.Tensor encountered during backward but not found").
    torch.manual_seed(0)
    model = SelfAttn().train()
    x = torch.randn(2, 5, 16, requires_grad=True)
    ref = _grads(model, x, hooks=False)
    apply_plan(model, _plan("attn", saved_ops=saved_ops))
    got = _grads(model, x, hooks=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def _trained_copy(clone: nn.Module, x: torch.Tensor) -> None:
    opt = torch.optim.SGD(clone.parameters(), lr=0.1)
    clone(x).sum().backward()
    opt.step()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_planned_model_copies_and_trains_its_own_parameters(how):
    torch.manual_seed(0)
    model = Mlp()
    apply_plan(model, _plan(""))  # the root: its backward recomputes both matmuls
    before = [p.detach().clone() for p in model.parameters()]
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    assert applied_plan(clone) is not None and clone.forward.module is clone
    x = torch.randn(4, 8)
    _trained_copy(clone, x)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the original's weights changed"
    assert not all(torch.equal(a, b) for a, b in zip(before, clone.parameters())), "the copy did not train"
    assert all(p.grad is None for p in model.parameters())
    # and the copy is still checkpointed: its backward recomputes the forward's matmuls
    from torch.utils.flop_counter import FlopCounterMode

    def flops(m: nn.Module) -> int:
        with FlopCounterMode(display=False) as fc:
            m(x).sum().backward()
        return fc.get_total_flops()

    planned = flops(clone)
    remove_plan(clone)
    assert planned > flops(clone)


def test_module_listed_twice_is_unwrapped_by_remove_plan():
    model = Mlp()
    apply_plan(model, _plan("a", "a", "b"))
    assert "forward" in model.a.__dict__
    remove_plan(model)
    assert "forward" not in model.a.__dict__ and "forward" not in model.b.__dict__
    assert all("_sacplan" not in k for m in model.modules() for k in m.__dict__)


class HFLike(nn.Module):
    """A Hugging Face-style encoder–decoder: ``config.use_cache`` on the root and a copy on the decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=True)
        self.enc = Mlp()
        self.dec = Mlp()
        self.dec.config = copy.deepcopy(self.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def test_hf_use_cache_turned_off_in_training_with_one_warning_and_restored():
    model = HFLike().train()
    with pytest.warns(UserWarning, match="use_cache=False") as rec:
        apply_plan(model, _plan("enc", "dec"))
    assert len([w for w in rec if "use_cache" in str(w.message)]) == 1
    assert model.config.use_cache is False and model.dec.config.use_cache is False
    model(torch.randn(2, 8)).sum().backward()
    remove_plan(model)
    assert model.config.use_cache is True and model.dec.config.use_cache is True


def test_cache_handed_to_a_checkpointed_forward_is_refused():
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, past_key_values=None) -> torch.Tensor:
            return self.lin(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = Layer()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x, past_key_values=[])

    model = apply_plan(Model(), _plan("layer"))
    with pytest.raises(UnsupportedModelError, match="use_cache=False"):
        model(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        model(torch.randn(2, 4))  # inference: nothing is recomputed
