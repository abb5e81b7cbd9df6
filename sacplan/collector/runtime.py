"""Per-op runtime on a *target* device: a roofline model, or real timing when that device is present.

Roofline (default): ``ms = max(flops / (peak_flops[dtype] * compute_efficiency),
bytes / (hbm_bandwidth * memory_efficiency)) * 1e3 + kernel_overhead_ms`` where ``bytes`` is what the op
reads (its tensor arguments) plus what it writes (its outputs). View ops cost 0.

FLOPs follow :mod:`torch.utils.flop_counter` (so a ``FlopCounterMode`` run counts the same numbers),
extended by :data:`EXTRA_FLOP_FORMULAS` for ops PyTorch does not count (the CPU flash-attention kernel),
which can be handed to ``FlopCounterMode(custom_mapping=flop_mapping())``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from sacplan.devices import DeviceSpec

aten = torch.ops.aten


def _cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_bw_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _shape_of(x: Any) -> Any:
    return x.shape if isinstance(x, torch.Tensor) else x


#: FLOP formulas (taking shapes, like ``torch.utils.flop_counter``'s) for ops it does not count,
#: keyed by overload packet.
EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bw_flops,
}


def flop_mapping() -> dict[Any, Callable[..., int]]:
    """``custom_mapping`` for :class:`torch.utils.flop_counter.FlopCounterMode` that counts what sacplan counts."""
    return dict(EXTRA_FLOP_FORMULAS)


_PLAIN = (torch.Tensor, FakeTensor, torch.nn.Parameter)


def _local(t: Any) -> Any:
    """A DTensor's (a traceable wrapper subclass holding one tensor) local shard; anything else unchanged.

    The inner tensor is found among the flattened attributes, which may hold more than tensors (torch 2.13's
    DTensor flattens to its local tensor *and* its device mesh)."""
    if isinstance(t, torch.Tensor) and type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [x for x in (getattr(t, a) for a in attrs) if isinstance(x, torch.Tensor)]
        if len(inner) == 1:
            return _local(inner[0])
    return t


def local_shards(x: Any) -> Any:
    """``x`` with every DTensor replaced by its local shard (see :func:`_local`).

    A dispatch mode sees a DTensor op at the global shapes; one rank computes and moves only its shards.
    Shapes of ops whose sharding needs a redistribution first are those before it (an approximation).
    """
    return tree_map(_local, x)


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op call, as ``FlopCounterMode(custom_mapping=flop_mapping())`` counts them (on one rank's
    local shards for DTensor arguments)."""
    packet = func._overloadpacket
    try:
        fn = flop_registry.get(packet)
        if fn is not None or packet in EXTRA_FLOP_FORMULAS:
            args, kwargs, out = local_shards((args, kwargs, out))
        if fn is not None:
            return int(fn(*args, **kwargs, out_val=out))
        raw = EXTRA_FLOP_FORMULAS.get(packet)
        if raw is None:
            return 0
        shapes = tuple(_shape_of(a) for a in args)
        kw = {k: _shape_of(v) for k, v in kwargs.items()}
        return int(raw(*shapes, out_shape=None, **kw))
    except Exception:  # a formula that cannot read these args: count nothing rather than fail collection
        return 0


def _tensor_bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def op_io_bytes(args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes an op reads (tensor arguments) plus writes (tensor outputs), local shards for DTensors."""
    flat_in, _ = tree_flatten((args, kwargs))
    flat_out, _ = tree_flatten(out)
    total = 0
    for t in flat_in:
        if isinstance(t, torch.Tensor):
            total += _tensor_bytes(t)
    for t in flat_out:
        if isinstance(t, torch.Tensor):
            total += _tensor_bytes(t)
    return total


def compute_dtype(args: tuple, kwargs: dict) -> torch.dtype:
    """The dtype an op computes in: its first floating-point tensor argument's (fp32 if none)."""
    flat, _ = tree_flatten((args, kwargs))
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return torch.float32


def roofline_ms(spec: DeviceSpec, flops: int, nbytes: int, dtype: torch.dtype) -> float:
    """Roofline time in ms of an op doing ``flops`` FLOPs and moving ``nbytes`` bytes on ``spec``."""
    compute_s = flops / (spec.flops_per_s(dtype) * spec.compute_efficiency) if flops else 0.0
    memory_s = nbytes / (spec.hbm_bandwidth * spec.memory_efficiency) if nbytes else 0.0
    return max(compute_s, memory_s) * 1e3 + spec.kernel_overhead_ms


class RuntimeModel:
    """Estimates op runtimes on a target device.

    Args:
        spec: the target device.
        mode: ``"roofline"`` (works anywhere) or ``"benchmark"`` (times each distinct op on the CUDA device
            present, which must be the target; results are cached per op and argument shapes).
    """

    def __init__(self, spec: DeviceSpec, mode: str = "roofline") -> None:
        if mode not in ("roofline", "benchmark"):
            from sacplan.errors import ConfigError

            raise ConfigError(f"runtime mode must be 'roofline' or 'benchmark', got {mode!r}")
        if mode == "benchmark" and not torch.cuda.is_available():
            from sacplan.errors import ConfigError

            raise ConfigError("runtime mode 'benchmark' needs a CUDA device; use mode='roofline' on this host")
        self.spec = spec
        self.mode = mode
        self._bench_cache: dict[Any, float] = {}

    def estimate(self, func: Any, args: tuple, kwargs: dict, out: Any, flops: int, is_view: bool) -> float:
        """Milliseconds of one op call on the target."""
        if is_view:
            return 0.0
        if self.mode == "benchmark":
            return self._benchmark(func, args, kwargs)
        return roofline_ms(self.spec, flops, op_io_bytes(args, kwargs, out), compute_dtype(args, kwargs))

    # -- real timing -------------------------------------------------------------------------------
    def _benchmark(self, func: Any, args: tuple, kwargs: dict, warmup: int = 2, reps: int = 5) -> float:
        flat, spec = tree_flatten((args, kwargs))
        key = (func, tuple((tuple(t.shape), t.dtype, tuple(t.stride())) if isinstance(t, torch.Tensor) else repr(t) for t in flat))
        if key in self._bench_cache:
            return self._bench_cache[key]
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_unflatten

        with unset_fake_temporarily():
            real = []
            for t in flat:
                if isinstance(t, torch.Tensor):
                    if t.is_floating_point():
                        r = torch.randn(t.shape, dtype=t.dtype, device="cuda")
                    elif t.dtype == torch.bool:
                        r = torch.ones(t.shape, dtype=t.dtype, device="cuda")
                    else:
                        r = torch.zeros(t.shape, dtype=t.dtype, device="cuda")
                    real.append(r)
                else:
                    real.append(t)
            r_args, r_kwargs = tree_unflatten(real, spec)
            try:
                for _ in range(warmup):
                    func(*r_args, **r_kwargs)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(reps):
                    func(*r_args, **r_kwargs)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / reps
            except Exception:
                ms = math.nan
        if math.isnan(ms):  # an op that cannot run on random data: fall back to the roofline
            out = func(*args, **kwargs)
            ms = roofline_ms(self.spec, op_flops(func, args, kwargs, out), op_io_bytes(args, kwargs, out), compute_dtype(args, kwargs))
        self._bench_cache[key] = ms
        return ms
