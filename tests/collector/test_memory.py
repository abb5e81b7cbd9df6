"""Memory statistics of a hand-computable MLP, exact host sizes and the H100 allocator.

Model: ``Linear(64, 128) -> ReLU -> Linear(128, 32)`` on a (16, 64) fp32 batch, AdamW(foreach=True).

Hand derivation (bytes; "r512" = rounded up to a multiple of 512 as PyTorch's CUDA caching allocator does):

* parameters: W0 128·64·4 = 32768, b0 128·4 = 512, W2 32·128·4 = 16384, b2 32·4 = 128.
  CPU: '0' = 33280, '2' = 16512, total P = 49792. H100: b2 -> 512, so '2' = 16896, P = 50176.
* gradients: one per parameter, same sizes (G = P).
* AdamW state (torch 2.13 ``Adam._init_group``, foreach, not capturable/fused): per parameter
  ``exp_avg`` and ``exp_avg_sq`` (``zeros_like(p)``: same dtype and size as p) plus ``step``, a 0-dim
  float32 tensor (4 bytes; r512 -> 512). CPU: '0' = 2·33280 + 2·4 = 66568, '2' = 2·16512 + 8 = 33032,
  O = 99600. H100: '0' = 2·33280 + 2·512 = 67584, '2' = 2·16896 + 1024 = 34816, O = 102400.
* input x: 16·64·4 = 4096 (I); h1 = addmm output 16·128·4 = 8192; relu output 8192; y 16·32·4 = 2048.
* saved activations: ReLU saves its *output*; Linear 2 saves its input (that same relu output) and W2ᵀ;
  Linear 0 saves x (an input) only. After the forward, the Sequential keeps the relu output alive
  beyond its own output y -> root act_bytes = 8192; every leaf keeps nothing beyond inputs/outputs -> 0.
* forward transient of the root: at the relu, h1 and the relu output are both live (16384); after the
  forward the relu output and y are (10240): 6144.
* optimizer step (foreach AdamW): ``torch._foreach_sqrt(exp_avg_sqs)`` allocates one parameter-sized
  temporary per parameter while params, grads and states are all live: peak = P + G + O + I + P.
* backward: at Linear 0's backward the grads of W2, b2, W0, b0 (= G) and grad_h1 (8192) are live, plus the
  loss scalar and its seed gradient (4 bytes each, r512 -> 512 each).
* H100 only: the two cuBLAS workspaces (forward thread, autograd's device thread), 2 x 32 MiB = W, live
  through the whole step as ``other`` bytes (measured on an H200: sacplan.devices.cublas_workspaces).
"""

from __future__ import annotations

import pytest

from sacplan.devices import CPU, get_device
from sacplan.stats import CATEGORIES, SNAPSHOTS

H100 = get_device("h100")

# (param, grad, optimizer) bytes per module fqn.
CPU_STATE = {"": (49792, 49792, 99600), "0": (33280, 33280, 66568), "1": (0, 0, 0), "2": (16512, 16512, 33032)}
# H100: AdamW's 0-dim ``step`` tensors (foreach, not capturable) live on the host: no device bytes.
H100_STATE = {"": (50176, 50176, 100352), "0": (33280, 33280, 66560), "1": (0, 0, 0), "2": (16896, 16896, 33792)}

X, H1, RELU, Y = 4096, 8192, 8192, 2048
#: the runtime workspaces (W) each fixture's target holds through the step
W = {"mlp_cpu": 0, "mlp_cpu_no_opt": 0, "mlp_h100": 64 * 2**20, "mlp_h100_no_opt": 64 * 2**20}


def test_round_alloc_is_the_512_byte_rule():
    assert H100.alloc_round_bytes == 512
    assert [H100.round_alloc(n) for n in (0, 1, 4, 128, 512, 513, 32768)] == [0, 512, 512, 512, 512, 1024, 32768]
    assert CPU.round_alloc(4) == 4 and CPU.round_alloc(128) == 128


@pytest.mark.parametrize("which, expected", [("mlp_cpu", CPU_STATE), ("mlp_h100", H100_STATE)])
def test_param_grad_optimizer_bytes_per_module(request, which, expected):
    stats = request.getfixturevalue(which)
    for fqn, (p, g, o) in expected.items():
        m = stats.module(fqn)
        assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (p, g, o), fqn
        assert m.buffer_bytes == 0
    root = expected[""]
    assert (stats.param_bytes, stats.grad_bytes, stats.optimizer_bytes) == root


