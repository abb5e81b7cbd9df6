"""Device table, forgiving lookup, allocator rounding, dtype -> peak throughput, host CUDA detection."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sacplan import devices
from sacplan.devices import CPU, DEVICES, DeviceSpec, get_device, list_devices
from sacplan.errors import ConfigError, SacplanError, UnknownDeviceError


@pytest.fixture
def matmul_precision():
    """Restore torch's float32 matmul precision after a test changes it."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


# -- lookup --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, canonical",
    [
        ("h100", "H100-SXM"),
        ("H100", "H100-SXM"),
        ("h100-sxm", "H100-SXM"),
        ("H100 SXM5", "H100-SXM"),
        ("h100_sxm", "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("h100pcie", "H100-PCIe"),
        ("H100-PCIe", "H100-PCIe"),
        ("h200", "H200"),
        ("a100-80g", "A100-80GB"),
        ("A100-80GB", "A100-80GB"),
        ("a100-40g", "A100-40GB"),
        ("a100 40gb", "A100-40GB"),
        ("l4", "L4"),
        ("A10G", "A10G"),
        ("4090", "RTX-4090"),
        ("rtx4090", "RTX-4090"),
        ("RTX-4090", "RTX-4090"),
        ("mi300x", "MI300X"),
        ("AMD Instinct MI300X", "MI300X"),
        ("cpu", "CPU"),
        ("CPU", "CPU"),
    ],
)
def test_lookup_aliases_resolve(name, canonical):
    assert get_device(name).name == canonical


def test_every_table_entry_is_found_by_its_key_and_its_name():
    for key, spec in DEVICES.items():
        assert get_device(key) is spec
        assert get_device(spec.name) is spec


def test_cpu_entry_is_the_module_cpu_spec():
    assert DEVICES["cpu"] is CPU
    assert get_device("cpu") is CPU


def test_spec_passes_through_unchanged():
    spec = DEVICES["H100-SXM"].replace(memory_bytes=40 * 2**30)
    assert get_device(spec) is spec


def test_unknown_name_lists_known_names_and_suggests_close_ones():
    with pytest.raises(UnknownDeviceError) as info:
        get_device("h1000")
    msg = str(info.value)
    assert "'h1000'" in msg
    assert "Did you mean" in msg and "'H100-SXM'" in msg
    for key in DEVICES:
        assert key in msg
    # typed: catchable as ConfigError, KeyError and the package base class
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, SacplanError)


def test_unknown_name_without_close_match_still_lists_names():
    with pytest.raises(UnknownDeviceError) as info:
        get_device("tpu-v5p-superpod")
    msg = str(info.value)
    assert "Did you mean" not in msg
    assert "H100-SXM" in msg and "MI300X" in msg


def test_non_string_is_a_config_error():
    with pytest.raises(ConfigError):
        get_device(80)  # type: ignore[arg-type]


def test_list_devices_is_the_table_in_order():
    specs = list_devices()
    assert specs == list(DEVICES.values())
    assert [s.name for s in specs][:3] == ["H100-SXM", "H100-PCIe", "H200"]


# -- table figures -------------------------------------------------------------------------------------


def test_h100_sxm_datasheet_figures():
    h100 = DEVICES["H100-SXM"]
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert h100.peak_flops["fp16"] == pytest.approx(989.4e12)
    assert h100.peak_flops["tf32"] == pytest.approx(494.7e12)
    assert h100.peak_flops["fp32"] == pytest.approx(66.9e12)
    assert h100.peak_flops["fp8"] == pytest.approx(1978.9e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12)
    # torch's total_memory for "NVIDIA H100 80GB HBM3": 81090 MiB = 79.19 GiB, not the marketed 80 GB
    assert h100.memory_bytes == 81_090 * 2**20
    assert 79 * 2**30 < h100.memory_bytes < 80 * 2**30


def test_h200_has_h100_compute_and_more_memory():
    h100, h200 = DEVICES["H100-SXM"], DEVICES["H200"]
    assert h200.peak_flops == h100.peak_flops
    assert h200.hbm_bandwidth == pytest.approx(4.8e12)
    assert 139 * 2**30 < h200.memory_bytes < 141 * 2**30


