"""Each compiled region as Dynamo and Inductor compile it, replayed in the fake step: the compiled step's memory.

What a compiled region holds from its forward to its backward, and what its kernels allocate, is not what its
eager forward does: Dynamo traces the region (a plan's checkpoint becomes its ``tag_activation_checkpoint``
operator), AOTAutograd traces the joint forward+backward with Inductor's decompositions, Inductor's partition
function (joint-graph passes, then the min-cut partitioner, which honours the checkpoint's recompute tags)
chooses what the forward saves and what the backward recomputes, and Inductor's scheduler fuses, reorders for
peak memory and allocates buffers (a tiny Llama block without a plan: 1.46 MB saved where eager saves 1.90 MB).

:func:`trace_regions` runs that whole pipeline on fake tensors, with the plan applied, as ``torch.compile`` would
on the real model: one fake forward of the model in which each region, at its first call, is compiled through
Dynamo (``fullgraph``, static shapes) with Inductor's ``compile_fx`` and :func:`sacplan.compiled_wrapper.inner_compile`
(Inductor's own wrapper code for the forward and backward graphs, its kernels left out), its backward compiled
too, and the forward then goes on through the compiled region (a region's output layout is the next region's
input, as in the compiled step). Identical regions on the same arguments with the same plan share one compiled
region. :func:`compiled_step` is the fake step (:func:`sacplan.collect`) of a fresh model with each region
running its compiled graphs: it allocates, saves and frees what the compiled step does (measured on CPU: the
compiled steps of a tiny Llama, a Hugging Face Llama and ``nn.TransformerEncoder``, with and without a plan,
byte for byte; ``benchmarks/RESULTS.md``). Seconds per distinct region: no kernel is compiled.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.apply import apply_plan
from sacplan.collector.calling import call_model
from sacplan.collector.hf import training_without_cache, transformers_real_paths
from sacplan.collector.materialise import build_fake_model, make_inputs
from sacplan.compiled_wrapper import inner_compile, no_compiled_caches
from sacplan.errors import UnsupportedModelError
from sacplan.fqns import inside

__all__ = ["CompiledRegion", "compiled_step", "replay_regions", "trace_regions"]

#: what a region's output leaf is taken from: an output of its Dynamo graph, or a constant
_GRAPH, _CONSTANT = "graph", "constant"


@dataclass(frozen=True)
class CompiledRegion:
    """One region compiled as ``torch.compile`` compiles it, its kernels left out (fake tensors only).

    Attributes:
        call: the Dynamo graph's compiled function (AOTAutograd's runtime over Inductor's forward and backward
            wrappers): ``call(*inputs)`` on the graph's flat inputs returns its flat outputs.
        inputs: where each graph input comes from, as Dynamo names it (``L['region']._modules['wq']._parameters
            ['weight']``, ``L['args'][0]``), compiled for evaluation against the region and its arguments.
        outputs: per leaf of the region's output, ``("graph", index)`` or ``("constant", value)``.
        out_spec: the region's output structure (a pytree spec).
    """

    call: Callable[..., Any]
    inputs: tuple[types.CodeType, ...]
    outputs: tuple[tuple[str, Any], ...]
    out_spec: Any

    def __call__(self, region: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The region's output on ``args`` / ``kwargs`` through the compiled graphs (differentiable)."""
        scope = {"L": {"region": region, "args": args, "kwargs": kwargs}, "__builtins__": {}}
        try:
            flat = [eval(code, scope) for code in self.inputs]  # noqa: S307 (Dynamo's own source expressions)
        except (KeyError, IndexError, AttributeError, NameError) as e:
            raise UnsupportedModelError(f"a compiled region's input is not found in its call ({e})") from e
        try:
            graph_out = self.call(*flat)
        except AssertionError as e:  # the wrapper's assert_size_stride: another layout than traced
            raise UnsupportedModelError(f"a compiled region was called on other shapes or strides than traced: {e}"
                                        ) from e
        leaves = [graph_out[v] if kind == _GRAPH else v for kind, v in self.outputs]
        return pytree.tree_unflatten(leaves, self.out_spec)


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    """``gm``'s attribute at dotted path ``target``."""
    out: Any = gm
    for name in target.split("."):
        out = getattr(out, name)
    return out


def _frame(region: nn.Module, args: tuple, kwargs: dict) -> Any:
    return region(*args, **kwargs)


