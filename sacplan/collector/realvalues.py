"""Answer, on fake tensors, the questions only tensor *values* can answer, from the real example inputs.

Fake tensors have shapes but no values, so a forward that reads a value stops the fake step: ``.item()``,
``.tolist()``, ``if labels.max() >= vocab:`` (all ``aten._local_scalar_dense``), or an op whose output
*shape* depends on values (``nonzero``, boolean-mask indexing, ``masked_select``, ``repeat_interleave`` with a
tensor of repeats, a CTC loss's ``target_lengths``). Most such values are functions of the *inputs* alone
(labels, attention masks, lengths), which the caller handed to :func:`sacplan.collect` as real tensors.

:class:`RealValueMode` (a ``TorchDispatchMode`` above fake mode, below the recorder) keeps, for every fake
tensor computed only from real inputs and constants, a *recipe*: the op and its arguments (other recipes or
real constant tensors), never the fake tensors themselves (they must die when the step frees them, or memory
accounting would change). Nothing real is computed until a question is asked; then the recipe is evaluated
once on the real CPU tensors (no grad, no modes) and memoised. So the answer is exact -- the same ops on the
same values the real step computes -- and costs only the input-side ops that lead to it.

Rules:

* a tensor has a recipe when every tensor argument of the op that made it has one (or is a real tensor) and the
  op is not random; factory ops (``arange``, ``full``) have recipes. A random draw (``torch.rand([]) <
  layerdrop``: which layers run) has a recipe marked random and is never evaluated: one draw is not *the*
  step, and the plan must hold for the step that runs every layer;
* an in-place op (``index_put_``, ``copy_``, ``add_``...) gives the mutated tensor a new recipe (evaluated on a
  clone, so earlier recipes keep their values) and drops the recipe of every other tensor sharing its storage
  (views of it, its base): conservative -- a dropped recipe means "unknown", never a stale value;
* parameters, buffers, optimizer state and everything computed from them have no recipe: sacplan never
  materialises weights (a 7B model's are not in host memory), and a value that depends on weights (a
  mixture-of-experts router's token counts) would hold only for the weights at initialisation, not the
  training step being planned. Such a question raises :class:`UnansweredValue`, which ``collect`` turns into
  a ``CollectionError`` naming the module, the op and what to do;
* inputs made by a factory (``inputs=lambda: ...``) or a preset have no real values either (they are built
  directly as fakes).

Ops with a dynamic output shape whose shape depends on only *some* arguments (boolean-mask indexing of an
activation by a mask from the inputs, ``masked_select``, CTC loss) get an op-specific fake kernel from
:mod:`sacplan.collector.fakekernels`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    UnsupportedOperatorException,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from sacplan.collector.calling import as_inputs
from sacplan.collector.fakekernels import (
    FACTORY_SOURCE, FAKE_KERNELS, LAYOUT_KERNELS, NO_VALUE_SOURCES, RANDOM_SOURCE, UnansweredValue,
)

__all__ = ["RealValueMode", "HostFastPaths", "UnansweredValue", "NO_VALUE_SOURCES"]

aten = torch.ops.aten

class _Call:
    """One recorded op on known arguments: ``leaves`` are the flattened (args, kwargs), tensors replaced by
    :class:`_Node` or real constant tensors; ``written``: leaf positions the op mutates."""

    __slots__ = ("func", "leaves", "spec", "written", "outputs", "args_after", "failed", "random")

    def __init__(self, func: Any, leaves: list[Any], spec: Any, written: tuple[int, ...]) -> None:
        self.func, self.leaves, self.spec, self.written = func, leaves, spec, written
        #: a random draw (``torch.rand``...) or computed from one: never evaluated (no value is *the* value)
        self.random = torch.Tag.nondeterministic_seeded in func.tags or any(
            isinstance(leaf, _Node) and leaf.call.random for leaf in leaves
        )
        self.outputs: list[Any] | None = None
        self.args_after: dict[int, torch.Tensor] = {}
        self.failed = False

    def inputs(self) -> list["_Call"]:
        return [leaf.call for leaf in self.leaves if isinstance(leaf, _Node) and leaf.call.outputs is None]

    def run(self) -> None:
        """Evaluate on real tensors (all input calls evaluated already); mutated arguments are cloned first."""
        real = []
        for i, leaf in enumerate(self.leaves):
            v = leaf.value_now() if isinstance(leaf, _Node) else leaf
            if i in self.written and isinstance(v, torch.Tensor):
                v = v.clone()
                self.args_after[i] = v
            real.append(v)
        args, kwargs = tree_unflatten(real, self.spec)
        try:
            out = self.func(*args, **kwargs)
        except Exception:
            self.failed = True
            self.outputs = []
            return
        self.outputs = tree_flatten(out)[0]


class _Node:
    """A fake tensor's recipe: output ``index`` of ``call``, or (``arg=True``) its mutated argument ``index``."""

    __slots__ = ("call", "index", "arg")

    def __init__(self, call: _Call, index: int, arg: bool = False) -> None:
        self.call, self.index, self.arg = call, index, arg

    def value_now(self) -> torch.Tensor | None:
        c = self.call
        if c.failed:
            return None
        return c.args_after.get(self.index) if self.arg else c.outputs[self.index]  # type: ignore[index]

    def value(self) -> torch.Tensor | None:
        """The real tensor, evaluating the calls it depends on (iteratively, each once); None if one failed or
        it depends on a random draw."""
        if self.call.random:
            return None
        stack = [self.call]
        while stack:
            c = stack[-1]
            if c.outputs is not None:
                stack.pop()
                continue
            pending = c.inputs()
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if any(isinstance(leaf, _Node) and leaf.value_now() is None for leaf in c.leaves):
                c.failed, c.outputs = True, []
            else:
                with _disable_current_modes(), torch.no_grad():
                    c.run()
        v = self.value_now()
        return v if isinstance(v, torch.Tensor) else None