def test_a100_has_no_fp8_and_both_memory_sizes():
    a40, a80 = DEVICES["A100-40GB"], DEVICES["A100-80GB"]
    for spec in (a40, a80):
        assert "fp8" not in spec.peak_flops
        assert spec.peak_flops["bf16"] == pytest.approx(312e12)
        assert spec.peak_flops["tf32"] == pytest.approx(156e12)
        assert spec.peak_flops["fp32"] == pytest.approx(19.5e12)
    assert a40.hbm_bandwidth == pytest.approx(1.555e12)
    assert a80.hbm_bandwidth == pytest.approx(2.039e12)
    assert a40.memory_bytes < 40 * 2**30 < a80.memory_bytes


def test_other_table_figures():
    assert DEVICES["L4"].peak_flops["fp8"] == pytest.approx(242.5e12)
    assert DEVICES["L4"].hbm_bandwidth == pytest.approx(300e9)
    assert DEVICES["A10G"].peak_flops["bf16"] == pytest.approx(125e12)
    assert DEVICES["A10G"].peak_flops["tf32"] == pytest.approx(62.5e12)
    assert DEVICES["RTX-4090"].peak_flops["bf16"] == pytest.approx(165.2e12)
    assert DEVICES["RTX-4090"].hbm_bandwidth == pytest.approx(1008e9)
    mi = DEVICES["MI300X"]
    assert mi.peak_flops["bf16"] == pytest.approx(1307.4e12)
    assert mi.peak_flops["fp8"] == pytest.approx(2614.9e12)
    assert mi.hbm_bandwidth == pytest.approx(5.3e12)
    assert mi.memory_bytes == 196_592 * 2**20  # 192 GiB minus 16 MiB, as ROCm torch reports it


def test_every_gpu_entry_is_sane():
    for key, spec in DEVICES.items():
        assert spec.source, key
        assert spec.peak_flops["bf16"] >= spec.peak_flops["fp32"], key
        if key != "cpu":
            assert spec.alloc_round_bytes == 512, key
            assert spec.peak_flops["tf32"] < spec.peak_flops["bf16"], key
            assert 20 * 2**30 < spec.memory_bytes < 200 * 2**30, key


def test_table_specs_round_trip_through_json():
    for spec in list_devices():
        again = DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        assert again == spec


# -- sizes -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes, rounded", [(0, 0), (-5, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (1536, 1536)]
)
def test_round_alloc_on_h100_rounds_to_512(nbytes, rounded):
    assert get_device("h100").round_alloc(nbytes) == rounded


@pytest.mark.parametrize("nbytes", [0, 1, 513, 1000, 12345])
def test_round_alloc_on_cpu_is_exact(nbytes):
    assert get_device("cpu").round_alloc(nbytes) == nbytes


# -- throughput ------------------------------------------------------------------------------------------


def test_flops_per_s_picks_half_precision_keys():
    h100 = get_device("h100")
    assert h100.flops_per_s(torch.bfloat16) == pytest.approx(989.4e12)
    assert h100.flops_per_s(torch.float16) == pytest.approx(989.4e12)
    assert h100.flops_per_s(torch.float8_e4m3fn) == pytest.approx(1978.9e12)
    # no fp8 on A100: falls back to the fp16 rate
    assert get_device("a100-80gb").flops_per_s(torch.float8_e4m3fn) == pytest.approx(312e12)


def test_flops_per_s_uses_tf32_only_when_torch_allows_it(matmul_precision):
    h100 = get_device("h100")
    torch.set_float32_matmul_precision("highest")
    assert h100.flops_per_s(torch.float32) == pytest.approx(66.9e12)
    torch.set_float32_matmul_precision("high")
    assert h100.flops_per_s(torch.float32) == pytest.approx(494.7e12)
    # a spec without a tf32 entry (the CPU) falls back to fp32
    assert CPU.flops_per_s(torch.float32) == pytest.approx(1e12)


def test_flops_per_s_of_other_dtypes_is_fp32():
    assert get_device("h100").flops_per_s(torch.float64) == pytest.approx(66.9e12)


# -- host CUDA device ------------------------------------------------------------------------------------


def _fake_cuda(monkeypatch, *props):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: props[0 if i is None else i])


def test_from_current_cuda_without_cuda_raises_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device.*'h100'"):
        DeviceSpec.from_current_cuda()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_from_current_cuda_on_this_cpu_host_raises():
    with pytest.raises(ConfigError):
        DeviceSpec.from_current_cuda()


