"""Collection where fake tensors cannot answer: values read in the forward, value-dependent shapes, ops with no
fake kernel (``aten._ctc_loss``), and the errors for what stays unanswerable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.collector import collect
from sacplan.collector.fakekernels import UnansweredValue
from sacplan.collector.realvalues import RealValueMode
from sacplan.devices import CPU
from sacplan.errors import CollectionError

B, T, D, V, L = 4, 48, 16, 12, 10  # batch, frames, width, vocabulary (0 = blank), label slots


class CtcHead(nn.Module):
    """A CTC head reading data-dependent values as transformers' CTC heads do: ``labels.max()`` in a Python
    ``if``, target lengths from a mask, the targets by boolean-mask indexing, ``.tolist()`` of the lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.out = nn.Linear(D, V)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= V:
            raise ValueError("label out of the vocabulary")
        log_probs = F.log_softmax(self.out(torch.relu(self.enc(x))), -1).transpose(0, 1)
        mask = labels > 0
        target_lengths = mask.sum(-1)
        assert max(target_lengths.tolist()) <= L
        input_lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels[mask], input_lengths, target_lengths)


def ctc_inputs(longest: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(1, V, (B, L), generator=g)
    lengths = [longest, 3, 5, 1]
    for row, n in enumerate(lengths):
        labels[row, n:] = 0
    return torch.randn(B, T, D, generator=g), labels


def _ctc_op(stats):
    return next(o for o in stats.module("").ops if o.name.startswith("aten._ctc_loss"))


@pytest.mark.parametrize("longest", [7, 10])
def test_ctc_head_collects_with_the_alignment_its_labels_give(longest: int) -> None:
    stats = collect(CtcHead(), ctc_inputs(longest), device=CPU, loss_fn=lambda out: out, optimizer=False)
    op = _ctc_op(stats)
    # neg_log_likelihood (B,) fp32 + log_alpha (B, T, 2 * longest target + 1) fp32: by hand from the kernel
    assert op.name == "aten._ctc_loss.default"  # the int-list overload a real step runs (lengths read on the host)
    assert op.out_bytes == 4 * B + 4 * B * T * (2 * longest + 1)


def test_ctc_head_prediction_matches_its_real_cpu_step() -> None:
    from sacplan.solver import solve
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes
    from sacplan.validation import validate

    inputs = ctc_inputs()
    tree = ModuleTree(collect(CtcHead(), inputs, device=CPU, loss_fn=lambda out: out, optimizer=False))
    plan = solve(tree, Bytes(tree.stats.peak_bytes))
    rep = validate(CtcHead, lambda: inputs, plan, loss_fn=lambda out: out, optimizer=False, device="cpu", timed_steps=1)
    assert rep.baseline_peak_error == 0.0, rep.summary()
    assert rep.grads_bitwise_equal


def test_ctc_head_collects_for_a_cuda_target() -> None:
    stats = collect(CtcHead(), ctc_inputs(), device="h100", loss_fn=lambda out: out, optimizer=False)
    assert _ctc_op(stats).out_bytes == 512 + 512 * -(-(4 * B * T * 15) // 512)  # H100 blocks of 512 bytes


# ------------------------------------------------------------------------------------------ the mode itself
def _mode_with(real: torch.Tensor):
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    fake = fm.from_tensor(real)
    mode = RealValueMode()
    assert mode.bind((fake,), (real,)) == 1
    return fm, mode, fake


def test_values_follow_the_real_inputs_through_ops_and_in_place_updates() -> None:
    real = torch.tensor([[3, 0, 5], [7, 1, 0]])
    fm, mode, x = _mode_with(real)
    with fm, mode:
        assert int(x.max()) == 7 and bool(x.min() == 0)
        assert (x > 0).sum(-1).tolist() == [2, 2]
        y = torch.zeros(2, 3, dtype=torch.long)
        y.index_put_((torch.tensor([1]),), x[0])  # an in-place op on known values keeps a value
        y.add_(1)
        assert y.tolist() == [[1, 1, 1], [4, 1, 6]]
        assert x[x > 2].shape == (3,)  # value-dependent shape from the real mask
        w = torch.empty(2, 3)  # no value: an activation
        assert w[x > 0].shape == (4,) and w.masked_select(x > 0).shape == (4,)
        assert torch.nonzero(x).shape == (4, 2)
    assert mode.answered >= 8


def test_a_view_written_in_place_makes_its_base_unknown_not_stale() -> None:
    fm, mode, x = _mode_with(torch.tensor([1, 2, 3]))
    with fm, mode:
        y = x.clone()
        y[1:] = torch.empty(2, dtype=torch.long)  # written through a view with values it cannot know
        with pytest.raises(UnansweredValue):
            y.sum().item()


def test_values_computed_from_weights_or_random_draws_are_not_answered() -> None:
    fm, mode, x = _mode_with(torch.ones(4))
    with fm:
        weight = torch.empty(4)
    with fm, mode:
        with pytest.raises(UnansweredValue, match="parameter") as e:
            (x * weight).sum().item()
        assert not e.value.random
        with pytest.raises(UnansweredValue, match="random draw") as e:
            bool(torch.rand([]) < 0.1)
        assert e.value.random


# ------------------------------------------------------------------------------------------ errors
class LabelsFromWeights(CtcHead):
    """The CTC head with its targets chosen from its own outputs: their lengths depend on the weights."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = F.log_softmax(self.out(torch.relu(self.enc(x))), -1).transpose(0, 1)
        target_lengths = (log_probs.argmax(-1) > 0).sum(0)
        return F.ctc_loss(log_probs, labels.flatten(), torch.full((B,), T), target_lengths)


def test_a_shape_that_depends_on_weights_names_module_op_and_a_remedy_for_that_op() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = LabelsFromWeights()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.head(x, labels)

    model = Wrapper()
    with pytest.raises(CollectionError) as e:
        collect(model, ctc_inputs(), device=CPU, loss_fn=lambda out, inputs: out, optimizer=False)
    msg = str(e.value)
    assert "'head' (Wrapper.head: LabelsFromWeights)" in msg and "aten._ctc_loss.Tensor" in msg and "target_lengths" in msg
    assert "expert" not in msg and "Pass real example tensors" in msg


def test_inputs_from_a_factory_have_no_values_and_the_error_says_to_pass_tensors() -> None:
    with pytest.raises(CollectionError) as e:
        collect(CtcHead(), lambda: ctc_inputs(), device=CPU, loss_fn=lambda out: out, optimizer=False)
    msg = str(e.value)
    assert "aten._local_scalar_dense" in msg and "real example" in msg and "expert" not in msg


def test_a_random_branch_gets_the_layerdrop_remedy() -> None:
    class LayerDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                if not (torch.rand([]) < 0.1):
                    x = layer(x)
            return x

    with pytest.raises(CollectionError, match="layerdrop = 0.0") as e:
        collect(LayerDrop(), (torch.randn(2, D),), device=CPU)
    assert "aten._local_scalar_dense" in str(e.value)
