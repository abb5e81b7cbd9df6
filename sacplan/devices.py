"""Target GPU specifications for the roofline runtime model and the allocator size model.

A :class:`DeviceSpec` describes the device a plan is *for*, which is usually not the device the
collection runs on (a CPU-only laptop planning for an H100 is the normal case).

Units: bytes, bytes per second, FLOP per second.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from sacplan.errors import ConfigError, UnknownDeviceError
from sacplan.units import GiB, MiB

TFLOPS = 10**12
GBPS = 10**9
GB = 10**9
#: Default :attr:`DeviceSpec.sac_dispatch_ms` of a GPU target and of the host CPU, ms per op and pass
#: (``benchmarks/cuda_results/run8_dispatch_cost.txt``: 17-23 µs on an H200 machine). The host CPU spec, which
#: validates memory on real CPU steps and whose step times are never compared with an estimate, leaves it at 0
#: (measured there: 11-16 µs per op and pass on CPU tensors): give ``CPU.replace(sac_dispatch_ms=...)`` to plan
#: CPU training for speed.
SAC_DISPATCH_GPU_MS = 0.018
SAC_DISPATCH_CPU_MS = 0.0


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as sacplan models it.

    Attributes:
        name: canonical name, e.g. ``"H100-SXM"``.
        memory_bytes: usable device memory capacity in bytes.
        peak_flops: dense (no sparsity) peak throughput in FLOP/s per dtype key:
            ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"`` (only where the device has it).
        hbm_bandwidth: main-memory bandwidth in bytes/s.
        alloc_round_bytes: the allocator rounds every allocation up to a multiple of this many bytes
            (512 for PyTorch's CUDA caching allocator; 1 for exact host sizes).
        compute_efficiency: fraction of ``peak_flops`` that large matmuls reach in practice (0..1].
        memory_efficiency: fraction of ``hbm_bandwidth`` that streaming kernels reach in practice (0..1].
        kernel_overhead_ms: fixed launch/latency cost per kernel in milliseconds.
        attention: how attention is modelled. ``"flash"``: the device runs a fused kernel (flash,
            memory-efficient or cuDNN) that saves output + log-sum-exp + RNG state, so collection routes
            every SDPA call to a fused kernel on the host too; ``"math"``: keep the host's own SDPA kernel
            choice (right when the host *is* the target, e.g. validating on CPU, where dropout falls back to
            the math path that saves s×s probabilities).
        runtime_workspace_bytes: bytes the CUDA libraries keep allocated through PyTorch's caching allocator
            for the whole step (they count in ``torch.cuda.max_memory_allocated``): one cuBLAS workspace per
            thread that runs a matmul, the forward's thread and autograd's device thread (2 × 32 MiB on Hopper
            and later, 2 × 8 MiB + 128 KiB before: PyTorch's defaults). Collection counts them as ``other``
            bytes live through the step. Default (``None``): 0 for the host CPU (``name == "CPU"``), else the
            2 × 32 MiB of Hopper (a spec written by hand for a GPU is not planned 64 MiB short).
        sm_count, max_threads_per_sm: streaming multiprocessors and resident threads per SM, which set the
            staging buffers of PyTorch's CUDA reductions (:mod:`sacplan.collector.reductions`); ``sm_count`` 0
            leaves them unmodelled (host CPU, ROCm).
        sac_dispatch_ms: host time (ms) the selective-checkpoint mode adds per op of a checkpointed region and pass
            (the forward under its caching dispatch mode, the recomputation under its cached one) beyond plain
            ``torch.utils.checkpoint``: Python dispatch on the host, which the device waits for when the host is
            the bottleneck (:mod:`sacplan.sacmode`). Default (``None``): 0.018 for a GPU
            (``benchmarks/sac_dispatch_cost.py`` on an H200 machine with torch 2.11: 17-23 µs per op and pass
            on CUDA at every width tried), 0 for the host CPU spec (see :data:`SAC_DISPATCH_CPU_MS`). 0 leaves
            the selective mode free.
        source: where the figures come from.
    """

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    hbm_bandwidth: float
    alloc_round_bytes: int = 512
    compute_efficiency: float = 0.75
    memory_efficiency: float = 0.8
    kernel_overhead_ms: float = 0.004
    attention: str = "flash"
    runtime_workspace_bytes: int | None = None
    sm_count: int = 0
    max_threads_per_sm: int = 2048
    sac_dispatch_ms: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ConfigError(f"DeviceSpec {self.name!r}: memory_bytes must be positive")
        if self.hbm_bandwidth <= 0:
            raise ConfigError(f"DeviceSpec {self.name!r}: hbm_bandwidth must be positive")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ConfigError(f"DeviceSpec {self.name!r}: peak_flops needs positive entries, e.g. {{'bf16': 989e12}}")
        if self.alloc_round_bytes < 1:
            raise ConfigError(f"DeviceSpec {self.name!r}: alloc_round_bytes must be >= 1")
        if not (0 < self.compute_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise ConfigError(f"DeviceSpec {self.name!r}: efficiencies must lie in (0, 1]")
        if self.sm_count < 0 or self.max_threads_per_sm < 1:
            raise ConfigError(f"DeviceSpec {self.name!r}: sm_count must be >= 0 and max_threads_per_sm >= 1")
        if self.runtime_workspace_bytes is None:  # a GPU unless it is the host: Hopper's larger default
            object.__setattr__(self, "runtime_workspace_bytes", 0 if self.name == "CPU" else cublas_workspaces(True))
        if self.sac_dispatch_ms is None:
            object.__setattr__(self, "sac_dispatch_ms", SAC_DISPATCH_CPU_MS if self.name == "CPU" else SAC_DISPATCH_GPU_MS)
        if not (math.isfinite(self.sac_dispatch_ms) and self.sac_dispatch_ms >= 0):
            raise ConfigError(f"DeviceSpec {self.name!r}: sac_dispatch_ms must be a finite number >= 0 (ms per op and pass)")
        if self.runtime_workspace_bytes < 0:
            raise ConfigError(f"DeviceSpec {self.name!r}: runtime_workspace_bytes must be >= 0")
        if self.attention not in ("flash", "math"):
            raise ConfigError(f"DeviceSpec {self.name!r}: attention must be 'flash' or 'math'")
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))

    # -- sizes -------------------------------------------------------------------------------------
    def round_alloc(self, nbytes: int) -> int:
        """Bytes the target allocator reserves for a request of ``nbytes`` (0 stays 0)."""
        r = self.alloc_round_bytes
        return 0 if nbytes <= 0 else ((nbytes + r - 1) // r) * r

    # -- throughput --------------------------------------------------------------------------------
    def flops_per_s(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s used for an op computing in ``dtype`` (fp32 uses TF32 when torch allows it)."""
        if dtype in (torch.bfloat16,):
            key = "bf16"
        elif dtype in (torch.float16,):
            key = "fp16"
        elif dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            key = "fp8" if "fp8" in self.peak_flops else "fp16"
        elif dtype in (torch.float32,) and torch.get_float32_matmul_precision() != "highest":
            key = "tf32" if "tf32" in self.peak_flops else "fp32"
        else:
            key = "fp32"
        if key not in self.peak_flops:
            key = "fp32" if "fp32" in self.peak_flops else next(iter(self.peak_flops))
        return float(self.peak_flops[key])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return dataclasses.asdict(self) | {"peak_flops": dict(self.peak_flops)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeviceSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown DeviceSpec field(s) {sorted(unknown)}")
        return cls(**dict(d))

    def replace(self, **changes: Any) -> "DeviceSpec":
        """A copy with some fields changed, e.g. ``spec.replace(memory_bytes=40 * 2**30)``."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_current_cuda(cls, index: int | None = None) -> "DeviceSpec":
        """Spec of the CUDA (or ROCm) device present on this host.

        The device name reported by ``torch.cuda.get_device_properties`` is matched against
        :data:`DEVICES` (``"NVIDIA H100 80GB HBM3"`` -> ``H100-SXM``, ``"NVIDIA A100-SXM4-40GB"`` ->
        ``A100-40GB`` ...). The table's throughput figures are kept and ``memory_bytes`` is replaced by
        the real ``total_memory`` of the device. An unknown NVIDIA GPU gets a conservative guess from
        its SM count, clocks and memory bus (see :func:`_guess_spec`); when those are not reported the
        call raises and asks for an explicit :class:`DeviceSpec`.

        Args:
            index: CUDA device index; ``None`` means ``torch.cuda.current_device()``.

        Raises:
            ConfigError: no CUDA device is available, or the GPU is unknown and cannot be guessed.
        """
        return _spec_from_cuda(index)


#: A spec for exact host (CPU) sizes; used when validating with real tensors on CPU.
CPU = DeviceSpec(
    name="CPU",
    memory_bytes=64 * GiB,
    peak_flops={"fp32": 1 * TFLOPS, "bf16": 1 * TFLOPS, "fp16": 1 * TFLOPS},
    hbm_bandwidth=50 * GBPS,
    alloc_round_bytes=1,
    compute_efficiency=1.0,
    memory_efficiency=1.0,
    kernel_overhead_ms=0.0,
    attention="math",
    source="nominal host figures; sizes are exact (no rounding)",
)


def checkpoint_state_bytes(spec: DeviceSpec, draws_random: bool = True) -> int:
    """Bytes of *target-device* memory each checkpointed call keeps from its forward to its backward besides
    its saved tensors: the RNG state stashed for a region that draws random numbers (``draws_random``,
    :attr:`~sacplan.stats.ModuleStats.draws_random`), 0 for one that draws none.

    ``torch.utils.checkpoint`` with ``preserve_rng_state=True`` (its default) stashes the CPU generator's state,
    ``torch.get_rng_state()`` (5,056 bytes for the Mersenne Twister), per checkpointed call; a CUDA
    device's generator state is stashed in host memory too. So this is that size when the target is the host
    CPU (spec name ``"CPU"``) and 0 for a GPU target. Measured: every checkpointed region of a CPU step
    discarded exactly 5,056 bytes less than its saved tensors.

    The rule that makes the state optional: a region whose forward draws no random numbers recomputes the same
    values whatever the generator's state, so ``apply`` checkpoints it with ``preserve_rng_state=False`` (no
    stash at the forward, and no ``fork_rng`` copy of the state while it is recomputed) and its gradients are
    unchanged; a region that draws some keeps the default (the plan's ``ModuleDecision.preserve_rng_state``).
    """
    if spec.name != "CPU" or not draws_random:
        return 0
    return cpu_rng_state_bytes()


@functools.cache
def cpu_rng_state_bytes() -> int:
    """Bytes of ``torch.get_rng_state()`` (the CPU generator's state: fixed for a torch build, read once)."""
    state = torch.get_rng_state()
    return int(state.numel() * state.element_size())


# -- the device table ------------------------------------------------------------------------------
#
# Conventions
# * ``memory_bytes`` is what CUDA/HIP reports as the device's total memory
#   (``torch.cuda.get_device_properties(i).total_memory`` = ``cudaDeviceProp.totalGlobalMem``), not the
#   marketed "80 GB": that is the capacity the caching allocator can actually use. The figures below
#   are values reported by real devices (MiB as torch prints them, ``total_memory=81090MB``); they
#   move by a few hundred MiB with driver version and ECC, which is why
#   :meth:`DeviceSpec.from_current_cuda` replaces them with the real figure of the host's device.
# * ``peak_flops`` are *dense* tensor-core figures (datasheets often print the 2:4-sparsity figure,
#   twice as large, next to them); ``fp32`` is the non-tensor-core (CUDA core) figure.
# * ``hbm_bandwidth`` is the datasheet figure in bytes/s (decimal units, as vendors state them).
# * ``alloc_round_bytes`` is 512: PyTorch's CUDA caching allocator (and its HIP build) rounds every
#   block up to a multiple of 512 bytes.


def _gpu(
    name: str,
    memory_mib: int,
    bandwidth: float,
    *,
    bf16: float,
    tf32: float,
    fp32: float,
    fp16: float | None = None,
    fp8: float | None = None,
    large_workspace: bool = False,
    sms: int = 0,
    threads_per_sm: int = 2048,
    source: str,
) -> DeviceSpec:
    """Table helper: throughputs in TFLOPS, memory in MiB (as reported), bandwidth in bytes/s; ``large_workspace``:
    compute capability 9.0 or later, PyTorch's larger cuBLAS workspace (:func:`cublas_workspaces`)."""
    flops = {"fp32": fp32 * TFLOPS, "tf32": tf32 * TFLOPS, "bf16": bf16 * TFLOPS, "fp16": (fp16 or bf16) * TFLOPS}
    if fp8 is not None:
        flops["fp8"] = fp8 * TFLOPS
    return DeviceSpec(
        name=name,
        memory_bytes=memory_mib * MiB,
        peak_flops=flops,
        hbm_bandwidth=bandwidth,
        alloc_round_bytes=512,
        attention="flash",
        runtime_workspace_bytes=cublas_workspaces(large_workspace),
        sm_count=sms,
        max_threads_per_sm=threads_per_sm,
        source=source,
    )


def cublas_workspaces(large: bool) -> int:
    """Bytes of the cuBLAS workspaces a training step keeps allocated (PyTorch's defaults).

    PyTorch gives each (cuBLAS handle, stream) one workspace from its caching allocator, and handles are per
    thread: the forward (and the optimizer) run on the caller's thread, the backward on autograd's device
    thread, so a step holds two. Each is 32 MiB on compute capability 9.0 and later and 8 MiB + 128 KiB
    (``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``) before, unless ``CUBLAS_WORKSPACE_CONFIG`` says otherwise on
    this host. Measured on an H200 (torch 2.11): 32 MiB after the first matmul, 64.9 MiB beyond the tensors
    through a step (benchmarks/RESULTS.md, "Real CUDA").
    """
    return 2 * _workspace_config_bytes(os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""), large)


def _workspace_config_bytes(config: str, large: bool) -> int:
    """One workspace's bytes for a ``CUBLAS_WORKSPACE_CONFIG`` value (``:SIZE_KiB:COUNT`` pairs), else the default."""
    parts = [p for p in config.split(":") if p]
    if parts and len(parts) % 2 == 0 and all(p.isdigit() for p in parts):
        return sum(int(parts[i]) * 1024 * int(parts[i + 1]) for i in range(0, len(parts), 2))
    return 32 * MiB if large else 4096 * 1024 * 2 + 16 * 1024 * 8


DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 column), https://www.nvidia.com/en-us/data-center/h100/ ;
    # dense figures from the NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100, SXM5, 132 SMs).
    # torch reports total_memory=81090MB (79.19 GiB) on "NVIDIA H100 80GB HBM3".
    "H100-SXM": _gpu(
        "H100-SXM", 81_090, 3.35e12, bf16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9, large_workspace=True, sms=132,
        source="NVIDIA H100 datasheet/whitepaper, SXM5 80GB HBM3, dense",
    ),
    # Same datasheet, PCIe column (114 SMs, HBM2e). torch reports total_memory=81008MB on "NVIDIA H100 PCIe".
    "H100-PCIe": _gpu(
        "H100-PCIe", 81_008, 2.0e12, bf16=756.0, tf32=378.0, fp32=51.0, fp8=1513.0, large_workspace=True, sms=114,
        source="NVIDIA H100 datasheet/whitepaper, PCIe 80GB HBM2e, dense",
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM column), https://www.nvidia.com/en-us/data-center/h200/ :
    # same GH100 compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s. torch reports total_memory=143156MB.
    "H200": _gpu(
        "H200", 143_156, 4.8e12, bf16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9, large_workspace=True, sms=132,
        source="NVIDIA H200 datasheet, SXM 141GB HBM3e, dense",
    ),
    # NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/ (SXM4 40GB:
    # 1,555 GB/s). A100 has no FP8. "NVIDIA A100-SXM4-40GB" reported 42,298,834,944 bytes
    # (40339 MiB, rounded down here) under CUDA 12.2; older drivers report up to 40536 MiB.
    "A100-40GB": _gpu(
        "A100-40GB", 40_339, 1.555e12, bf16=312.0, tf32=156.0, fp32=19.5, sms=108,
        source="NVIDIA A100 datasheet, SXM4 40GB HBM2, dense",
    ),
    # Same datasheet, SXM4 80GB HBM2e column: 2,039 GB/s. "NVIDIA A100-SXM4-80GB" reports ~81251 MiB.
    "A100-80GB": _gpu(
        "A100-80GB", 81_251, 2.039e12, bf16=312.0, tf32=156.0, fp32=19.5, sms=108,
        source="NVIDIA A100 datasheet, SXM4 80GB HBM2e, dense",
    ),
    # NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/ (the datasheet
    # prints sparse figures 242/485/120; dense is half). 24 GB GDDR6 at 300 GB/s; ~22478 MiB usable.
    "L4": _gpu(
        "L4", 22_478, 300e9, bf16=121.0, tf32=60.0, fp32=30.3, fp8=242.5, sms=58, threads_per_sm=1536,
        source="NVIDIA L4 datasheet, dense",
    ),
    # AWS's A10G is a variant of the NVIDIA A10 with no public NVIDIA datasheet; these are the NVIDIA A10
    # datasheet figures (https://www.nvidia.com/en-us/data-center/products/a10-gpu/): FP32 31.2 TF,
    # TF32 62.5 TF, BF16/FP16 125 TF dense, 24 GB GDDR6 at 600 GB/s. "NVIDIA A10G" reports 22587 MiB.
    "A10G": _gpu(
        "A10G", 22_587, 600e9, bf16=125.0, tf32=62.5, fp32=31.2, sms=80, threads_per_sm=1536,
        source="NVIDIA A10 datasheet (A10G is AWS's variant of the A10; A10 figures used), dense",
    ),
    # NVIDIA Ada Lovelace GPU Architecture whitepaper, GeForce RTX 4090 column: 1,008 GB/s GDDR6X,
    # FP32 82.6 TF, TF32 82.6 TF, FP16/BF16 tensor 165.2 TF dense *with FP32 accumulate* (330.3 with FP16
    # accumulate, which PyTorch matmuls do not use), FP8 330.3 TF dense with FP32 accumulate.
    # torch reports total_memory=24563MB.
    "RTX-4090": _gpu(
        "RTX-4090", 24_563, 1008e9, bf16=165.2, tf32=82.6, fp32=82.6, fp8=330.3, sms=128, threads_per_sm=1536,
        source="NVIDIA Ada Lovelace whitepaper, GeForce RTX 4090, dense, FP32 accumulate",
    ),
    # AMD Instinct MI300X data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html :
    # 192 GB HBM3 at 5.3 TB/s, FP16/BF16 1307.4 TF, TF32 653.7 TF, FP32 (matrix) 163.4 TF, FP8 2614.9 TF,
    # all dense. torch (ROCm) reports total_memory=196592MB. Its hipBLASLt workspace is taken as Hopper's (not
    # measured here).
    "MI300X": _gpu(
        "MI300X", 196_592, 5.3e12, bf16=1307.4, tf32=653.7, fp32=163.4, fp8=2614.9, large_workspace=True,
        source="AMD Instinct MI300X data sheet, dense",
    ),
    # Exact host sizes (no allocator rounding); nominal throughput. Its spec name stays "CPU".
    "cpu": CPU,
}