def test_from_current_cuda_known_gpu_keeps_table_figures_with_real_memory(monkeypatch):
    real = 85_031_714_816
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=real)
    _fake_cuda(monkeypatch, props)
    spec = DeviceSpec.from_current_cuda()
    table = DEVICES["H100-SXM"]
    assert spec.name == "H100-SXM"
    assert spec.memory_bytes == real
    assert spec.peak_flops == table.peak_flops
    assert spec.hbm_bandwidth == table.hbm_bandwidth
    assert spec.alloc_round_bytes == 512
    assert "get_device_properties(0)" in spec.source
    assert DEVICES["H100-SXM"].memory_bytes == 81_090 * 2**20  # table untouched


@pytest.mark.parametrize(
    "cuda_name, total, key",
    [
        ("NVIDIA H100 PCIe", 81_008 * 2**20, "H100-PCIe"),
        ("NVIDIA H200", 143_156 * 2**20, "H200"),
        ("NVIDIA A100-SXM4-80GB", 81_251 * 2**20, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 42_298_834_944, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", 40_000 * 2**20, "A100-40GB"),
        ("NVIDIA L4", 22_478 * 2**20, "L4"),
        ("NVIDIA A10G", 22_587 * 2**20, "A10G"),
        ("NVIDIA GeForce RTX 4090", 24_563 * 2**20, "RTX-4090"),
        ("AMD Instinct MI300X", 196_592 * 2**20, "MI300X"),
    ],
)
def test_from_current_cuda_matches_reported_names(monkeypatch, cuda_name, total, key):
    _fake_cuda(monkeypatch, SimpleNamespace(name=cuda_name, major=9, minor=0, total_memory=total))
    spec = DeviceSpec.from_current_cuda()
    assert spec.name == DEVICES[key].name
    assert spec.memory_bytes == total


def test_from_current_cuda_uses_the_given_index(monkeypatch):
    _fake_cuda(
        monkeypatch,
        SimpleNamespace(name="NVIDIA L4", total_memory=22_478 * 2**20),
        SimpleNamespace(name="NVIDIA H200", total_memory=143_156 * 2**20),
    )
    assert DeviceSpec.from_current_cuda().name == "L4"
    assert DeviceSpec.from_current_cuda(1).name == "H200"


def test_from_current_cuda_guesses_an_unknown_nvidia_gpu(monkeypatch):
    # An RTX 3090-like card: 82 SMs, 1.695 GHz boost, 19.5 GHz GDDR6X on a 384-bit bus.
    props = SimpleNamespace(
        name="NVIDIA GeForce RTX 3090", major=8, minor=6, total_memory=24_259 * 2**20, multi_processor_count=82,
        clock_rate=1_695_000, memory_clock_rate=9_751_000, memory_bus_width=384, gcnArchName="",
    )
    _fake_cuda(monkeypatch, props)
    spec = DeviceSpec.from_current_cuda()
    assert spec.name == "NVIDIA GeForce RTX 3090"
    assert spec.memory_bytes == 24_259 * 2**20
    # fp32: 82 SMs x 128 lanes x 2 FLOP x 1.695 GHz = 35.58 TFLOPS (datasheet 35.6)
    assert spec.peak_flops["fp32"] == pytest.approx(82 * 128 * 2 * 1.695e9)
    # bf16: 82 x 512 x 1.695 GHz = 71.2 TFLOPS (GeForce rate with FP32 accumulate)
    assert spec.peak_flops["bf16"] == pytest.approx(82 * 512 * 1.695e9)
    assert "fp8" not in spec.peak_flops
    # bandwidth: 2 x 9.751 GHz x 384 / 8 = 936 GB/s (datasheet 936)
    assert spec.hbm_bandwidth == pytest.approx(2 * 9.751e9 * 48)
    assert spec.compute_efficiency < DEVICES["H100-SXM"].compute_efficiency
    assert "guessed" in spec.source


def test_from_current_cuda_gh200_is_not_mistaken_for_h200(monkeypatch):
    props = SimpleNamespace(
        name="NVIDIA GH200 480GB", major=9, minor=0, total_memory=97_871 * 2**20, multi_processor_count=132,
        clock_rate=1_980_000, memory_clock_rate=2_619_000, memory_bus_width=6144,
    )
    _fake_cuda(monkeypatch, props)
    spec = DeviceSpec.from_current_cuda()
    assert spec.name == "NVIDIA GH200 480GB"
    assert spec.peak_flops["bf16"] == pytest.approx(132 * 4096 * 1.98e9)


def test_from_current_cuda_unknown_gpu_without_clocks_asks_for_a_spec(monkeypatch):
    _fake_cuda(monkeypatch, SimpleNamespace(name="Mystery Accelerator 9000", major=9, minor=0, total_memory=2**36))
    with pytest.raises(ConfigError, match="DeviceSpec"):
        DeviceSpec.from_current_cuda()


def test_guess_needs_nvidia(monkeypatch):
    props = SimpleNamespace(
        name="AMD Radeon Pro W7900", major=11, minor=0, total_memory=2**35, multi_processor_count=48,
        clock_rate=2_000_000, memory_clock_rate=1_000_000, memory_bus_width=384, gcnArchName="gfx1100",
    )
    with pytest.raises(ConfigError, match="not in sacplan's device table"):
        devices._guess_spec(props)


# -- DeviceSpec basics still hold -----------------------------------------------------------------------


def test_replace_and_validation():
    h100 = get_device("h100")
    smaller = h100.replace(memory_bytes=40 * 2**30)
    assert smaller.memory_bytes == 40 * 2**30 and smaller.peak_flops == h100.peak_flops
    with pytest.raises(ConfigError):
        h100.replace(memory_bytes=0)
    with pytest.raises(ConfigError, match="unknown DeviceSpec field"):
        DeviceSpec.from_dict(h100.to_dict() | {"bogus": 1})


@pytest.mark.parametrize("name", ["a100", "A100", "nvidia a100-sxm4"])
def test_ambiguous_names_list_the_devices_instead_of_guessing(name):
    with pytest.raises(UnknownDeviceError, match=r"ambiguous: name one of a100-40gb \(39\.\d GiB\) or a100-80gb \(79\.\d GiB\)"):
        get_device(name)


# ------------------------------------------------------------------ CUDA runtime workspaces
def test_cublas_workspaces_by_architecture(monkeypatch):
    from sacplan.devices import DEVICES, cublas_workspaces

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    # two threads run matmuls in a step (the forward's and autograd's), each with PyTorch's default workspace:
    # 32 MiB from compute capability 9.0 (measured on an H200: 32 MiB after the first matmul, 64.9 MiB in a step)
    assert cublas_workspaces(True) == 2 * 32 * 2**20
    assert cublas_workspaces(False) == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)  # ":4096:2:16:8"
    assert DEVICES["H100-SXM"].runtime_workspace_bytes == 2 * 32 * 2**20
    assert DEVICES["A100-80GB"].runtime_workspace_bytes == 2 * (8 * 2**20 + 128 * 1024)
    assert DEVICES["cpu"].runtime_workspace_bytes == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the deterministic-algorithms setting
    assert cublas_workspaces(False) == 2 * 4096 * 1024 * 8


