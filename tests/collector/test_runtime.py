"""Runtime model: FLOPs per op, the roofline formula by hand, views, dtype -> peak throughput."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.collector.runtime import RuntimeModel, compute_dtype, flop_mapping, op_flops, op_io_bytes, roofline_ms
from sacplan.devices import CPU, DeviceSpec, get_device
from sacplan.errors import ConfigError

H100 = get_device("h100")

# A made-up device with round numbers so the formula can be checked by hand.
TOY = DeviceSpec(
    name="toy",
    memory_bytes=2**30,
    peak_flops={"fp32": 1e12, "tf32": 2e12, "bf16": 4e12, "fp16": 8e12},
    hbm_bandwidth=1e11,
    compute_efficiency=0.5,
    memory_efficiency=0.25,
    kernel_overhead_ms=0.01,
)


@pytest.fixture
def highest_precision():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def test_roofline_compute_bound(highest_precision):
    # 1e9 FLOP at 1e12 * 0.5 FLOP/s = 2 ms; 1e3 bytes at 1e11 * 0.25 B/s = 4e-5 ms -> compute wins.
    assert roofline_ms(TOY, 10**9, 10**3, torch.float32) == pytest.approx(2.0 + 0.01, rel=1e-12)


def test_roofline_memory_bound(highest_precision):
    # 1e9 bytes at 2.5e10 B/s = 40 ms; 1e3 FLOP is negligible.
    assert roofline_ms(TOY, 10**3, 10**9, torch.float32) == pytest.approx(40.0 + 0.01, rel=1e-12)


def test_roofline_nothing_is_the_launch_overhead():
    assert roofline_ms(TOY, 0, 0, torch.float32) == pytest.approx(0.01)


def test_roofline_dtype_picks_its_peak(highest_precision):
    assert roofline_ms(TOY, 10**9, 0, torch.bfloat16) == pytest.approx(1e9 / (4e12 * 0.5) * 1e3 + 0.01)
    assert roofline_ms(TOY, 10**9, 0, torch.float16) == pytest.approx(1e9 / (8e12 * 0.5) * 1e3 + 0.01)
    torch.set_float32_matmul_precision("high")  # TF32 allowed -> the tf32 peak
    assert roofline_ms(TOY, 10**9, 0, torch.float32) == pytest.approx(1e9 / (2e12 * 0.5) * 1e3 + 0.01)


def test_op_flops_and_io_bytes_of_mm():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    out = torch.mm(a, b)
    assert op_flops(torch.ops.aten.mm.default, (a, b), {}, out) == 2 * 8 * 16 * 4
    assert op_io_bytes((a, b), {}, out) == (8 * 16 + 16 * 4 + 8 * 4) * 4
    assert compute_dtype((a.bfloat16(), b), {}) == torch.bfloat16
    assert compute_dtype((3, 4), {}) == torch.float32


def test_runtime_model_rejects_bad_modes():
    with pytest.raises(ConfigError):
        RuntimeModel(H100, "guess")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            RuntimeModel(H100, "benchmark")


def test_mlp_matmul_flops_are_2mnk(mlp_h100, mlp_dims):
    B, D_IN, D_HID, D_OUT = mlp_dims
    root = mlp_h100.module("")
    addmm = [o for o in root.ops if o.name == "aten.addmm.default"]
    assert [o.flops for o in addmm] == [2 * B * D_IN * D_HID, 2 * B * D_HID * D_OUT]
    assert root.fw_flops == (2 * B * D_IN * D_HID + 2 * B * D_HID * D_OUT,)
    assert mlp_h100.fw_flops == root.fw_flops[0]
    # backward: Linear 2 computes grad_input and grad_W (2 mms of the forward's size); Linear 0 only grad_W
    # (x does not require grad).
    assert mlp_h100.bw_flops == 2 * (2 * B * D_HID * D_OUT) + 2 * B * D_IN * D_HID
    assert mlp_h100.module("0").bw_flops == (2 * B * D_IN * D_HID,)
    assert mlp_h100.module("2").bw_flops == (2 * 2 * B * D_HID * D_OUT,)


def test_mlp_op_runtime_is_the_roofline_by_hand(mlp_h100, mlp_dims, highest_precision):
    B, D_IN, D_HID, D_OUT = mlp_dims
    op = next(o for o in mlp_h100.module("0").ops if o.name == "aten.addmm.default")
    # addmm(bias[128], x[16, 64], W0ᵀ[64, 128]) -> out[16, 128], all fp32
    nbytes = (D_HID + B * D_IN + D_IN * D_HID + B * D_HID) * 4
    flops = 2 * B * D_IN * D_HID
    compute_s = flops / (66.9e12 * 0.75)  # H100 fp32 (no TF32 at "highest") x compute efficiency
    memory_s = nbytes / (3.35e12 * 0.8)  # HBM3 bandwidth x memory efficiency
    assert memory_s > compute_s  # a tiny matmul is memory-bound
    assert op.runtime_ms == pytest.approx(max(compute_s, memory_s) * 1e3 + 0.004, rel=1e-9)
    assert op.runtime_ms == pytest.approx(roofline_ms(H100, flops, nbytes, torch.float32), rel=1e-12)


def test_views_cost_nothing(mlp_h100, nested_cpu):
    for stats in (mlp_h100, nested_cpu):
        for m in stats.modules:
            for o in m.ops:
                if o.is_view:
                    assert o.runtime_ms == 0.0 and o.out_bytes == 0, (m.fqn, o.name)
    t = [o for o in mlp_h100.module("0").ops if o.name == "aten.t.default"]
    assert t and t[0].is_view


def test_module_times_add_up(mlp_h100):
    root = mlp_h100.module("")
    assert root.fw_ms[0] == pytest.approx(sum(o.runtime_ms for o in root.ops), rel=1e-12)
    # Outside the model the step's forward runs the loss (mean of the (16, 32) output) and autograd's seed
    # gradient (ones_like of the scalar loss); optimizer.step()/zero_grad()'s profiler markers cost nothing.
    bw = 3.35e12 * 0.8
    loss_ms = (2048 + 4) / bw * 1e3 + 0.004
    seed_ms = (4 + 4) / bw * 1e3 + 0.004
    assert mlp_h100.fw_ms == pytest.approx(root.fw_ms[0] + loss_ms + seed_ms, rel=1e-9)
    leaves = sum(mlp_h100.module(f).fw_ms[0] for f in ("0", "1", "2"))
    assert root.fw_ms[0] == pytest.approx(leaves, rel=1e-12)  # every forward op runs inside a leaf here
    assert mlp_h100.bw_ms > 0 and mlp_h100.optimizer_ms > 0
    assert mlp_h100.step_ms == pytest.approx(mlp_h100.fw_ms + mlp_h100.bw_ms + mlp_h100.optimizer_ms)


def test_bf16_matmul_uses_the_bf16_peak():
    """A 4096³ bf16 matmul on an H100 is compute-bound: 2·4096³ / (989.4e12 · 0.75) s."""
    n = 4096
    x = torch.randn(n, n, dtype=torch.bfloat16)
    stats = collect(lambda: nn.Linear(n, n, bias=False), (x,), device="h100", dtype=torch.bfloat16)
    assert stats.dtype == "torch.bfloat16"
    lin = stats.module("")
    mm = next(o for o in lin.ops if o.name == "aten.mm.default")
    flops = 2 * n**3
    assert mm.flops == flops
    compute_ms = flops / (989.4e12 * 0.75) * 1e3
    memory_ms = 3 * n * n * 2 / (3.35e12 * 0.8) * 1e3  # x, W and out in bf16
    assert compute_ms > memory_ms
    assert mm.runtime_ms == pytest.approx(compute_ms + 0.004, rel=1e-9)
    # the same FLOPs at the fp32 peak would be ~15x slower
    assert mm.runtime_ms < flops / (66.9e12 * 0.75) * 1e3 / 10


def test_flops_match_flop_counter_mode_on_llama_tiny():
    """FlopCounterMode (with sacplan's mapping for the CPU flash kernel) is an exact oracle of fw + bw FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from sacplan.models import get_model

    preset = get_model("llama-tiny")
    stats = collect("llama-tiny", device="h100")
    torch.manual_seed(0)
    model = preset.build()
    inputs = preset.example_inputs()
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as counter:
        preset.loss_fn(model(*inputs), inputs).backward()
    assert stats.fw_flops + stats.bw_flops == counter.get_total_flops()
    attn = stats.module("layers.0.attention")
    # fp32 on a CUDA target: the memory-efficient kernel (flash takes fp16/bf16 only)
    kernel = next(o for o in attn.ops if "scaled_dot_product" in o.name)
    assert kernel.name == "aten._scaled_dot_product_efficient_attention.default"
    b, s, h, hd = preset.default_batch, preset.default_seq, 4, 16
    # q·kᵀ and p·v: 2 · (2·b·h·s·s·hd) (sdpa_flop_count does not halve for causal)
    assert kernel.flops == 4 * b * h * s * s * hd


def test_cpu_spec_runtime_is_exact_on_its_nominal_figures(mlp_cpu, mlp_dims, highest_precision):
    B, D_IN, D_HID, _ = mlp_dims
    op = next(o for o in mlp_cpu.module("0").ops if o.name == "aten.addmm.default")
    nbytes = (D_HID + B * D_IN + D_IN * D_HID + B * D_HID) * 4
    # CPU spec: 1 TFLOP/s, 50 GB/s, efficiencies 1, no launch overhead -> memory-bound
    assert op.runtime_ms == pytest.approx(max(2 * B * D_IN * D_HID / 1e12, nbytes / 50e9) * 1e3, rel=1e-12)
    assert CPU.kernel_overhead_ms == 0.0