# Normalised name (see _norm) -> key of DEVICES. The canonical keys are added below.
_ALIASES: dict[str, str] = {
    "h100": "H100-SXM",
    "h100sxm5": "H100-SXM",
    "h10080gb": "H100-SXM",
    "h10080gbhbm3": "H100-SXM",
    "h100sxm80gb": "H100-SXM",
    "h100sxm580gb": "H100-SXM",
    "h100hbm3": "H100-SXM",
    "h10080gbpcie": "H100-PCIe",
    "h100pcie80gb": "H100-PCIe",
    "h200sxm": "H200",
    "h200141gb": "H200",
    "a10080g": "A100-80GB",
    "a100sxm480gb": "A100-80GB",
    "a100sxm80gb": "A100-80GB",
    "a10040g": "A100-40GB",
    "a100sxm440gb": "A100-40GB",
    "a100sxm40gb": "A100-40GB",
    "a10": "A10G",
    "4090": "RTX-4090",
    "rtx4090": "RTX-4090",
    "geforcertx4090": "RTX-4090",
    "mi300": "MI300X",
    "instinctmi300x": "MI300X",
    "amdmi300x": "MI300X",
    "host": "cpu",
}

#: Names that fit more than one device (normalised, see _norm) -> the devices they may mean; get_device
#: lists them instead of guessing.
_AMBIGUOUS: dict[str, tuple[str, ...]] = {
    "a100": ("A100-40GB", "A100-80GB"),
    "a100sxm": ("A100-40GB", "A100-80GB"),
    "a100sxm4": ("A100-40GB", "A100-80GB"),
}

