"""validate(train_step=...): the user's own step (here forward and loss under CPU bf16 autocast, two backwards per
step) runs in the fake step and in every real one, as collect runs it.

The model: ``block`` (``Linear(D, D)`` without bias, then ReLU) and ``head`` (``Linear(D, D)`` without bias) on a
``(B, D)`` input that needs no gradient. FLOPs per forward and backward of one batch, by hand (a ``(B, D) @ (D, D)``
product is ``2·B·D²``): forward, the two products; backward, the head's gradient of its input and of its weight,
the block's of its weight only (its input needs none): five products, ``10·B·D²``. The step runs the batch
twice (gradient accumulation), so ``20·B·D²``; the built-in step would count half. Checkpointing ``block``
recomputes its product in each of the two backwards (its ReLU saved its output, which the recomputation
re-makes, so it runs to the end): ``2 · 2·B·D²``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sacplan.alternatives import plan_from_choices
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import ConfigError
from sacplan.tree import ModuleTree
from sacplan.validation import validate

B, D = 32, 64
PRODUCT = 2 * B * D * D  # FLOPs of one (B, D) @ (D, D)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(D, D, bias=False), nn.ReLU())
        self.head = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def build() -> nn.Module:
    return Net()


def inputs() -> tuple[torch.Tensor]:
    return (torch.randn(B, D, generator=torch.Generator().manual_seed(0)),)


def autocast_step(model: nn.Module, args: tuple, opt: torch.optim.Optimizer | None) -> None:
    """Two forwards under bf16 autocast, each loss backward outside it, one optimizer step."""
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*args).float().square().mean()
        loss.backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def report():
    sgd = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    stats = collect(build, inputs(), device=CPU, optimizer=sgd, train_step=autocast_step)
    plan = plan_from_choices(ModuleTree(stats), {"block": None}, "block checkpointed")
    return validate(build, inputs, plan, optimizer=sgd, device="cpu", train_step=autocast_step, timed_steps=0)


def test_train_step_runs_in_the_flop_counted_steps(report):
    assert report.baseline.flops == 2 * 5 * PRODUCT
    assert report.measured_recompute_flops == report.predicted_recompute_flops == 2 * PRODUCT


def test_train_step_peaks_and_gradients(report):
    assert abs(report.baseline_peak_error) < 0.01, report.summary()
    assert abs(report.peak_error) < 0.01, report.summary()
    assert report.grads_bitwise_equal, report.summary()


def test_autocast_step_is_what_was_collected():
    """The weights' bf16 copies (``D·D·2`` bytes each) and the saved bf16 activations, by hand: ``block.0`` saves
    the bf16 copy of its input (``B·D·2``; its weight's copy, which autocast's cache holds, is not its activation:
    nothing saves it, the input needs no gradient); ``head`` saves its weight's copy (``D·D·2``, the block's output
    is its input)."""
    stats = collect(build, inputs(), device=CPU, optimizer=False, train_step=autocast_step)
    assert stats.module("block.0").act_bytes == (B * D * 2,) * 2
    assert stats.module("head").act_bytes == (D * D * 2,) * 2


def test_bad_train_step():
    stats = collect(build, inputs(), device=CPU, optimizer=False)
    plan = plan_from_choices(ModuleTree(stats), {"block": None}, "block checkpointed")
    with pytest.raises(ConfigError, match="train_step must be a callable"):
        validate(build, inputs, plan, optimizer=False, device="cpu", train_step="step")
    with pytest.raises(ConfigError, match="accumulated no gradient"):
        validate(build, inputs, plan, optimizer=False, device="cpu", timed_steps=0,
                 train_step=lambda m, a, o: m(*a))  # a forward and no backward
