"""Fake kernels that lay out an op's output as the target's kernels do (sacplan.collector.fakekernels
``LAYOUT_KERNELS``): each fake result is compared with the real CPU kernel's on the same tensors, and the
collection of a model with such an op against the real step's tracked bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.collector import collect
from sacplan.collector.realvalues import RealValueMode
from sacplan.collector.workspace import kernel_scratch_bytes
from sacplan.devices import CPU, get_device

aten = torch.ops.aten
H100_EXACT = get_device("h100").replace(alloc_round_bytes=1)


def _fake_and_real(op, *reals, cuda_target: bool = False):
    """``op`` on the real tensors and on fakes of them (under the collection's RealValueMode)."""
    real_out = op(*reals)
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [fm.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in reals]
    with fm, RealValueMode(cuda_target=cuda_target):
        fake_out = op(*fakes)
    return real_out, fake_out


@pytest.mark.parametrize("x", [torch.randn(3, 32, 16).transpose(1, 2), torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)],
                         ids=["transposed", "channels-last"])
def test_batch_norm_output_is_laid_out_as_the_cpu_kernel_lays_it(x: torch.Tensor) -> None:
    c = x.shape[1]
    args = (x, torch.randn(c), torch.randn(c), torch.zeros(c), torch.ones(c), True, 0.1, 1e-5)
    real, fake = _fake_and_real(aten.native_batch_norm.default, *args)
    assert [t.stride() for t in fake] == [t.stride() for t in real]
    # CUDA's native kernel keeps the input's strides (empty_like(input); measured on an H200): the meta layout
    _, cuda = _fake_and_real(aten.native_batch_norm.default, *args, cuda_target=True)
    assert cuda[0].stride() == x.stride()