_VENDOR_WORDS = ("nvidia", "amd", "geforce", "instinct", "tesla")


def _norm(name: str) -> str:
    """Lookup form of a name: lower case, no ``-``/``_``/``.``/spaces, no leading vendor words.

    ``"NVIDIA H100 80GB HBM3"`` -> ``"h10080gbhbm3"``; ``"AMD Instinct MI300X"`` -> ``"mi300x"``.
    """
    s = name.lower()
    for ch in "-_ .":
        s = s.replace(ch, "")
    for word in _VENDOR_WORDS:
        if s.startswith(word) and len(s) > len(word):
            s = s[len(word) :]
    return s


def _lookup_table() -> dict[str, str]:
    table = {_norm(key): key for key in DEVICES}
    table.update({_norm(spec.name): key for key, spec in DEVICES.items()})
    table.update(_ALIASES)
    return table


def get_device(name_or_spec: str | DeviceSpec) -> DeviceSpec:
    """The :class:`DeviceSpec` for a device name; a :class:`DeviceSpec` is returned unchanged.

    Names are matched case-insensitively, ignoring ``-``, ``_``, ``.`` and spaces, and a leading vendor
    word (``NVIDIA``, ``AMD``, ``GeForce``, ``Instinct``), so ``"h100"``, ``"H100 SXM5"``,
    ``"NVIDIA H100 80GB HBM3"``, ``"h100pcie"``, ``"a100-80gb"``, ``"a100-40g"``,
    ``"4090"``, ``"mi300x"`` and ``"cpu"`` all work.

    Raises:
        UnknownDeviceError: the name matches no device (the message lists the known names and the
            closest matches) or more than one (``"a100"``: 40 GB or 80 GB; the message lists them).
    """
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise ConfigError(
            f"device must be a name such as 'h100' or a DeviceSpec, got {type(name_or_spec).__name__}"
        )
    table = _lookup_table()
    key = table.get(_norm(name_or_spec))
    if key is not None:
        return DEVICES[key]
    either = ambiguous_devices(name_or_spec)
    if either:
        opts = " or ".join(f"{k.lower()} ({DEVICES[k].memory_bytes / 2**30:.1f} GiB)" for k in either)
        raise UnknownDeviceError(f"device {name_or_spec!r} is ambiguous: name one of {opts}")
    suggestions = close_devices(name_or_spec)
    hint = f" Did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    raise UnknownDeviceError(
        f"unknown device {name_or_spec!r}.{hint} Known devices: {', '.join(DEVICES)}. "
        "For another accelerator pass a sacplan.devices.DeviceSpec(name=..., memory_bytes=..., "
        "peak_flops={'bf16': ...}, hbm_bandwidth=...)."
    )


