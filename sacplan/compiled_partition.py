"""Inductor's forward/backward partition of each compiled region, replayed in the fake step.

What a compiled region holds from its forward to its backward is not what its eager forward saves: AOTAutograd
traces the region's joint forward+backward graph with Inductor's decompositions, and Inductor's partition
function (``torch._inductor.compile_fx.partition_fn``: its joint-graph passes, then the min-cut partitioner)
chooses which forward values the backward graph reads; cheap pointwise values are recomputed in the backward
instead of saved, and a decomposition's values replace the eager kernels' saves (a tiny Llama block: 1.46 MB
saved where eager saves 1.90 MB; with two blocks the compiled step peaked 18% under the eager prediction).

:func:`trace_partitions` traces each region once on fake tensors (a fake forward of the model gives each
region's arguments) through ``aot_function`` with Inductor's decompositions and partition function; no code is
generated. :func:`replay_partitions` makes each region of a freshly built model run its partitioned graphs with
:class:`BufferReplay`, Inductor's buffer model: only what Inductor stores in buffers is allocated (extern
kernels such as matmuls and what they read, reductions, graph outputs), pointwise ops are computed inside their
readers' kernels, a kernel may write into a same-sized input it reads last, and every buffer is freed after its
last reader. A fake step (:func:`sacplan.collect`) of that model allocates, saves and frees what the compiled
graphs do (:func:`partitioned_step`). Not modelled: Inductor's layout choices (regions with convolutions keep
:mod:`sacplan.compiled_layout`), its scheduler's reordering for peak memory and fusions beyond the rules above.

Used for the step without a plan (:func:`sacplan.validation.validate` with ``compile=...``). A plan's
checkpoint inside a compiled region is traced by Dynamo as a higher-order operator whose recomputation the
partitioner places in the backward graph; traced here without Dynamo, the partition differs (it under-predicted
the planned tiny Llama by 8%), so planned steps keep :mod:`sacplan.compiled_saves`, a bound.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.collector.calling import call_model
from sacplan.collector.hf import training_without_cache, transformers_real_paths
from sacplan.collector.materialise import build_fake_model, make_inputs
from sacplan.errors import UnsupportedModelError

__all__ = ["BufferReplay", "Partitioned", "partitioned_step", "replay_partitions", "trace_partitions"]


@dataclass(frozen=True)
class Partitioned:
    """One compiled region's partitioned graphs.

    Attributes:
        call: ``call(named_params, named_buffers, *args, **kwargs)``: the region's forward run through the
            partitioned forward graph (its backward through the backward graph), with any module of the
            region's structure (the parameters are arguments).
        saved_bytes: bytes of the values the forward graph saves for the backward that are not the region's
            inputs, parameters or buffers (new storages, each counted once).
    """

    call: Callable[..., Any]
    saved_bytes: int


def _inductor_partition() -> Callable[..., Any]:
    """Inductor's partition function (its joint-graph passes, then the min-cut partitioner as Inductor calls it)."""
    from torch._inductor.compile_fx import partition_fn

    return partition_fn