def test_adamw_state_is_what_torch_creates():
    """The derivation above matches what torch's foreach AdamW actually allocates (real tensors)."""
    import torch

    from sacplan.collector import default_optimizer

    lin = torch.nn.Linear(4, 3)
    opt = default_optimizer(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    for p in lin.parameters():
        st = opt.state[p]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["exp_avg"].shape == p.shape and st["exp_avg"].dtype == p.dtype
        assert st["exp_avg_sq"].shape == p.shape and st["exp_avg_sq"].dtype == p.dtype
        assert st["step"].dim() == 0 and st["step"].dtype == torch.float32
        assert st["step"].untyped_storage().nbytes() == 4


def test_h100_rounds_each_small_tensor_to_512(mlp_cpu, mlp_h100):
    # b2 (128 B) and the two 4-byte ``step`` tensors of Linear 2: CPU 128 + 2·4 + 2·128 states;
    # H100: every one of those becomes 512.
    assert mlp_h100.module("2").param_bytes - mlp_cpu.module("2").param_bytes == 512 - 128
    # optimizer: 2 states of b2 (128 -> 512 each); the 2 steps (4 B each) are host tensors for a CUDA target
    assert mlp_h100.module("2").optimizer_bytes - mlp_cpu.module("2").optimizer_bytes == 2 * (512 - 128) - 2 * 4


@pytest.mark.parametrize("which", ["mlp_cpu", "mlp_h100"])
def test_saved_activation_bytes(request, which):
    stats = request.getfixturevalue(which)
    assert stats.module("").act_bytes == (RELU,)  # the relu output, kept for ReLU and Linear 2's backward
    for leaf in ("0", "1", "2"):
        assert stats.module(leaf).act_bytes == (0,), leaf
    assert stats.module("").fw_transient_bytes == (H1 + RELU - (RELU + Y),)
    # tradeoff of the root frees exactly what the module keeps
    assert stats.module("").tradeoff.max_discard_bytes == RELU
    assert stats.module("0").tradeoff is None


@pytest.mark.parametrize("which", ["mlp_cpu", "mlp_h100"])
def test_input_output_bytes(request, which):
    stats = request.getfixturevalue(which)
    io = {fqn: (stats.module(fqn).input_bytes, stats.module(fqn).output_bytes) for fqn in ("", "0", "1", "2")}
    assert io == {"": (X, Y), "0": (X, H1), "1": (H1, RELU), "2": (RELU, Y)}
    assert stats.input_shapes == ((16, 64),)
    # the example input is not the step's allocation: only the root and the first Linear take it
    external = {fqn: stats.module(fqn).input_external_bytes for fqn in ("", "0", "1", "2")}
    assert external == {"": X, "0": X, "1": 0, "2": 0}


@pytest.mark.parametrize("which, state", [("mlp_cpu", CPU_STATE), ("mlp_h100", H100_STATE)])
def test_step_peak_is_the_optimizer_sqrt_temporaries(request, which, state):
    stats = request.getfixturevalue(which)
    P, G, O = state[""]
    assert stats.peak_bytes == P + G + O + X + P + W[which]
    assert stats.peak_phase == "other"
    snap = stats.peak_snapshot
    assert (snap.param, snap.grad, snap.optimizer, snap.input, snap.temp, snap.activation) == (P, G, O, X, P, 0)
    assert snap.other == W[which]
    assert snap.total == stats.peak_bytes
    assert max(e.peak_bytes for e in stats.events) == stats.peak_bytes


@pytest.mark.parametrize("which, state, scalar", [("mlp_cpu", CPU_STATE, 4), ("mlp_h100", H100_STATE, 512)])
def test_backward_peak_event(request, which, state, scalar):
    stats = request.getfixturevalue(which)
    P, G, O = state[""]
    # Module 0's backward: a stretch per backward end seen inside it (Linear 2's, the ReLU's); the peak is the last.
    bw = [e for e in stats.events if e.phase == "bw" and e.module == "0"]
    assert [e.bw_done for e in bw] == sorted({e.bw_done for e in bw})
    bw = [max(bw, key=lambda e: e.peak_bytes)]
    # all gradients + grad_h1 + loss and its seed gradient, on top of params, optimizer state and x
    assert bw[0].peak_bytes == P + O + X + G + H1 + 2 * scalar + W[which]
    # At that instant W0's and b0's gradients are still backward temporaries (AccumulateGrad has not adopted
    # them yet; under FSDP they are unsharded then), so only Linear 2's gradients count as state.
    assert bw[0].state_bytes == P + O + state["2"][1]
    assert bw[0].state_bytes + state["0"][1] + H1 + 2 * scalar + X + W[which] == bw[0].peak_bytes
    # the first forward event: params, state, x and h1 (made by Linear 0)
    first = stats.events[0]
    assert (first.phase, first.module, first.fw_done) == ("fw", "0", 0)
    assert first.peak_bytes == P + O + X + H1 + W[which]


@pytest.mark.parametrize("which, state, scalar", [("mlp_cpu_no_opt", CPU_STATE, 4), ("mlp_h100_no_opt", H100_STATE, 512)])
def test_peak_without_optimizer_is_in_backward(request, which, state, scalar):
    stats = request.getfixturevalue(which)
    P, G, _ = state[""]
    assert stats.optimizer_bytes == 0 and stats.module("0").optimizer_bytes == 0
    assert stats.peak_bytes == P + X + G + H1 + 2 * scalar + W[which]
    assert (stats.peak_phase, stats.peak_module) == ("bw", "0")
    assert stats.optimizer_ms == 0.0


@pytest.mark.parametrize("which, bias2", [("mlp_cpu", 128), ("mlp_h100", 512)])
def test_activation_gradient_bytes(request, which, bias2):
    stats = request.getfixturevalue(which)
    # Linear 0's backward adds gW0 (32768) and gb0 (512) above what was live at its start.
    assert stats.module("0").act_grad_bytes == (32768 + 512,)
    # Linear 2's backward adds grad of its input (8192), gW2 (16384) and gb2.
    assert stats.module("2").act_grad_bytes == (8192 + 16384 + bias2,)


def test_snapshots_are_complete_and_consistent(mlp_cpu):
    for m in mlp_cpu.modules:
        assert len(m.snapshots) == m.calls
        snaps = m.snapshots[0]
        assert set(snaps) == set(SNAPSHOTS), m.fqn
        assert snaps["peak_fw"].total >= snaps["post_fw"].total
        assert snaps["peak_bw"].total >= snaps["pre_bw"].total
    root = mlp_cpu.module("")
    pre = root.snapshots[0]["pre_fw"]
    assert (pre.param, pre.optimizer, pre.input, pre.activation, pre.grad) == (49792, 99600, X, 0, 0)
    post = root.snapshots[0]["post_fw"]
    assert post.activation == RELU + Y
    assert set(pre.to_dict()) == set(CATEGORIES)


def test_events_are_ordered_and_counted(mlp_cpu):
    ev = mlp_cpu.events
    assert [e.fw_done for e in ev] == sorted(e.fw_done for e in ev)
    assert [e.bw_started for e in ev] == sorted(e.bw_started for e in ev)
    assert max(e.fw_done for e in ev) == len(mlp_cpu.fw_post_order)
    assert max(e.bw_started for e in ev) == len(mlp_cpu.bw_pre_order)
    rc = [e for e in ev if e.phase == "rc"]
    assert sorted(e.module for e in rc) == sorted(mlp_cpu.bw_pre_order)
    # the root's recompute transient beyond its restored saved tensor (relu's output): h1 while relu runs (its
    # forward peak less the saved bytes; the output y is no part of it: the recomputation makes it afresh)
    assert {e.module: e.extra_bytes for e in rc}[""] == H1


def test_buffers_are_counted(request):
    import torch

    from sacplan.collector import collect

    stats = collect(torch.nn.BatchNorm1d(10), (torch.randn(4, 10),), device=CPU)
    # running_mean, running_var (10 fp32 each) and num_batches_tracked (int64)
    assert stats.module("").buffer_bytes == 40 + 40 + 8
    assert stats.param_bytes == 80


def test_a_call_whose_inputs_need_no_gradient_ends_its_backward_with_its_parameters():
    """``f(x) + g(z)`` with only ``x`` needing a gradient: ``g``'s backward is done once its weight and bias
    gradients are (first in the backward here), not at the end of the whole backward; a checkpointed ``g``
    stops holding its inputs there."""
    import torch
    from torch import nn

    from sacplan.collector import collect
    from sacplan.devices import CPU

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
            self.g = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return self.f(x) + self.g(z)

    st = collect(Two, (torch.randn(4, 16, requires_grad=True), torch.randn(4, 8)), device=CPU, optimizer=False)
    assert st.bw_post_order[0] == "g"  # it was last (the end of the whole backward) before
    assert st.bw_post_order.index("g") < st.bw_post_order.index("f.2")
