"""A fully checkpointed region of a module without buffers runs as plain checkpointing (the selective policy
would decide nothing there): same gradients, same FLOPs, no selective dispatch mode. Regions with buffers
(BatchNorm's statistics, written in place) and selective regions keep the mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sacplan.apply as apply_mod
from sacplan.apply import apply_plan, remove_plan
from sacplan.errors import PlanMismatchError
from sacplan.plan import ModuleDecision, Plan


def _plan(*fqns: str, saved_ops=None, rng: bool = True) -> Plan:
    return Plan(
        decisions=tuple(ModuleDecision(fqn=f, saved_ops=saved_ops, preserve_rng_state=rng) for f in fqns), budget_bytes=1, predicted_peak_bytes=1,
        baseline_peak_bytes=1, recompute_ms=0.0, baseline_step_ms=0.0, status="optimal", objective_ms=0.0, bound_ms=0.0,
        gap=0.0, solver="test", build_s=0.0, solve_s=0.0, world_size=1, device_name="cpu", model_name="test", fingerprint="",
    )


class Block(nn.Module):
    def __init__(self, d: int = 16, norm: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.BatchNorm1d(d) if norm else nn.Identity()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, first: nn.Module, n: int = 3, **kw) -> None:
        super().__init__()
        self.first = first
        self.blocks = nn.Sequential(*(Block(**kw) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.first(x * 1.0))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(7)
    with FlopCounterMode(display=False) as fc:
        model(x).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops(), grads


class _Spy:
    """Counts checkpoint calls made with and without a selective ``context_fn``."""

    def __init__(self, real) -> None:
        self.real, self.selective, self.plain = real, 0, 0

    def __call__(self, fn, *args, **kwargs):
        if "context_fn" in kwargs:
            self.selective += 1
        else:
            self.plain += 1
        return self.real(fn, *args, **kwargs)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_full_units_without_buffers_run_plain(monkeypatch, dropout):
    torch.manual_seed(0)
    model, x = Net(nn.Identity(), dropout=dropout), torch.randn(8, 16)
    f0, g0 = _step(model, x)
    spy = _Spy(apply_mod.checkpoint)
    monkeypatch.setattr(apply_mod, "checkpoint", spy)
    apply_plan(model, _plan("blocks.0", "blocks.1", "blocks.2"))
    f1, g1 = _step(model, x)
    assert (spy.selective, spy.plain) == (0, 3)
    for block in model.blocks:  # a buffer, even one never written, keeps the selective mode
        block.register_buffer("unused", torch.zeros(1))
    f2, g2 = _step(model, x)
    assert (spy.selective, spy.plain) == (3, 3)
    assert f1 == f2 > f0  # the same recomputation either way
    for k in g0:
        assert torch.equal(g0[k], g1[k]) and torch.equal(g1[k], g2[k]), k
    remove_plan(model)
    assert _step(model, x)[0] == f0


def test_units_with_buffers_keep_the_selective_mode(monkeypatch):
    torch.manual_seed(0)
    model, x = Net(nn.Identity(), norm=True), torch.randn(8, 16)
    spy = _Spy(apply_mod.checkpoint)
    monkeypatch.setattr(apply_mod, "checkpoint", spy)
    apply_plan(model, _plan("blocks.0", "blocks.1"))
    for _ in range(2):
        _step(model, x)
    assert (spy.selective, spy.plain) == (4, 0)
    assert int(model.blocks[0].norm.num_batches_tracked) == 2  # updated once per step, never on recompute


def test_selective_units_never_turn_plain(monkeypatch):
    torch.manual_seed(0)
    model, x = Net(nn.Identity(), n=1), torch.randn(8, 16)
    spy = _Spy(apply_mod.checkpoint)
    monkeypatch.setattr(apply_mod, "checkpoint", spy)
    apply_plan(model, _plan("blocks.0", saved_ops=((0, "aten.addmm.default", 0),)))
    for _ in range(2):
        _step(model, x)
    assert (spy.selective, spy.plain) == (2, 0)


def test_regions_without_rng_state_run_their_first_call_under_the_policy(monkeypatch):
    """A region planned without RNG state (it drew no random numbers when collected) runs its first call under the
    policy, which refuses a random op there, and plain afterwards; one that does draw them is refused."""
    torch.manual_seed(0)
    model, x = Net(nn.Identity(), n=2), torch.randn(8, 16)
    _, g0 = _step(model, x)
    spy = _Spy(apply_mod.checkpoint)
    monkeypatch.setattr(apply_mod, "checkpoint", spy)
    apply_plan(model, _plan("blocks.0", "blocks.1", rng=False))
    _, g1 = _step(model, x)
    _, g2 = _step(model, x)
    assert (spy.selective, spy.plain) == (2, 2)
    for k in g0:
        assert torch.equal(g0[k], g1[k]) and torch.equal(g0[k], g2[k]), k
    remove_plan(model)
    noisy = Net(nn.Identity(), n=1, dropout=0.3)
    apply_plan(noisy, _plan("blocks.0", rng=False))
    with pytest.raises(PlanMismatchError):
        _step(noisy, x)


class _Branchy(nn.Module):
    """Dropout only on inputs whose mean is positive (a data-dependent branch)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return nn.functional.dropout(y, 0.5) if bool(x.mean() > 0) else y


def test_a_plain_region_without_rng_state_refuses_a_later_call_that_draws_random_numbers(monkeypatch):
    """A region planned without RNG state turns plain after its first call; a later call that draws random numbers
    would be recomputed with other numbers (a silently wrong gradient) and is refused at its forward instead:
    first call in eval mode with grad enabled (no dropout, the policy passes), then training mode with dropout; or a
    branch that draws only for some inputs."""
    torch.manual_seed(0)
    spy = _Spy(apply_mod.checkpoint)
    monkeypatch.setattr(apply_mod, "checkpoint", spy)
    model, x = Net(nn.Identity(), n=1, dropout=0.3), torch.randn(8, 16)
    apply_plan(model, _plan("blocks.0", rng=False))
    model.eval()
    _step(model, x)
    _step(model, x)  # plain now, and still draws nothing
    assert (spy.selective, spy.plain) == (1, 1)
    model.train()
    with pytest.raises(PlanMismatchError, match="'blocks.0' draws random numbers .*advanced a random number generator"):
        _step(model, x)
    branchy = nn.Sequential(_Branchy())
    apply_plan(branchy, _plan("0", rng=False))
    _step(branchy, -x.abs())  # no dropout on this input
    with pytest.raises(PlanMismatchError, match="'0' draws random numbers"):
        _step(branchy, x.abs())
