"""Inductor's own code for a compiled graph, run on fake tensors with its kernels left out.

Inductor turns each graph AOTAutograd hands it (a compiled region's forward, its backward) into a Python
*wrapper* that allocates every buffer (``empty_strided_cpu``), runs kernels into them, frees each buffer with
``del`` after its last reader (or hands it to a later kernel of the same size: ``# reuse``), runs matmuls and
fallbacks as library calls that allocate their outputs, and frees its inputs where it reads them last
(``args.clear()``). The wrapper's order is the scheduler's (fusion, reordering for peak memory), its buffers are
what the scheduler realized: it *is* what the compiled step allocates and frees, in that order.

:func:`inner_compile` is a drop-in for Inductor's ``compile_fx_inner`` (``compile_fx(..., inner_compile=...)``):
it runs Inductor's post-grad passes, lowering, scheduling and wrapper code generation on the graph, exactly as
Inductor does, but compiles no kernel: the wrapper is loaded with each generated C++ (or Triton) kernel replaced
by a no-op, and its allocations made by ``torch.empty_strided`` under the caller's mode; the random-number
higher-order operators of checkpointed regions (``run_and_save_rng_state``, ``run_with_rng_state``) run as
plain ops beside a generator-state-sized tensor. Run on fake tensors inside :func:`sacplan.collect`
(:mod:`sacplan.compiled_partition`), it allocates and frees what the compiled graph does and computes nothing
(its outputs' values are garbage: for memory only). Seconds per graph: no C++ compiler runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from sacplan.devices import cpu_rng_state_bytes
from sacplan.errors import UnsupportedModelError

__all__ = ["inner_compile", "load_without_kernels", "no_compiled_caches", "wrapper_source"]

#: the line of Inductor's wrapper that makes the kernel compiler (replaced: no kernel is compiled)
_ASYNC_COMPILE = "async_compile = AsyncCompile()"
#: devices whose ``empty_strided_<device>`` allocator the wrapper may call
_DEVICES = ("cpu", "cuda", "xpu", "mtia")


class _NoKernels:
    """Stands in for Inductor's ``AsyncCompile`` in a loaded wrapper: every kernel it defines is a no-op."""

    def wait(self, scope: Any = None) -> None:
        """Nothing to wait for."""

    def __getattr__(self, name: str) -> Callable[..., "_NoKernel"]:
        def define(*args: Any, **kwargs: Any) -> _NoKernel:
            return _NoKernel()

        return define


