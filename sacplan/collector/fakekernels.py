"""Fake kernels for ops fake mode cannot run: their output shapes follow from the inputs (sometimes from input
*values*, read through :class:`~sacplan.collector.realvalues.RealValueMode`).

Each kernel lives only inside the collection's :class:`~sacplan.collector.realvalues.RealValueMode` (a
dispatch mode): nothing is registered with ``torch.library``, so no global registration outlives
``collect`` (``tests/collector/test_global_state.py``). A kernel returns fake outputs of the shapes, strides
and dtypes the real CPU / CUDA kernel returns, or ``NotImplemented`` to let fake mode run the op as usual.

================================  ================================================================================
op                                fake output
================================  ================================================================================
``aten._ctc_loss`` (int lists)    the op's own meta kernel (fake mode refuses it: it is tagged
                                  ``dynamic_output_shape`` although lists fix the shape): neg_log_likelihood (B,)
                                  and log_alpha (B, T, 2 * max(target_lengths) + 1) in the log-probs dtype
``aten._ctc_loss.Tensor``         the same, the lengths read from their real values (they come from labels and
                                  masks, i.e. the inputs); transformers' CTC heads call this overload
``aten._ctc_loss_backward``       (no meta kernel) a contiguous tensor of the log-probs' shape and dtype, as the
(both overloads)                  CPU and CUDA kernels' ``full_like(log_probs, -inf, contiguous)``
``aten.index.Tensor`` with a      a boolean index with a real value becomes its ``nonzero()`` long indices, as the
boolean / uint8 index             real kernel does; the indexed tensor itself may be an activation (no value)
``aten.masked_select``            a 1-D tensor of ``mask``'s (broadcast) count of True elements
``aten.native_batch_norm``        host CPU target: the output in the input's suggested memory format (contiguous
(training or not)                 unless channels-last; ``batch_norm_cpu``, measured), where the meta kernel keeps
                                  the input's strides: BatchNorm1d over ``x.transpose(1, 2)`` returns a contiguous
                                  tensor, transposed back a non-contiguous one, so a following ``Linear`` copies
                                  it (``clone`` + ``mm``, not ``view`` + ``addmm``): the op list, hence the plan's
                                  op keys, must be the real step's. CUDA target: the meta layout is right (CUDA's
                                  ``batch_norm_cuda`` allocates ``empty_like(input)``, measured on an H200); its
                                  cuDNN path makes the input contiguous first (sacplan.collector.kernels)
``aten.native_batch_norm_         grad_input in the *input's* suggested memory format (contiguous unless the input
backward``, ``aten.cudnn_batch_   is channels-last), not the output gradient's layout as the meta kernel / the
norm_backward``                   cuDNN decomposition give: every kernel of a target allocates it so (CPU
                                  ``batch_norm_backward_cpu_template``: ``empty_like(input,
                                  input.suggest_memory_format())``; CUDA ``batch_norm_backward_cuda``: the fused
                                  template's ``empty_like(input, contiguous)``, the elementwise one's
                                  ``empty(input.sizes(), input.suggest_memory_format())``; cuDNN
                                  ``cudnn_batch_norm_backward``: ``empty(input.sizes(), ...,
                                  input->suggest_memory_format())``). A gradient arriving transposed (BatchNorm1d
                                  over ``x.transpose(1, 2)``) leaves as a contiguous tensor, which is what the
                                  next op's backward (a convolution's workspace) sees
``aten.mse_loss``,                reduced (mean / sum): a 0-d result whose *storage* holds the unreduced loss, as
``aten.smooth_l1_loss``,          on CPU and CUDA alike (Loss.cpp, both devices): the structured
``aten.binary_cross_entropy``,    ``mse_loss`` / ``smooth_l1_loss`` meta functions allocate the output over the
``aten.soft_margin_loss``         broadcast inputs and ``resize_({})`` it (a resize never shrinks a storage);
                                  ``binary_cross_entropy`` (CPU and CUDA) computes into ``empty_like(input)`` and
                                  ``resize_as_`` s it to the 0-d mean; ``soft_margin_loss`` computes into its
                                  output and ``resize_({})`` s it. The loss therefore holds input-sized bytes until
                                  it dies (``huber_loss``, ``l1_loss``, ``nll_loss`` return a fresh 0-d tensor)
================================  ================================================================================

The last two rows are about where an output's bytes live, not about values: :data:`LAYOUT_KERNELS`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._prims_common import suggest_memory_format
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from sacplan.opnames import op_argument

aten = torch.ops.aten

#: What a tensor without a real value was computed from (the text errors give).
NO_VALUE_SOURCES = (
    "a parameter, buffer or optimizer state, or an activation computed from them (sacplan never materialises "
    "weights, and a value of the initial weights would not be the trained model's)"
)
#: The source when the step's inputs have no real values (made by a factory or a preset).
FACTORY_SOURCE = (
    "values sacplan does not have: the inputs were made by a factory or a preset (only real example tensors "
    "passed to collect have values), and weights are never materialised"
)

#: The source when the value was drawn at random (or computed from a draw).
RANDOM_SOURCE = "a random draw (torch.rand / randint / bernoulli...; e.g. LayerDrop's choice of the layers that run)"


class UnansweredValue(RuntimeError):
    """The fake step needed a tensor value (or a value-dependent shape) that no real tensor determines.

    Attributes:
        op: the aten op that needed it.
        random: the value comes from a random draw (:data:`RANDOM_SOURCE`).
    """

    def __init__(self, op: Any, what: str, source: str = NO_VALUE_SOURCES) -> None:
        self.op, self.what = op, what
        self.random = source == RANDOM_SOURCE
        super().__init__(f"{op} needs {what}, which depends on {source}")


#: ``kernel(mode, func, args, kwargs) -> outputs | NotImplemented`` (``mode``: the RealValueMode).
FakeKernel = Callable[[Any, Any, tuple, dict], Any]


def _device(*ts: Any) -> torch.device:
    return next((t.device for t in ts if isinstance(t, torch.Tensor)), torch.device("cpu"))


def meta_call(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func``'s meta kernel on meta copies of the (fake) tensor arguments; outputs as fakes."""
    device = _device(*args, *kwargs.values())

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    with _disable_current_modes():
        out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    return tree_map(lambda m: mode.fake_like(m, device) if isinstance(m, torch.Tensor) else m, out)