def _saved_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """Bytes of the forward values ``bw`` reads that are new storages of ``fw`` (not its inputs), each once."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(n: torch.fx.Node) -> Any:
        v = n.meta.get("val")
        return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None

    nodes = {n.name: n for n in fw.graph.nodes}
    inputs = {storage(n) for n in fw.graph.nodes if n.op == "placeholder"} - {None}
    seen: set[Any] = set()
    total = 0
    for p in bw.graph.nodes:
        n = nodes.get(p.name) if p.op == "placeholder" and not p.name.startswith("tangents") else None
        s = storage(n) if n is not None else None
        if s is None or s in inputs or s in seen:
            continue
        seen.add(s)
        total += n.meta["val"].untyped_storage().nbytes()
    return total


def _number_checkpoints(joint: torch.fx.GraphModule) -> None:
    """Give each checkpointed stretch of ``joint`` its own ``ac_graph_id``, as Dynamo's checkpoint operator does.

    Traced without Dynamo, a selective checkpoint tags its nodes ``recompute`` (must save / prefer recompute)
    but leaves ``ac_graph_id`` unset; the partitioner compares ids to save a recomputable value a later
    checkpoint reads. Consecutive tagged forward nodes form one stretch.
    """
    graph_id, previous = 0, False
    for n in joint.graph.nodes:
        tagged = n.meta.get("recompute") is not None
        if tagged and n.meta.get("ac_graph_id") is None:
            if not previous:
                graph_id += 1
            n.meta["ac_graph_id"] = graph_id
        previous = tagged


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` answers True inside (torch's own session context where it has one; older
    releases read the same module flag without a context for it)."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = getattr(torch.compiler, "_is_compiling_flag", False)
    torch.compiler._is_compiling_flag = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old  # type: ignore[attr-defined]


def _trace(module: nn.Module, args: tuple, kwargs: dict) -> Partitioned:
    """``module`` traced on fake ``args`` / ``kwargs`` with Inductor's decompositions and partitioner."""
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    graphs: dict[str, torch.fx.GraphModule] = {}
    inductor_partition = _inductor_partition()

    def partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kw: Any) -> Any:
        _number_checkpoints(joint)
        graphs["fw"], graphs["bw"] = inductor_partition(joint, joint_inputs, **kw)
        return graphs["fw"], graphs["bw"]

    def compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return BufferReplay(gm)

    def functional(named_params: dict, named_buffers: dict, *a: Any, **k: Any) -> Any:
        return torch.func.functional_call(module, {**named_params, **named_buffers}, a, k)

    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    call = aot_function(functional, fw_compiler=compiler, bw_compiler=compiler,
                        partition_fn=partition, decompositions=select_decomp_table(),
                        num_params_buffers=len(params) + len(buffers))
    fake_mode = next((t.fake_mode for t in (*params.values(), *buffers.values()) if hasattr(t, "fake_mode")), None)
    # traced as under torch.compile (torch.compiler.is_compiling()): a planned region takes its compiled path, a
    # selective policy that tags every op (sacplan.apply), full checkpoints included
    with V.set_fake_mode(fake_mode or FakeTensorMode(allow_non_fake_inputs=True)), _compiling():
        out = call(params, buffers, *args, **kwargs)
    del out
    if "fw" not in graphs:
        raise UnsupportedModelError("the compiled region's trace produced no forward graph")
    saved = _saved_bytes(graphs["fw"], graphs["bw"]) if "bw" in graphs else 0
    return Partitioned(call, saved)