class _NoKernel:
    """A kernel that writes nothing (its buffers are allocated by the wrapper): called as a C++ kernel is,
    ``kernel(*buffers)``, or launched as a Triton kernel is, ``kernel.run(*buffers, stream=...)``."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def run(self, *args: Any, **kwargs: Any) -> None:
        return None


def _empty_strided(device: str) -> Callable[..., torch.Tensor]:
    """The wrapper's ``empty_strided_<device>`` through the dispatcher (the C++ original bypasses fake modes)."""
    def empty(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return empty


def _reinterpret_tensor(t: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int) -> torch.Tensor:
    """The wrapper's ``reinterpret_tensor`` (a view of ``t``'s storage, ``offset`` elements past ``t``'s) as a
    dispatched ``as_strided``."""
    return t.as_strided(size, stride, t.storage_offset() + offset)


def _run_and_save_rng_state(op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The wrapper's ``torch.ops.higher_order.run_and_save_rng_state`` (a random op in a checkpointed region,
    its generator state kept for the recomputation) as plain ops: the state, a host ``uint8`` tensor the size of
    the device generator's (CPU: ``torch.get_rng_state()``; CUDA: 16 bytes), and the op's output."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    size = cpu_rng_state_bytes() if device.type == "cpu" else _CUDA_RNG_STATE_BYTES
    return torch.empty(size, dtype=torch.uint8, device="cpu"), op(*args, **kwargs)


def _run_with_rng_state(state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The wrapper's ``torch.ops.higher_order.run_with_rng_state`` (the recomputation of a random op) as the op."""
    return op(*args, **kwargs)


#: bytes of a CUDA generator's state (``torch.cuda.get_rng_state()``: seed and offset), kept on the host
_CUDA_RNG_STATE_BYTES = 16
#: higher-order operators the wrapper calls, run as plain ops (a dispatch mode such as the fake step's
#: recorder has no rule for them)
_HIGHER_ORDER_CALLS = {
    "torch.ops.higher_order.run_and_save_rng_state(": "_sacplan_run_and_save_rng_state(",
    "torch.ops.higher_order.run_with_rng_state(": "_sacplan_run_with_rng_state(",
}


def load_without_kernels(source: str) -> Callable[[list], Any]:
    """The ``call(args)`` of Inductor wrapper ``source`` (boxed: ``args`` is a list, emptied), its kernels no-ops.

    Raises:
        UnsupportedModelError: ``source`` is not a Python wrapper of the form this module knows.
    """
    if _ASYNC_COMPILE not in source:
        raise UnsupportedModelError("Inductor's wrapper code has an unknown form (no AsyncCompile line): "
                                    f"torch {torch.__version__} is not supported for the compiled prediction")
    namespace: dict[str, Any] = {"__name__": "sacplan_inductor_wrapper", "_sacplan_no_kernels": _NoKernels(),
                                 "_sacplan_run_and_save_rng_state": _run_and_save_rng_state,
                                 "_sacplan_run_with_rng_state": _run_with_rng_state}
    source = source.replace(_ASYNC_COMPILE, "async_compile = _sacplan_no_kernels")
    for call, plain in _HIGHER_ORDER_CALLS.items():
        source = source.replace(call, plain)
    exec(compile(source, "<inductor wrapper>", "exec"), namespace)
    for device in _DEVICES:
        namespace[f"empty_strided_{device}"] = _empty_strided(device)
    namespace["reinterpret_tensor"] = _reinterpret_tensor
    call = namespace.get("call")
    if not callable(call):
        raise UnsupportedModelError("Inductor's wrapper code defines no call(args)")
    return call


def wrapper_source(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, is_inference: bool = False,
                   is_backward: bool = False, graph_id: int | None = None,
                   get_decomp_fn: Callable[..., Any] | None = None) -> tuple[str, list[tuple[int, ...] | None]]:
    """Inductor's Python wrapper for graph ``gm`` (AOTAutograd's forward or backward) on ``example_inputs``, and the
    strides Inductor gives the graph's outputs (``None``: not a tensor, or not static): the steps of Inductor's
    ``fx_codegen_and_compile`` up to the generated code (``gm`` is changed in place)."""
    from torch._inductor import compile_fx as cfx
    from torch._inductor.debug import DebugContext
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import shape_env_from_inputs
    from torch._inductor.virtualized import V
    from torch.utils._python_dispatch import _disable_current_modes

    with DebugContext(), _disable_current_modes():
        view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = cfx.fake_tensor_prop(gm, example_inputs)
        cfx._recursive_record_original_output_strides(gm)
        with V.set_fake_mode(fake_mode):
            cfx._recursive_post_grad_passes(gm, is_inference=is_inference)
            extra = {} if get_decomp_fn is None else {"get_decomp_fn": get_decomp_fn}
            graph = GraphLowering(gm, example_inputs=example_inputs, shape_env=shape_env_from_inputs(example_inputs),
                                  graph_id=graph_id, is_inference=is_inference, is_backward=is_backward, **extra)
            graph.freeze_runtime_asserts()
            with V.set_graph_handler(graph), V.set_extern_kernel_nodes([]):
                graph.run(*example_inputs)
                strides = [_static_stride(out) for out in graph.graph_outputs or ()]
                return graph.codegen()[0].value, strides


def _static_stride(out: Any) -> tuple[int, ...] | None:
    """The stride of a lowered graph output (an Inductor IR node) when it has one and it is static."""
    from torch._inductor.ir import IRNode

    if not (isinstance(out, IRNode) and out.has_tensor_output()):
        return None
    try:
        return tuple(int(s) for s in out.get_layout().stride)
    except TypeError:  # a symbolic stride
        return None


def inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[[list], Any]:
    """Inductor's ``compile_fx_inner`` without kernels: :func:`wrapper_source`, then :func:`load_without_kernels`
    (a boxed callable for fake tensors). As Inductor does, the strides of the graph's outputs go to the tracing
    context: AOTAutograd gives the backward graph's saved inputs the layout the forward made (channels-last
    convolution outputs). Other keyword arguments of Inductor's (cudagraphs, static inputs) are not used: no code
    runs on a device."""
    source, strides = wrapper_source(gm, example_inputs, is_inference=bool(kwargs.get("is_inference", False)),
                            is_backward=bool(kwargs.get("is_backward", False)), graph_id=kwargs.get("graph_id"),
                            get_decomp_fn=kwargs.get("get_decomp_fn"))
    call = load_without_kernels(source)
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.output_strides is not None:
        context.output_strides.extend(strides)

    def boxed(args: list) -> Any:
        return call(args)

    boxed._boxed_call = True  # type: ignore[attr-defined]
    return boxed


@contextlib.contextmanager
def no_compiled_caches() -> Any:
    """Inductor's and AOTAutograd's caches off: a cache hit would hand back the *compiled* graph of an earlier
    real step (real kernels, which cannot run on fake tensors), and a kernel-less graph must not be stored."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False), \
            functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        yield