def test_collect_counts_the_workspaces_through_the_step():
    from sacplan.collector import collect
    from sacplan.devices import get_device
    from sacplan.models import get_model

    p = get_model("llama-tiny")
    h100 = get_device("h100")
    with_ws = collect(p.build, p.example_inputs(2, 16), device=h100, loss_fn=p.loss_fn)
    without = collect(p.build, p.example_inputs(2, 16), device=h100.replace(runtime_workspace_bytes=0), loss_fn=p.loss_fn)
    assert with_ws.peak_bytes - without.peak_bytes == 64 * 2**20
    assert with_ws.peak_snapshot.other - without.peak_snapshot.other == 64 * 2**20


def test_bad_runtime_figures_are_refused():
    from sacplan.devices import get_device
    from sacplan.errors import ConfigError

    with pytest.raises(ConfigError, match="runtime_workspace_bytes"):
        get_device("h100").replace(runtime_workspace_bytes=-1)
    with pytest.raises(ConfigError, match="sm_count"):
        get_device("h100").replace(sm_count=-1)


def test_a_hand_written_gpu_spec_holds_the_workspaces_by_default():
    from sacplan.devices import DeviceSpec

    gpu = DeviceSpec(name="MyGPU", memory_bytes=2**30, peak_flops={"bf16": 1e15}, hbm_bandwidth=1e12)
    assert gpu.runtime_workspace_bytes == 64 * 2**20  # not planned 64 MiB short on a Hopper-class card
    assert DeviceSpec.from_dict(gpu.to_dict()) == gpu
    host = DeviceSpec(name="CPU", memory_bytes=2**30, peak_flops={"fp32": 1e12}, hbm_bandwidth=1e10)
    assert host.runtime_workspace_bytes == 0
    assert gpu.replace(runtime_workspace_bytes=0).runtime_workspace_bytes == 0