def _written_ids(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """``id`` of every tensor an op writes to (schema arguments marked ``(a!)``, ``out=`` included)."""
    out: set[int] = set()
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out.update(id(t) for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))
    return out


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class RealValueMode(TorchDispatchMode):
    """Answers value questions on fakes from the real inputs (see the module docstring).

    Use inside the fake mode the step's tensors belong to and below any recorder, after :meth:`bind`.

    Args:
        cuda_target: the step is collected for a CUDA device (the layout kernels of
            :data:`~sacplan.collector.fakekernels.LAYOUT_KERNELS` follow the target's kernels; default: the host CPU).
    """

    def __init__(self, cuda_target: bool = False) -> None:
        super().__init__()
        self.cuda_target = cuda_target
        self.nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._ids: set[int] = set()  # ids ever given a recipe: a fast "certainly unknown" test per op
        self._mutable: dict[Any, bool] = {}
        self.aliases: dict[int, list[weakref.ref]] = {}
        self.answered = 0  # questions answered from real values (for tests and the report)
        self.bound = 0  # input tensors with real values (0: a factory or a preset made the inputs)

    # ------------------------------------------------------------------ recipes -------------------
    def bind(self, fakes: Any, reals: Any) -> int:
        """Give each fake tensor in ``fakes`` the value of the real tensor at the same place in ``reals``
        (both the forward's arguments, :func:`~sacplan.collector.calling.as_inputs` form); returns how many."""
        if reals is None:
            return 0
        flat_f, spec_f = tree_flatten(as_inputs(fakes))
        flat_r, spec_r = tree_flatten(as_inputs(reals))
        if spec_f != spec_r:
            return 0
        n = 0
        for f, r in zip(flat_f, flat_r):
            if (
                isinstance(f, FakeTensor) and isinstance(r, torch.Tensor) and not isinstance(r, FakeTensor)
                and r.device.type == "cpu" and r.shape == f.shape and r.dtype == f.dtype and r.layout == torch.strided
            ):
                self._set(f, _Node(_Call(aten.alias.default, [r], tree_flatten(((r,), {}))[1], ()), 0))
                n += 1
        self.bound += n
        return n

    def _set(self, t: torch.Tensor, node: _Node) -> None:
        sid = _storage_id(t)
        if sid is None:
            return
        self.nodes[t] = node
        self._ids.add(id(t))
        self.aliases.setdefault(sid, []).append(weakref.ref(t))

    def _drop_storage(self, t: torch.Tensor) -> None:
        sid = _storage_id(t)
        for ref in self.aliases.pop(sid, ()) if sid is not None else ():
            other = ref()
            if other is not None:
                self.nodes.pop(other, None)

    def known(self, t: Any) -> bool:
        """``t`` is a real tensor or a fake with a recipe."""
        return isinstance(t, torch.Tensor) and (not isinstance(t, FakeTensor) or t in self.nodes)

    def value_of(self, t: Any) -> torch.Tensor | None:
        """The real value of tensor ``t`` (a real tensor is its own value); None when unknown."""
        if not isinstance(t, torch.Tensor):
            return None
        if not isinstance(t, FakeTensor):
            return t
        node = self.nodes.get(t)
        return None if node is None else node.value()

    def fake_like(self, real: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A fake tensor (current fake mode) of ``real``'s shape, strides and dtype on ``device``."""
        return torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)

    # ------------------------------------------------------------------ dispatch ------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            return self._dispatch(func, args, kwargs or {})
        except UnansweredValue as e:
            if self.bound or e.random:
                raise
            raise UnansweredValue(e.op, e.what, FACTORY_SOURCE) from None

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is aten._local_scalar_dense.default:
            v = self.value_of(args[0])
            if v is not None:
                self.answered += 1
                with _disable_current_modes():
                    return v.item()
            try:
                return func(*args, **kwargs)  # fake mode knows the values of its own constants (torch.tensor(2.0))
            except DataDependentOutputException:
                node = self.nodes.get(args[0])
                raise UnansweredValue(
                    func, "the value of a tensor (.item(), .tolist(), bool() or int() of a tensor)",
                    RANDOM_SOURCE if node is not None and node.call.random else NO_VALUE_SOURCES,
                ) from None
        kernel = FAKE_KERNELS.get(func)
        out = kernel(self, func, args, kwargs) if kernel is not None else NotImplemented
        if out is not NotImplemented:
            self.answered += func not in LAYOUT_KERNELS  # layout kernels answer no value question
        else:
            try:
                out = func(*args, **kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException, UnsupportedOperatorException):
                out = self._answer(func, args, kwargs)
                if out is None:
                    raise
                return out
        self._record(func, args, kwargs, out)
        return out

    def _certainly_unknown(self, args: tuple) -> bool:
        """A positional argument (or one in a list) is a fake that never had a recipe: most ops of a step, on
        activations, are dismissed by this test without flattening their arguments."""
        for a in args:
            if isinstance(a, FakeTensor):
                if id(a) not in self._ids:
                    return True
            elif isinstance(a, (list, tuple)):
                if any(isinstance(x, FakeTensor) and id(x) not in self._ids for x in a):
                    return True
        return False

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        mutable = self._mutable.get(func)
        if mutable is None:
            mutable = self._mutable[func] = func._schema.is_mutable
        if not mutable and self._certainly_unknown(args):
            return
        leaves, spec = tree_flatten((args, kwargs))
        written = _written_ids(func, args, kwargs) if mutable else set()
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        known = all(self.known(x) for x in tensors)
        if not known and not written:
            return
        call = None
        if known:
            wpos = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and id(x) in written)
            call = _Call(func, [self.nodes[x] if isinstance(x, FakeTensor) else x for x in leaves], spec, wpos)
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and id(x) in written:
                self._drop_storage(x)
                if call is not None and isinstance(x, FakeTensor):
                    self._set(x, _Node(call, i, arg=True))
        if call is None:
            return
        for i, o in enumerate(tree_flatten(out)[0]):
            if isinstance(o, FakeTensor) and id(o) not in written:
                self._set(o, _Node(call, i))

    def _answer(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Outputs for an op fake mode refused (value-dependent shape), evaluated on the real values of all its
        tensor arguments; None when one has no value."""
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors or not all(self.known(x) for x in tensors) or func._schema.is_mutable:
            return None
        call = _Call(func, [self.nodes[x] if isinstance(x, FakeTensor) else x for x in leaves], spec, ())
        node = _Node(call, 0)
        if node.value() is None:
            return None
        device = next((x.device for x in tensors if isinstance(x, FakeTensor)), torch.device("cpu"))
        flat = [self.fake_like(r, device) if isinstance(r, torch.Tensor) else r for r in call.outputs]  # type: ignore[union-attr]
        for i, o in enumerate(flat):
            if isinstance(o, FakeTensor):
                self._set(o, _Node(call, i))
        self.answered += 1
        _, out_spec = tree_flatten(_real_out_structure(func, call))
        return tree_unflatten(flat, out_spec)


def _real_out_structure(func: Any, call: _Call) -> Any:
    """The op's output structure: a tuple for multi-return schemas, else the single value."""
    returns = func._schema.returns
    if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
        return list(call.outputs or ())
    if len(returns) == 1:
        return call.outputs[0] if call.outputs else None  # type: ignore[index]
    return tuple(call.outputs or ())



class HostFastPaths(TorchFunctionMode):
    """Calls that take a different path for fake tensors than for real ones, put back on the real path.

    ``torch.ctc_loss`` (and ``F.ctc_loss``) with tensor lengths reads them on the host (``.to("cpu")``, a data
    pointer) and runs the int-list composite: ``aten._ctc_loss.default`` (autograd saves no length tensors),
    then for ``reduction="mean"`` a division by ``at::tensor(target_lengths).clamp_min(1)``. A tensor subclass
    (a fake) takes the tensor-lengths path instead (``aten._ctc_loss.Tensor``: both lengths saved for
    backward), and the int-list composite cannot run on fakes at all (``at::tensor`` writes through a data
    pointer). With real values for the lengths (from ``values``), this mode runs the int-list composite's ops
    from Python (:func:`ctc_loss_int_lists`), so the fake step runs the ops and saves the tensors of the real
    step; with unknown lengths the call is left as it is (the fake kernel then says what is missing).
    """

    def __init__(self, values: RealValueMode) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.ctc_loss or func is torch.ctc_loss:
            b = dict(zip(("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction",
                          "zero_infinity"), args), **kwargs)
            il, tl = (b.get(k) for k in ("input_lengths", "target_lengths"))
            values = [self.values.value_of(t) if isinstance(t, FakeTensor) else None for t in (il, tl)]
            if all(v is not None for v in values):
                with _disable_current_modes():
                    il, tl = ([int(x) for x in v.reshape(-1).tolist()] for v in values)  # type: ignore[union-attr]
                reduction = b.get("reduction", "mean" if func is torch.nn.functional.ctc_loss else 1)
                if isinstance(reduction, str):
                    reduction = {"none": 0, "mean": 1, "sum": 2}[reduction]
                return ctc_loss_int_lists(b["log_probs"], b["targets"], il, tl, int(b.get("blank", 0)), reduction,
                                          bool(b.get("zero_infinity", False)))
        return func(*args, **kwargs)


def ctc_loss_int_lists(
    log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: list[int], target_lengths: list[int], blank: int,
    reduction: int, zero_infinity: bool,
) -> torch.Tensor:
    """ATen's ``ctc_loss_impl`` for int-list lengths (not cuDNN), op for op; ``reduction``: 0 none, 1 mean, 2 sum."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    res = aten._ctc_loss(lp, targets.to(lp.device, torch.long), input_lengths, target_lengths, blank, zero_infinity)[0]
    if zero_infinity:
        res = torch.where(res == float("inf"), torch.zeros((), dtype=res.dtype, device=res.device), res)
    if reduction == 1:
        return (res / torch.tensor(target_lengths, dtype=torch.long, device=res.device).clamp_min(1)).mean()
    if reduction == 2:
        return res.sum()
    return res if batched else res.squeeze(0)