def ambiguous_devices(name: str) -> tuple[str, ...]:
    """Keys of :data:`DEVICES` that ``name`` may mean when it fits more than one (``"a100"``), else ``()``."""
    return _AMBIGUOUS.get(_norm(name), ())


def close_devices(name: str) -> list[str]:
    """Keys of :data:`DEVICES` whose names are close to an unknown ``name`` (at most 3, closest first)."""
    table = _lookup_table()
    close = difflib.get_close_matches(_norm(name), list(table), n=3, cutoff=0.5)
    return list(dict.fromkeys(table[c] for c in close))


def list_devices() -> list[DeviceSpec]:
    """Every device of :data:`DEVICES`, in table order."""
    return list(DEVICES.values())


# -- the host's CUDA device --------------------------------------------------------------------------


def _match_cuda_name(name: str, total_memory: int) -> str | None:
    """Key of :data:`DEVICES` for a name as CUDA reports it, or ``None`` when it is not in the table."""
    tokens = [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t and t not in _VENDOR_WORDS]
    if not tokens:
        return None
    words = set(tokens)
    if "h200" in words:
        return None if "nvl" in words else "H200"  # "NVIDIA GH200 480GB" is the token gh200: not matched
    if "h100" in words:
        if "nvl" in words:
            return None  # H100 NVL: 94 GB, 3.9 TB/s -- not in the table
        return "H100-PCIe" if "pcie" in words else "H100-SXM"
    a100 = [t for t in tokens if t.startswith("a100")]  # "a100-sxm4-80gb" splits into a100, sxm4, 80gb
    if a100:  # "NVIDIA A100 80GB PCIe" (1.935 TB/s) maps to the SXM4 entry (2.039 TB/s)
        if "40gb" in words:
            return "A100-40GB"
        if "80gb" in words:
            return "A100-80GB"
        return "A100-80GB" if total_memory > 48 * GiB else "A100-40GB"
    if words & {"l4"} and len(words) == 1:
        return "L4"
    if words & {"a10g", "a10"} and len(words) == 1:
        return "A10G"
    if "4090" in words and words <= {"rtx", "4090"}:
        return "RTX-4090"
    if "mi300x" in words:
        return "MI300X"
    return None