class TransposedBatchNorm(nn.Module):
    """BatchNorm1d over the transposed sequence, then a Linear: the CPU output layout decides its ops."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x.transpose(1, 2)).transpose(1, 2))


def test_collected_ops_after_a_transposed_batch_norm_are_the_real_steps() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    model, x = TransposedBatchNorm(), torch.randn(2, 8, 16)
    with Names() as real:
        model(x)
    stats = collect(TransposedBatchNorm(), (x,), device=CPU, loss_fn=lambda out: out.sum(), optimizer=False)
    fc = [o.name for o in stats.module("fc").ops]
    assert fc == real.names[real.names.index("aten.transpose.int", 1) + 1:]  # clone + mm on CPU, no addmm
    assert "aten.addmm.default" not in fc
    # a CUDA target's cuDNN batch norm runs on a contiguous copy of the transposed input, as on an H200
    gpu = [o.name for o in collect(TransposedBatchNorm(), (x,), device="h100", loss_fn=lambda out: out.sum(),
                                   optimizer=False).module("bn").ops]
    i = gpu.index("aten.cudnn_batch_norm.default")
    assert gpu[i - 1] == "aten.clone.default"


def _bn_args(grad: torch.Tensor, x: torch.Tensor) -> tuple:
    c = x.shape[1]
    w, mean, var = torch.randn(c), torch.zeros(c), torch.ones(c)
    return (grad, x, w, mean, var, mean, var, True, 1e-5, [True, True, True])


@pytest.mark.parametrize(
    "grad, x",
    [
        (torch.randn(2, 16, 8).transpose(1, 2), torch.randn(2, 8, 16)),  # BatchNorm1d over a transposed sequence
        (torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)),
        (torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last), torch.randn(2, 8, 4, 4)),
    ],
    ids=["transposed-grad", "channels-last-input", "channels-last-grad"],
)
def test_batch_norm_backward_grad_input_is_laid_out_as_the_input(grad: torch.Tensor, x: torch.Tensor) -> None:
    real, fake = _fake_and_real(aten.native_batch_norm_backward.default, *_bn_args(grad, x))
    assert fake[0].stride() == real[0].stride()
    assert [t.stride() for t in fake[1:]] == [t.stride() for t in real[1:]]


def test_cudnn_batch_norm_backward_fake_is_laid_out_as_the_input() -> None:
    """cuDNN: ``empty(input.sizes(), ..., input->suggest_memory_format())`` (no CPU kernel to compare with)."""
    x, grad = torch.randn(2, 8, 16), torch.randn(2, 16, 8).transpose(1, 2)
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    fx, fg = fm.from_tensor(x), fm.from_tensor(grad)
    w, m, v = (fm.from_tensor(t) for t in (torch.randn(8), torch.zeros(8), torch.ones(8)))
    with fm, RealValueMode():
        out = aten.cudnn_batch_norm_backward(fx, fg, w, m, v, m, v, 1e-5, torch.empty(0, dtype=torch.uint8))
    assert out[0].is_contiguous()
    # and its copy of the transposed gradient is a workspace of the gradient's size
    assert kernel_scratch_bytes(H100_EXACT, aten.cudnn_batch_norm_backward.default, (x, grad)) == grad.numel() * 4
    assert kernel_scratch_bytes(H100_EXACT, aten.cudnn_batch_norm_backward.default, (x, grad.contiguous())) == 0


_LOSSES = {
    "mse": lambda x, t, r: aten.mse_loss(x, t, r),
    "mse-broadcast": lambda x, t, r: aten.mse_loss(x[:1].expand_as(t), t, r),
    "smooth_l1": lambda x, t, r: aten.smooth_l1_loss(x, t, r, 1.0),
    "bce": lambda x, t, r: aten.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(t), None, r),
    "soft_margin": lambda x, t, r: aten.soft_margin_loss(x, t, r),
    "huber": lambda x, t, r: aten.huber_loss(x, t, r, 1.0),  # a fresh 0-d result: 4 bytes on both
}


@pytest.mark.parametrize("reduction", [1, 2, 0], ids=["mean", "sum", "none"])
@pytest.mark.parametrize("loss", list(_LOSSES))
def test_reduced_loss_holds_the_storage_the_kernel_gives_it(loss: str, reduction: int) -> None:
    x, t = torch.randn(8, 64), torch.randn(8, 64)
    real, fake = _fake_and_real(lambda a, b: _LOSSES[loss](a, b, reduction), x, t)
    assert fake.shape == real.shape
    assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()


class MseHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc(x), torch.zeros_like(x))


def test_collected_mse_loss_output_holds_input_sized_bytes() -> None:
    stats = collect(MseHead(), (torch.randn(8, 64),), device=CPU, loss_fn=lambda out: out, optimizer=False)
    op = next(o for o in stats.module("").ops if o.name == "aten.mse_loss.default")
    assert op.out_bytes == 8 * 64 * 4


@pytest.mark.parametrize(
    "op, args, temps",
    [
        (aten.mse_loss.default, (1,), 1),
        (aten.mse_loss.default, (0,), 0),  # reduction="none": the output is the elementwise loss
        (aten.huber_loss.default, (1, 1.0), 1),
        (aten.smooth_l1_loss.default, (2, 1.0), 1),
        (aten.binary_cross_entropy_with_logits.default, (None, None, 1), 2),
        (aten.binary_cross_entropy_with_logits.default, (None, "pos_weight", 1), 2),  # log_weight dies first
        (aten.binary_cross_entropy_with_logits.default, (None, None, 0), 1),
    ],
)
def test_cuda_loss_scratch_is_its_input_sized_temporaries(op, args: tuple, temps: int) -> None:
    """As measured on an H200 (peak during the op minus its output, (64, 1024) fp32 inputs)."""
    x, t = torch.empty(8, 64), torch.empty(8, 64)
    args = tuple(torch.empty(64) if a == "pos_weight" else a for a in args)
    assert kernel_scratch_bytes(H100_EXACT, op, (x, t, *args)) == temps * 8 * 64 * 4


def test_cuda_bce_and_soft_margin_scratch_is_their_0d_mean() -> None:
    x, t = torch.empty(8, 64), torch.empty(8, 64)
    assert kernel_scratch_bytes(get_device("h100"), aten.binary_cross_entropy.default, (x, t, None, 1)) == 512
    assert kernel_scratch_bytes(get_device("h100"), aten.soft_margin_loss.default, (x, t, 0)) == 0
