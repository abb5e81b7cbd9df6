"""Kernel workspaces: memory a kernel allocates for itself while it runs (not an op output).

Dispatch-level tracking sees op outputs only. Some kernels also allocate scratch buffers through the same
allocator for the duration of the call, which raise the peak (``torch.profiler``'s allocator events and
``torch.cuda.max_memory_allocated`` see them). :func:`workspace_bytes` gives them per op and target; the
recorder adds them to the current segment's peak as transient ``temp`` bytes.

* Host CPU target (``DeviceSpec.name == "CPU"``, used to validate on this host): oneDNN convolutions
  reorder inputs, weights and outputs into blocked layouts, and how much depends on the shapes. The
  workspace is *measured*: the op runs once on random tensors of the same shapes under ``torch.profiler``
  (allocator events), and the peak above its outputs is cached per op signature — the same way benchmark
  mode times ops on the device it plans for.
* CUDA targets: cuDNN picks an algorithm whose workspace fits the free memory, so it does not bind the peak;
  cuBLAS keeps one persistent workspace per stream (a constant, not per op). Both count 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from sacplan.devices import DeviceSpec

aten = torch.ops.aten

WORKSPACE_OPS = frozenset(
    {aten.convolution.default, aten._convolution.default, aten.mkldnn_convolution.default, aten.convolution_backward.default}
)
_CACHE: dict[Any, int] = {}


def workspace_bytes(spec: DeviceSpec, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Transient bytes ``func`` allocates beyond its outputs on ``spec`` (0 when not modelled)."""
    if spec.name != "CPU" or func not in WORKSPACE_OPS:
        return 0
    flat, tspec = tree_flatten((args, kwargs))
    key = (func, tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in flat))
    if key not in _CACHE:
        _CACHE[key] = _measure_cpu(func, flat, tspec)
    return _CACHE[key]


def _measure_cpu(func: Any, flat: list, tspec: Any) -> int:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.profiler import ProfilerActivity, profile

    with unset_fake_temporarily(), torch.no_grad():
        real = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").normal_()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else (torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t)
            for t in flat
        ]
        args, kwargs = tree_unflatten(real, tspec)
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = func(*args, **kwargs)
        except Exception:  # cannot run this signature here: no workspace modelled
            return 0
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_bytes = sum(t.untyped_storage().nbytes() for t in outs)
        events = sorted(
            (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
        )
        cur = peak = 0
        for e in events:
            cur += e.nbytes()
            peak = max(peak, cur)
        return max(0, peak - out_bytes)