def trace_partitions(build: Callable[[], nn.Module], raw_inputs: Any, regions: Sequence[str]) -> dict[str, Partitioned]:
    """Each region of ``build()`` (fqns, ``""``: the whole model) traced and partitioned as Inductor does, on the
    arguments a fake forward of the model on ``raw_inputs`` hands it (the first call of each).

    Raises:
        UnsupportedModelError: a region did not run in the forward.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_model(build, None, fake_mode, None)
    args = make_inputs(raw_inputs, None, fake_mode, None, None)
    seen: dict[str, tuple[tuple, dict]] = {}

    def grab(fqn: str) -> Callable[..., None]:
        def hook(m: nn.Module, a: tuple, k: dict) -> None:
            seen.setdefault(fqn, (a, k))
        return hook

    handles = [model.get_submodule(f).register_forward_pre_hook(grab(f), with_kwargs=True) for f in regions]
    try:
        # the attention paths the fake step takes (sacplan.collector.step): the regions' arguments are the same
        real_inputs = None if callable(raw_inputs) and not isinstance(raw_inputs, torch.Tensor) else raw_inputs
        with training_without_cache(model), transformers_real_paths(real_inputs), fake_mode:
            call_model(model, args)
    finally:
        for h in handles:
            h.remove()
    missing = [f for f in regions if f not in seen]
    if missing:
        raise UnsupportedModelError(f"compiled regions {missing[:3]} did not run in the model's forward")
    traced: dict[tuple, Partitioned] = {}  # identical blocks on same-shaped arguments share their graphs
    out = {}
    with training_without_cache(model):
        for f in regions:
            module = model.get_submodule(f)
            key = _signature(module, seen[f])
            if key not in traced:
                traced[key] = _trace(module, *seen[f])
            out[f] = traced[key]
    return out


def _signature(module: nn.Module, arguments: tuple[tuple, dict]) -> tuple:
    """What a region's partitioned graphs depend on: its class, its parameters' and buffers' names, shapes and
    dtypes, its forward (a planned module's differs), and its arguments' structure, shapes and dtypes."""
    def sig(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)
        return repr(t)

    leaves, spec = pytree.tree_flatten(arguments)
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)))
    planned = tuple(sorted((n, repr(m.__dict__.get("forward"))) for n, m in module.named_modules() if "forward" in m.__dict__))
    return (type(module), tensors, planned, str(spec), tuple(sig(t) for t in leaves))


#: matmul-like ops Inductor runs as extern kernels (templates or library calls) on inputs stored in buffers
_MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "convolution", "_int_mm"})


def _kind(n: torch.fx.Node) -> str:
    """How Inductor lowers node ``n``: ``"view"`` (aliases its first argument), ``"inplace"`` (writes an
    argument), ``"reduction"`` (a buffer of its own), ``"extern"`` (a library kernel or fallback: a buffer of
    its own, its inputs in buffers), ``"pointwise"`` (any other op Inductor lowers itself: inlined into its
    readers), ``"getitem"`` (one output of a multi-output node), ``"other"`` (placeholders, the output)."""
    from torch._inductor.lowering import fallbacks, lowerings, needs_realized_inputs

    if n.op != "call_function":
        return "other"
    t = n.target
    if t is operator.getitem:
        return "getitem"
    schema = getattr(t, "_schema", None)
    if schema is not None and schema.returns and schema.returns[0].alias_info is not None:
        return "inplace" if schema.returns[0].alias_info.is_write else "view"
    name = getattr(getattr(t, "overloadpacket", None), "__name__", "")
    if t in needs_realized_inputs or t in fallbacks or t not in lowerings or name in _MATMULS:
        return "extern"
    return "reduction" if "reduction" in {tag.name for tag in getattr(t, "tags", ())} else "pointwise"


def _realized(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes Inductor stores in buffers: placeholders, reductions, extern kernels (matmuls, attention, any op
    without a pointwise lowering) and what they read, and the graph's outputs; a pointwise node read only by
    pointwise nodes and reductions is computed inside its readers' kernels (Inductor's default fusion). Views and
    multi-output items are stored where their base is."""
    out: set[torch.fx.Node] = set()

    def realize(a: Any) -> None:
        if isinstance(a, torch.fx.Node):
            if _kind(a) in ("view", "getitem", "inplace"):
                realize(a.args[0])
            else:
                out.add(a)

    for n in graph.nodes:
        k = _kind(n)
        if n.op == "placeholder" or k in ("reduction", "extern"):
            out.add(n)
        if k in ("extern", "inplace") or n.op == "output":
            for a in n.all_input_nodes:
                realize(a)
    return out


class BufferReplay:
    """An FX graph of AOTAutograd run for its memory as Inductor's kernels would use it, on fake tensors.

    Each buffer Inductor stores (:func:`_realized`) is allocated (``empty_strided`` of the node's recorded size,
    strides and dtype) where its node runs, views and in-place writes run on those buffers, and every buffer is
    freed after the last kernel that reads it (a fused pointwise node reads at its readers' kernels). Values are
    not computed: for fake steps only (:func:`replay_partitions`). Called with AOTAutograd's boxed convention
    (one list, emptied, so that inputs the graph reads last are freed at their last use).
    """

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.nodes = list(gm.graph.nodes)
        realized = _realized(gm.graph)
        self.available: set[torch.fx.Node] = set()
        for n in self.nodes:
            if n in realized or (_kind(n) in ("view", "getitem", "inplace") and n.args[0] in self.available):
                self.available.add(n)
        # where each node's value is read last: a node computed inside its readers' kernels reads at theirs
        runs_at: dict[torch.fx.Node, int] = {}
        for i in range(len(self.nodes) - 1, -1, -1):
            n = self.nodes[i]
            fused = n not in self.available and n.users
            runs_at[n] = max((runs_at[u] for u in n.users), default=i) if fused else i
        self.last_read: dict[int, list[torch.fx.Node]] = {}
        for n in self.nodes:
            if n.users:
                self.last_read.setdefault(max(runs_at[u] for u in n.users), []).append(n)

    def __call__(self, *call_args: Any) -> Any:
        # boxed (one list, which is emptied) or, as Inductor's own callers may call it, unboxed
        args = call_args[0] if len(call_args) == 1 and type(call_args[0]) is list else list(call_args)
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        env: dict[torch.fx.Node, Any] = dict(zip(placeholders, args))
        args.clear()  # env alone holds the inputs: each is freed at its last read (unless the caller holds it)
        result: Any = None
        for i, n in enumerate(self.nodes):
            if n.op == "placeholder":
                pass
            elif n.op == "output":
                result = torch.fx.node.map_arg(n.args[0], lambda a: env.get(a))
            elif n in self.available:
                self._reuse(i, n, env)
                env[n] = self._run(n, env)
            for dead in self.last_read.get(i, ()):
                env.pop(dead, None)
        return result

    def _reuse(self, i: int, n: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> None:
        """Inductor writes a kernel's output into an input buffer of the same size read last by that kernel
        (``config.inplace_buffers``): such an input is freed before the output is allocated."""
        v = n.meta.get("val")
        if _kind(n) not in ("pointwise", "reduction") or not isinstance(v, torch.Tensor):
            return
        for dead in self.last_read.get(i, ()):
            t = env.get(dead)
            if (dead.op != "placeholder" and isinstance(t, torch.Tensor) and t.dtype == v.dtype
                    and t.untyped_storage().nbytes() == v.untyped_storage().nbytes()):
                del env[dead], t
                return

    def _run(self, n: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
        k = _kind(n)
        if k in ("view", "getitem", "inplace"):
            if k == "inplace" and any(a not in env for a in n.all_input_nodes):
                return env[n.args[0]]  # a write from a value computed in a kernel: nothing allocated
            a, kw = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
            return n.target(*a, **kw)
        device = next((env[a].device for a in n.all_input_nodes if isinstance(env.get(a), torch.Tensor)), None)
        return pytree.tree_map(lambda v: _buffer(v, device), n.meta["val"])


def _buffer(v: Any, device: torch.device | None) -> Any:
    """An uninitialised tensor of ``v``'s size, strides and dtype (on ``device`` when given); other values as is."""
    if not isinstance(v, torch.Tensor):
        return v
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device or v.device)


class _ReplayedForward:
    """A region's forward run through its partitioned graphs (:class:`Partitioned`)."""

    def __init__(self, module: nn.Module, part: Partitioned) -> None:
        self.module, self.part = module, part

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        return self.part.call(dict(m.named_parameters(remove_duplicate=False)),
                              dict(m.named_buffers(remove_duplicate=False)), *args, **kwargs)


def replay_partitions(model: nn.Module, parts: dict[str, Partitioned]) -> nn.Module:
    """Make each region of ``model`` named in ``parts`` run its partitioned graphs (in place); returns ``model``."""
    for fqn, part in parts.items():
        module = model.get_submodule(fqn)
        module.forward = _ReplayedForward(module, part)  # type: ignore[method-assign]
    return model


def partitioned_step(build: Callable[[], nn.Module], raw_inputs: Any, regions: Sequence[str], **collect_kwargs: Any) -> Any:
    """The fake step (:func:`sacplan.collect` with ``collect_kwargs``) of ``build()`` with each region run through
    Inductor's partitioned graphs: its stats (``peak_bytes``: the compiled step's peak, bytes)."""
    from sacplan.collector import collect

    parts = trace_partitions(build, raw_inputs, regions)
    return collect(lambda: replay_partitions(build(), parts), raw_inputs, **collect_kwargs)