def _fresh_frame() -> Callable[..., Any]:
    """:func:`_frame` with a code object of its own: Dynamo caches compiled code per code object (and limits
    recompilations per code object), and each trace must compile anew."""
    return types.FunctionType(_frame.__code__.replace(), {"__builtins__": __builtins__})


def _detached(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of the tensors in ``args`` / ``kwargs`` cut from the forward's autograd graph (same
    ``requires_grad``; a tensor passed twice stays one tensor), so that the trace's backward stops at them."""
    memo: dict[int, torch.Tensor] = {}

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            if id(t) not in memo:
                memo[id(t)] = t.detach().requires_grad_(t.requires_grad)
            return memo[id(t)]
        return t

    return pytree.tree_map(cut, (args, kwargs))


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor packed and unpacked as itself (no enclosing checkpoint's hooks)."""
    return t


def _own_saves() -> Any:
    """Identity saved-tensor hooks where an enclosing checkpoint's are active (none: nothing to do, the trace runs
    as ``torch.compile`` runs it)."""
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_kept, _kept)


def trace_region(region: nn.Module, args: tuple, kwargs: dict) -> CompiledRegion:
    """``region`` compiled on fake ``args`` / ``kwargs`` (its forward and backward graphs; see the module docstring).

    Raises:
        UnsupportedModelError: Dynamo cannot trace the region as one graph, or its output is not made of graph
            outputs and constants.
    """
    from torch._inductor.compile_fx import compile_fx

    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if any(n.op == "get_attr" and isinstance(_attr(gm, n.target), torch.Tensor) for n in gm.graph.nodes):
            raise UnsupportedModelError("the compiled region's graph holds tensor constants of the trace")
        seen["inputs"] = tuple(compile(n.meta["grapharg"].source.name, "<dynamo source>", "eval")
                               for n in gm.graph.nodes if n.op == "placeholder")
        seen["call"] = compile_fx(gm, example_inputs, inner_compile=inner_compile)

        def run(*flat: Any) -> Any:
            seen["out"] = out = seen["call"](*flat)
            return out

        return run

    a, k = _detached(args, kwargs)
    # A checkpoint around the region (a plan's, enclosing it) packs what the trace saves with its own hooks: the
    # trace's backward would then recompute the enclosing region. The trace keeps its saves itself.
    with _own_saves():
        try:
            out = torch.compile(_fresh_frame(), backend=backend, fullgraph=True, dynamic=False)(region, a, k)
        except UnsupportedModelError:
            raise
        except Exception as e:  # Dynamo's and Inductor's errors: the region cannot be predicted this way
            raise UnsupportedModelError(f"the compiled region could not be traced on fake tensors: "
                                        f"{type(e).__name__}: {str(e)[:300]}") from e
        leaves, spec = pytree.tree_flatten(out)
        needs_grad = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if needs_grad:  # compiles the backward graph now (AOTAutograd compiles it at the first backward)
            torch.autograd.backward(needs_grad, [torch.ones_like(t) for t in needs_grad])
    graph_out = list(seen.get("out", ()))
    outputs = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            outputs.append((_CONSTANT, leaf))
            continue
        index = next((i for i, g in enumerate(graph_out) if g is leaf), None)
        if index is None:
            raise UnsupportedModelError("a compiled region returns a tensor that is not an output of its graph")
        outputs.append((_GRAPH, index))
    return CompiledRegion(seen["call"], seen["inputs"], tuple(outputs), spec)


def _plan_key(plan: Any, fqn: str) -> tuple:
    """What a region's compiled graphs depend on in ``plan``: its decisions inside the region (names relative to
    it, saved ops, RNG state), and the plan's dropout numbering."""
    if plan is None:
        return ()
    decisions = tuple(sorted(
        (d.fqn[len(fqn):], repr(d.saved_ops), bool(getattr(d, "preserve_rng_state", True)))
        for d in plan.decisions if inside(d.fqn, fqn)))
    return (decisions, repr(getattr(plan, "fused_dropout", None)))


def _signature(region: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a region's compiled graphs depend on besides the plan: its class, its parameters' and buffers' names,
    shapes and dtypes, and its arguments' structure, shapes, strides and dtypes."""
    def sig(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)
        return repr(t)

    leaves, spec = pytree.tree_flatten((args, kwargs))
    named = (*region.named_parameters(remove_duplicate=False), *region.named_buffers(remove_duplicate=False))
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in named)
    return (type(region), tensors, str(spec), tuple(sig(t) for t in leaves))