# Dense FP16/BF16 tensor-core FLOP per clock per SM, by compute capability (major, minor); used only to
# guess an unknown GPU. The low figure for 8.6/8.9 is the GeForce rate with FP32 accumulation (the
# data-center parts of those generations are twice as fast), hence "conservative".
_TENSOR_FLOP_PER_CLK_SM = {
    (7, 0): 1024, (7, 5): 1024, (8, 0): 2048, (8, 6): 512, (8, 7): 512, (8, 9): 512, (9, 0): 4096,
}
# FP32 lanes per SM (2 FLOP each per clock).
_FP32_LANES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (9, 0): 128}


def _guess_spec(props: Any) -> DeviceSpec:
    """A conservative spec for a GPU missing from the table, from what ``get_device_properties`` says.

    * ``fp32`` = SMs x FP32 lanes (64 up to A100, 128 from GA10x on) x 2 x ``clock_rate``;
    * ``bf16``/``fp16`` = SMs x dense tensor FLOP/clock/SM (:data:`_TENSOR_FLOP_PER_CLK_SM`, the lower
      figure of each generation) x ``clock_rate``; ``tf32`` half of that; ``fp8`` twice, from 8.9 on;
    * ``hbm_bandwidth`` = 2 (double data rate) x ``memory_clock_rate`` x ``memory_bus_width`` / 8;
    * efficiencies are lowered to 0.6 (compute) and 0.7 (memory).

    Raises:
        ConfigError: the device does not report clocks (older torch, ROCm), or is not NVIDIA.
    """
    name = str(getattr(props, "name", "?"))
    clock_khz = int(getattr(props, "clock_rate", 0) or 0)
    mem_clock_khz = int(getattr(props, "memory_clock_rate", 0) or 0)
    bus_bits = int(getattr(props, "memory_bus_width", 0) or 0)
    sms = int(getattr(props, "multi_processor_count", 0) or 0)
    cc = (int(getattr(props, "major", 0)), int(getattr(props, "minor", 0)))
    amd = bool(getattr(props, "gcnArchName", ""))
    if amd or not (clock_khz and mem_clock_khz and bus_bits and sms) or cc < (7, 0):
        raise ConfigError(
            f"GPU {name!r} is not in sacplan's device table ({', '.join(DEVICES)}) and its throughput cannot "
            "be estimated from the properties torch reports. Define it yourself: "
            "sacplan.devices.DeviceSpec(name=..., memory_bytes=..., peak_flops={'bf16': ..., 'fp32': ...}, "
            "hbm_bandwidth=...) and pass that instead of a device name."
        )
    clock = clock_khz * 1e3
    tensor = _TENSOR_FLOP_PER_CLK_SM.get(cc) or (4096 if cc >= (9, 0) else 512)
    lanes = _FP32_LANES_PER_SM.get(cc) or (64 if cc < (8, 6) else 128)
    bf16 = sms * tensor * clock
    flops = {"fp32": sms * lanes * 2 * clock, "tf32": bf16 / 2, "bf16": bf16, "fp16": bf16}
    if cc >= (8, 9):
        flops["fp8"] = 2 * bf16
    return DeviceSpec(
        name=name,
        memory_bytes=int(props.total_memory),
        peak_flops=flops,
        hbm_bandwidth=2 * mem_clock_khz * 1e3 * bus_bits / 8,
        alloc_round_bytes=512,
        compute_efficiency=0.6,
        memory_efficiency=0.7,
        attention="flash",
        runtime_workspace_bytes=cublas_workspaces(cc >= (9, 0)),
        sm_count=sms,
        max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 0) or 2048),
        source=(
            f"guessed from torch.cuda.get_device_properties ({sms} SMs, sm_{cc[0]}{cc[1]}, {clock_khz / 1e6:.2f} GHz, "
            f"{bus_bits}-bit bus at {mem_clock_khz / 1e6:.2f} GHz); define a DeviceSpec for exact figures"
        ),
    )


def _spec_from_cuda(index: int | None) -> DeviceSpec:
    if not torch.cuda.is_available():
        raise ConfigError(
            "no CUDA device is available on this host, so the target device cannot be read from it; "
            "pass a device name such as 'h100' (see sacplan.devices.list_devices()) or a DeviceSpec"
        )
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    total = int(props.total_memory)
    key = _match_cuda_name(str(props.name), total)
    if key is None:
        return _guess_spec(props)
    spec = DEVICES[key]
    return spec.replace(
        memory_bytes=total,
        source=f"{spec.source}; memory_bytes from torch.cuda.get_device_properties({index}) ({props.name})",
    )