def _lengths(mode: Any, func: Any, t: Any, name: str) -> list[int]:
    if not isinstance(t, torch.Tensor):
        return list(t)
    v = mode.value_of(t)
    if v is None:
        raise UnansweredValue(func, f"the values of {name} (the loss's saved alignment has 2 * max({name}) + 1 columns)")
    with _disable_current_modes():
        return [int(x) for x in v.reshape(-1).tolist()]


def ctc_loss(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``aten._ctc_loss`` (both overloads) through the IntList overload's meta kernel."""
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "zero_infinity")
    b = dict(zip(names, args), **kwargs)
    log_probs = b["log_probs"]
    target_lengths = _lengths(mode, func, b["target_lengths"], "target_lengths")
    il = b["input_lengths"]
    if isinstance(il, torch.Tensor) and mode.value_of(il) is None:
        # input lengths fix no shape: the kernel only checks them against T (the real step checks the values)
        input_lengths = [log_probs.shape[0]] * len(target_lengths)
    else:
        input_lengths = _lengths(mode, func, il, "input_lengths")
    call = (log_probs, b["targets"], input_lengths, target_lengths, b.get("blank", 0), b.get("zero_infinity", False))
    return meta_call(mode, aten._ctc_loss.default, call, {})


def ctc_loss_backward(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``aten._ctc_loss_backward``: the gradient of the log-probs, contiguous."""
    log_probs = args[1] if len(args) > 1 else kwargs["log_probs"]
    return torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)


def index_bool(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``x[mask]``: a boolean index with a real value becomes its long indices (``nonzero``)."""
    x = args[0] if args else kwargs["self"]
    indices = list(args[1] if len(args) > 1 else kwargs["indices"])
    if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return NotImplemented
    if all(mode.known(t) for t in [x, *[i for i in indices if i is not None]]):
        return NotImplemented  # fake mode refuses; the generic real-value answer evaluates the whole op
    out: list[Any] = []
    for i in indices:
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            v = mode.value_of(i)
            if v is None:
                raise UnansweredValue(func, "the values of a boolean index (its count of True elements sets the shape)")
            with _disable_current_modes():
                cols = [col.contiguous() for col in v.nonzero().unbind(1)]
            out.extend(mode.fake_like(col, i.device) for col in cols)
        else:
            out.append(i)
    return func(x, out)


def masked_select(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``masked_select(x, mask)``: 1-D, as many elements as the broadcast mask has True values."""
    b = dict(zip(("self", "mask"), args), **kwargs)
    x, mask = b["self"], b["mask"]
    if mode.known(x):
        return NotImplemented
    v = mode.value_of(mask)
    if v is None:
        raise UnansweredValue(func, "the values of its mask (its count of True elements sets the shape)")
    with _disable_current_modes():
        n = int(v.expand(torch.broadcast_shapes(x.shape, mask.shape)).sum())
    return torch.empty((n,), dtype=x.dtype, device=x.device)


def _first_laid_out_as(out: tuple, x: Any) -> tuple:
    """``out`` with its first tensor (a fresh kernel output) re-made in ``x``'s suggested memory format."""
    first = out[0]
    if not isinstance(first, torch.Tensor) or not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        return out
    fmt = suggest_memory_format(x)
    if first.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty(x.shape, dtype=first.dtype, device=first.device, memory_format=fmt), *out[1:])


def batch_norm_output(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``native_batch_norm`` on a CPU target: the output in the input's suggested memory format."""
    out = func(*args, **kwargs)
    return out if mode.cuda_target else _first_laid_out_as(out, args[0] if args else kwargs["input"])


def batch_norm_backward(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Batch norm backward with grad_input laid out as the input (its suggested memory format), every target."""
    out = func(*args, **kwargs)
    names = ("input", "grad_output") if func is aten.cudnn_batch_norm_backward.default else ("grad_out", "input")
    return _first_laid_out_as(out, dict(zip(names, args), **kwargs)["input"])


#: Losses whose reduced result keeps the unreduced storage.
UNREDUCED_STORAGE_LOSSES = frozenset({
    aten.mse_loss.default, aten.smooth_l1_loss.default, aten.soft_margin_loss.default, aten.binary_cross_entropy.default,
})


def loss_reduced(func: Any, args: tuple, kwargs: dict) -> bool:
    """A loss op call reduces (its ``reduction`` is mean or sum, the default mean), by keyword or by position."""
    return op_argument(func, args, kwargs, "reduction", 1) != 0


def unreduced_loss_shape(func: Any, x: torch.Tensor, target: torch.Tensor) -> torch.Size:
    """The shape a loss computes before it reduces: the input's for BCE and soft margin (computed into
    ``empty_like(input)`` / an output resized to the input's sizes), else input and target broadcast (the
    structured meta's binary TensorIterator)."""
    if func is aten.binary_cross_entropy.default or func is aten.soft_margin_loss.default:
        return x.shape
    return torch.broadcast_shapes(x.shape, target.shape)


def unreduced_loss_storage(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """A reduced loss of :data:`UNREDUCED_STORAGE_LOSSES`: the 0-d result on a storage of the unreduced loss's size."""
    out = func(*args, **kwargs)
    if not loss_reduced(func, args, kwargs) or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out  # reduction="none": an ordinary elementwise output
    x, target = args[0], args[1] if len(args) > 1 else kwargs["target"]
    held = torch.empty(unreduced_loss_shape(func, x, target), dtype=out.dtype, device=out.device)
    held.resize_(())  # as the kernels do: the storage keeps its bytes
    return held


#: Kernels that decide where an op's output bytes live (layout, storage size) as the target's kernels do; they
#: need no real value (the other kernels answer value-dependent shapes).
LAYOUT_KERNELS: dict[Any, FakeKernel] = {
    aten.native_batch_norm.default: batch_norm_output,
    aten.native_batch_norm_backward.default: batch_norm_backward,
    aten.cudnn_batch_norm_backward.default: batch_norm_backward,
    **{op: unreduced_loss_storage for op in UNREDUCED_STORAGE_LOSSES},
}

#: The ops above and their kernels.
FAKE_KERNELS: dict[Any, FakeKernel] = {
    **LAYOUT_KERNELS,
    aten._ctc_loss.default: ctc_loss,
    aten._ctc_loss.Tensor: ctc_loss,
    aten._ctc_loss_backward.default: ctc_loss_backward,
    aten._ctc_loss_backward.Tensor: ctc_loss_backward,
    aten.index.Tensor: index_bool,
    aten.masked_select.default: masked_select,
}