class _TracedOnFirstCall:
    """A region's forward during :func:`trace_regions`: compiles the region at its call (once per signature), then
    runs the compiled graphs, so that the next region sees the layout the compiled step hands it."""

    def __init__(self, region: nn.Module, fqn: str, plan: Any, shared: dict[tuple, CompiledRegion],
                 found: dict[str, CompiledRegion]) -> None:
        self.region, self.fqn, self.plan, self.shared, self.found = region, fqn, plan, shared, found
        self.forward = region.__dict__.get("forward")  # a planned forward (sacplan.apply), or None: the class's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        region = self.region
        key = (_signature(region, args, kwargs), _plan_key(self.plan, self.fqn))
        if key not in self.shared:
            if self.forward is None:
                del region.forward
            else:
                region.forward = self.forward  # type: ignore[method-assign]
            try:
                self.shared[key] = trace_region(region, args, kwargs)
            finally:
                region.forward = self  # type: ignore[method-assign]
        compiled = self.found.setdefault(self.fqn, self.shared[key])
        return compiled(region, args, kwargs)


def trace_regions(build: Callable[[], nn.Module], raw_inputs: Any, regions: Sequence[str],
                  plan: Any = None) -> dict[str, CompiledRegion]:
    """Each region of ``build()`` (fqns, ``""``: the whole model), with ``plan`` applied, compiled as
    ``torch.compile`` compiles it, on the arguments a fake forward of the model on ``raw_inputs`` hands it.

    Raises:
        UnsupportedModelError: a region did not run in the forward, or could not be traced (see
            :func:`trace_region`).
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_model(build, None, fake_mode, None)
    if plan is not None:
        apply_plan(model, plan, check_fingerprint=False)
    args = make_inputs(raw_inputs, None, fake_mode, None, None)
    shared: dict[tuple, CompiledRegion] = {}
    found: dict[str, CompiledRegion] = {}
    for fqn in regions:
        region = model.get_submodule(fqn)
        region.forward = _TracedOnFirstCall(region, fqn, plan, shared, found)  # type: ignore[method-assign]
    # the attention paths the fake step takes (sacplan.collector.step): the regions' arguments are the same
    real_inputs = None if callable(raw_inputs) and not isinstance(raw_inputs, torch.Tensor) else raw_inputs
    with training_without_cache(model), transformers_real_paths(real_inputs), fake_mode, no_compiled_caches():
        call_model(model, args)
    missing = [f for f in regions if f not in found]
    if missing:
        raise UnsupportedModelError(f"compiled regions {missing[:3]} did not run in the model's forward")
    return found


class _ReplayedForward:
    """A region's forward run through its compiled graphs (:class:`CompiledRegion`)."""

    def __init__(self, region: nn.Module, compiled: CompiledRegion) -> None:
        self.region, self.compiled = region, compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(self.region, args, kwargs)


def replay_regions(model: nn.Module, compiled: dict[str, CompiledRegion]) -> nn.Module:
    """Make each region of ``model`` named in ``compiled`` run its compiled graphs (in place); returns ``model``."""
    for fqn, c in compiled.items():
        region = model.get_submodule(fqn)
        region.forward = _ReplayedForward(region, c)  # type: ignore[method-assign]
    return model


def compiled_step(build: Callable[[], nn.Module], raw_inputs: Any, regions: Sequence[str], plan: Any = None,
                  **collect_kwargs: Any) -> Any:
    """The fake step (:func:`sacplan.collect` with ``collect_kwargs``) of ``build()`` with ``plan`` applied (none:
    ``None``) and each of ``regions`` running its compiled graphs: its stats (``peak_bytes``: the compiled step's
    peak, bytes).

    Raises:
        UnsupportedModelError: see :func:`trace_regions`.
    """
    from sacplan.collector import collect

    compiled = trace_regions(build, raw_inputs, regions, plan)

    def replayed() -> nn.Module:
        model = build()
        if plan is not None:
            apply_plan(model, plan, check_fingerprint=False)
        return replay_regions(model, compiled)

    with no_compiled_caches():
        return collect(replayed, raw_inputs, **collect_kwargs)
