"""Where a call's recomputation begins on the timeline (sacplan/collector/module_hooks.py).

``Linear(32, 64) -> Scaled -> Mean`` on a (256, 32) fp32 batch, ``Scaled`` being ``relu(fc(x))`` expanded 8-fold
along a new dimension and multiplied by 2, ``Mean`` its mean over that dimension: an activation is 256·64·4 =
65,536 B. ``torch.utils.checkpoint`` (non-reentrant) recomputes ``Scaled`` when its backward first reads a tensor
it saved (``relu``'s output, in ``ReluBackward``), not when the gradient reaches its output: ``MulBackward`` (by
a Python scalar: it saved nothing) runs first, its gradient (8 activations) allocated while ``Scaled``'s discarded
tensors are still absent.

``Linear(32, 64) -> Block -> Linear(64, 64)``, ``Block`` = ``Linear(64, 256) -> SiLU -> Linear(256, 64) -> ReLU``,
returns ``relu``'s output, which ``relu`` saved: alive at the block's backward start only because of that save.
The recomputation's transient counts it once, not again on top of a base that already holds it.
"""

from __future__ import annotations

import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.solver import min_feasible_budget, solve
from sacplan.stats import Phase
from sacplan.tree import ModuleTree
from sacplan.validation import validate

ACT = 256 * 64 * 4


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)).unsqueeze(1).expand(-1, 8, -1) * 2.0


class Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def _scaled() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), Scaled(), Mean())


def _block() -> nn.Module:
    block = nn.Sequential(nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 64), nn.ReLU())
    return nn.Sequential(nn.Linear(32, 64), block, nn.Linear(64, 64))


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(256, 32, generator=torch.Generator().manual_seed(0)),)


def test_backward_before_the_first_unpack_is_placed_before_the_call() -> None:
    stats = collect(_scaled, _inputs(), device=CPU, optimizer=False)
    pos = stats.bw_pre_order.index("1")
    rc = next(i for i, e in enumerate(stats.events) if e.phase == Phase.RC and e.module == "1")
    before = [e for e in stats.events[:rc] if e.phase == Phase.BW and e.module == "1"]
    # MulBackward's stretch: labelled with Scaled (its gradient arrived), Scaled not yet begun.
    assert before and all(e.bw_started <= pos for e in before)
    assert stats.events[rc].bw_started == pos + 1
    # ``relu`` and the ``Linear`` begin with Scaled or after it, in the order their gradients arrived.
    assert stats.bw_pre_order[pos:pos + 3] == ("1", "1.act", "1.fc")


def test_scaled_checkpointed_is_predicted_exactly() -> None:
    """The peak is MulBackward's 8-fold gradient (1,237,512 B unplanned): counted with Scaled's discarded
    ``relu`` output back, the plan was predicted 65,536 B over what it measures (1,171,976 B)."""
    torch.manual_seed(0)
    tree = ModuleTree(collect(_scaled, _inputs(), device=CPU, optimizer=False))
    plan = solve(tree, f"{min_feasible_budget(tree, ac_units=['1'])}B", ac_units=["1"])
    assert [d.fqn for d in plan.decisions] == ["1"]
    r = validate(_scaled, _inputs, plan, optimizer=False, device="cpu")
    assert r.grads_bitwise_equal
    assert abs(r.peak_error) < 0.005, r.summary()


def test_saved_output_is_counted_once_in_the_transient() -> None:
    stats = collect(_block, _inputs(), device=CPU, optimizer=False)
    extra = {e.module: e.extra_bytes for e in stats.events if e.phase == Phase.RC}
    # ReLU alone re-makes its output, which the base already holds (relu's save): nothing beyond it.
    assert extra["1.3"] == 0
    # The block re-makes the second Linear's output (dead after relu in the forward; the first Linear's and
    # SiLU's are saved, so back at the rc event) beside relu's: one activation.
    assert extra["1"] == ACT


