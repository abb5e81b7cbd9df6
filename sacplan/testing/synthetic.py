"""Synthetic :class:`~sacplan.stats.ModelStats` / :class:`~sacplan.tree.ModuleTree` for solver tests and
benchmarks, without running any model (a Llama-7B-shaped one: :mod:`sacplan.testing.llama_tree`).

A model is a tree of :class:`Spec` nodes. :func:`build_tree` simulates one training step *without*
checkpointing on that tree and records exactly what ``sacplan.collect`` records: per-module stats, the four
module-call orders and the memory timeline (:class:`~sacplan.stats.MemoryEvent`) with consistent
``fw_done``/``bw_started`` counters. The simulated step:

* every module call runs ``chunk 1`` of its own ops (allocating half of its own kept activations plus a
  transient ``tmp``), then its children (each ``repeat`` times), then ``chunk 2`` (the other half);
  a stretch between hooks is one ``fw`` event; the loss is an ``fw`` event after all forwards;
* backward visits module calls in reverse: at a module's backward start the stretch is an ``rc`` event
  (``extra_bytes`` = the subtree's largest forward transient, what recomputation would allocate again);
  chunk 2's activations are freed and half the module's gradients appear, the children run backward, then
  a ``bw`` event frees chunk 1 and adds the other half of the gradients;
* the optimizer step is an ``other`` event (state + a temporary).

Trade-offs come from explicit lines, or from an op list (greedy by bytes per ms, convex lines through the
greedy vertices), or are absent (module never checkpointable).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Sequence

from sacplan.devices import DeviceSpec
from sacplan.stats import MemoryEvent, MemSnapshot, ModelStats, ModuleStats, OpStat, Phase, TradeOff
from sacplan.tree import ModuleTree
from sacplan.tradeoff import segment_lines
from sacplan.units import GiB, MiB

#: An H100-SXM-like target (figures only matter for bookkeeping here).
H100 = DeviceSpec(
    name="H100-SXM",
    memory_bytes=80 * GiB,
    peak_flops={"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    hbm_bandwidth=3.35e12,
    # the selective mode's dispatch (sacplan.sacmode) is left out of these abstract trees, whose oracles price
    # save lists by their ops alone; tests/solver/test_dispatch_cost.py gives it a value and an oracle of its own
    sac_dispatch_ms=0.0,
    source="synthetic test spec",
)


@dataclass
class Spec:
    """One module of a synthetic model.

    Attributes:
        name: local name (fqn = parent fqn + "." + name; the root's name is ignored, its fqn is "").
        children: child specs, in forward order.
        repeat: how many times the module runs per call of its parent.
        act: own kept activation bytes per call (or ``act_calls`` per call index of this module).
        out: output bytes kept after the forward; they belong to the *parent's* activations (checkpointing
            this module does not free them), freed at this module's backward start.
        tmp: own transient bytes (forward and backward temporaries).
        params: own parameter bytes.
        fw_ms: own forward ms per call.
        lines: explicit trade-off lines ``((slope, intercept), ...)``; None: from ``ops`` if any, else
            a default two-line curve; ``no_tradeoff=True`` gives none.
        ops: op list (then the trade-off comes from a greedy over them).
        module_type: class name recorded in the stats.
    """

    name: str
    children: list["Spec"] = field(default_factory=list)
    repeat: int = 1
    act: int = 0
    act_calls: tuple[int, ...] | None = None
    tmp: int = 0
    params: int = 0
    fw_ms: float = 0.0
    lines: tuple[tuple[float, float], ...] | None = None
    ops: tuple[OpStat, ...] = ()
    no_tradeoff: bool = False
    module_type: str = "Module"
    recompute_stop: int | None = None
    out: int = 0


def greedy_tradeoff(ops: Sequence[OpStat], A: int, R: float, flops: int = 0) -> TradeOff:
    """Convex trade-off from an op list: discard op outputs in decreasing bytes per ms.

    Only ops autograd saves are discarded (``r`` = discarded bytes / A, ``q`` = recomputed ms / R); ``q(0)``
    is the share of every other op (views, transients, outputs), recomputed anyway. Lines join consecutive
    vertices (so they bound the greedy vertices, not the knapsack between them).
    """
    kept = [o for o in ops if o.saved_by_autograd and not o.is_view and o.save_cost_bytes > 0]
    view_ms = sum(o.runtime_ms for o in ops) - sum(o.runtime_ms for o in kept)
    items = sorted(
        kept,
        key=lambda o: (-(o.save_cost_bytes / max(o.runtime_ms, 1e-12)), o.index),
    )
    pts = [(0.0, view_ms / R if R > 0 else 0.0)]
    cb, cm = 0, view_ms
    for o in items:
        cb += o.save_cost_bytes
        cm += o.runtime_ms
        pts.append((cb / A, cm / R))
    slopes, intercepts = segment_lines(pts)
    if not slopes:
        slopes, intercepts = [0.0], [pts[0][1]]
    return TradeOff(
        max_discard_bytes=A,
        full_recompute_ms=R,
        points=tuple(pts),
        slopes=tuple(slopes),
        intercepts=tuple(intercepts),
        full_recompute_flops=flops,
    )


def lines_tradeoff(lines: Sequence[tuple[float, float]], A: int, R: float) -> TradeOff:
    pts = [(0.0, max(b for _, b in lines))]
    pts.append((1.0, max(s + b for s, b in lines)))
    return TradeOff(
        max_discard_bytes=A,
        full_recompute_ms=R,
        points=tuple(pts),
        slopes=tuple(float(s) for s, _ in lines),
        intercepts=tuple(float(b) for _, b in lines),
    )


@dataclass
class _Node:
    spec: Spec
    fqn: str
    parent: int | None
    depth: int
    children: list[int]


def _flatten(root: Spec) -> list[_Node]:
    out: list[_Node] = []

    def rec(sp: Spec, fqn: str, parent: int | None, depth: int) -> int:
        i = len(out)
        out.append(_Node(sp, fqn, parent, depth, []))
        for ch in sp.children:
            cf = ch.name if fqn == "" else f"{fqn}.{ch.name}"
            out[i].children.append(rec(ch, cf, i, depth + 1))
        return i

    rec(root, "", None, 0)
    return out


class _Step:
    """The simulated no-checkpointing step over a flattened tree (see the module docstring): the forward
    (:meth:`fw`), the backward in reverse (:meth:`bw`), and what ``collect`` would record of it."""

    def __init__(self, nodes: list[_Node], optimizer_factor: float, input_bytes: int) -> None:
        n = len(nodes)
        self.nodes = nodes
        self.params_total = sum(nd.spec.params for nd in nodes)
        self.opt = int(optimizer_factor * self.params_total)
        self.live = {"act": input_bytes, "grad": 0}
        self.orders: dict[str, list[str]] = {"fw_pre": [], "fw_post": [], "bw_pre": [], "bw_post": []}
        self.events: list[MemoryEvent] = []
        self.calls = [0] * n
        self.act_calls: list[list[int]] = [[] for _ in range(n)]
        self.trans_calls: list[list[int]] = [[] for _ in range(n)]
        self.snaps: list[list[dict[str, MemSnapshot]]] = [[] for _ in range(n)]
        self.fw_ms_calls: list[list[float]] = [[] for _ in range(n)]
        self.trace: list[tuple[int, int, int, int]] = []  # per call, in forward post-order: (node, call, chunk 1, chunk 2)
        self.fw_counter = 0
        self.bw_counter = 0

    def snap(self, tmp: int = 0) -> MemSnapshot:
        return MemSnapshot(param=self.params_total, grad=self.live["grad"], optimizer=self.opt, activation=self.live["act"], temp=tmp)

    def state(self) -> int:
        return self.params_total + self.live["grad"] + self.opt

    def own_act(self, i: int, c: int) -> int:
        sp = self.nodes[i].spec
        if sp.act_calls is not None:
            return int(sp.act_calls[c % len(sp.act_calls)])
        return int(sp.act)

    def _fw_event(self, i: int, c: int, chunk: int) -> None:
        peak = self.live["act"] + chunk + self.nodes[i].spec.tmp
        self.events.append(MemoryEvent(Phase.FW, self.nodes[i].fqn, c, self.fw_counter, 0, peak + self.state(), self.state()))
        self.live["act"] += chunk

    def fw(self, i: int) -> tuple[int, float]:
        """Run module i's forward; returns (max transient above the post-fw level, ms)."""
        nd, live = self.nodes[i], self.live
        sp, c = nd.spec, self.calls[i]
        self.calls[i] += 1
        self.orders["fw_pre"].append(nd.fqn)
        pre, start_act = self.snap(), live["act"]
        a = self.own_act(i, c)
        ch1, ch2 = a // 2, a - a // 2
        self._fw_event(i, c, ch1)
        max_trans, ms = sp.tmp, sp.fw_ms
        for ch in nd.children:
            for _ in range(self.nodes[ch].spec.repeat):
                t, m = self.fw(ch)
                max_trans = max(max_trans, t)
                ms += m
        self._fw_event(i, c, ch2)
        self.orders["fw_post"].append(nd.fqn)
        self.fw_counter += 1
        self.act_calls[i].append(live["act"] - start_act)
        live["act"] += sp.out
        self.trans_calls[i].append(max_trans)
        self.fw_ms_calls[i].append(ms)
        self.snaps[i].append({"pre_fw": pre, "peak_fw": self.snap(sp.tmp), "post_fw": self.snap()})
        self.trace.append((i, c, ch1, ch2))
        return max_trans, ms

    def call_roots(self) -> list[tuple[int, int, int, int, list]]:
        """The call tree rebuilt from the forward's post-order trace (a parent's record follows its children's):
        top-level calls, each ``(node, call, chunk 1, chunk 2, children in forward order)``."""
        stack: list[tuple[int, int, int, int, list]] = []
        for rec in self.trace:
            kids = []
            while stack and self.nodes[stack[-1][0]].parent == rec[0]:
                kids.append(stack.pop())
            stack.append((*rec, list(reversed(kids))))
        return stack

    def bw(self, item: tuple[int, int, int, int, list]) -> None:
        """Module call ``item``'s backward: its rc event, chunk 2 freed, its children's backwards, its bw event."""
        i, c, ch1, ch2, kids = item
        nd, live = self.nodes[i], self.live
        sp = nd.spec
        self.orders["bw_pre"].append(nd.fqn)
        self.bw_counter += 1
        pre, half = self.snap(), sp.params // 2
        self.events.append(MemoryEvent(Phase.RC, nd.fqn, c, self.fw_counter, self.bw_counter,
                                       live["act"] + sp.tmp + half + self.state(), self.state() + half, self.trans_calls[i][c]))
        live["act"] -= ch2 + sp.out
        live["grad"] += half
        peak_bw = self.snap(sp.tmp)
        for kid in reversed(kids):
            self.bw(kid)
        rest = sp.params - half
        self.events.append(MemoryEvent(Phase.BW, nd.fqn, c, self.fw_counter, self.bw_counter,
                                       live["act"] + sp.tmp + rest + self.state(), self.state() + rest))
        live["act"] -= ch1
        live["grad"] += rest
        self.orders["bw_post"].append(nd.fqn)
        self.snaps[i][c].update({"pre_bw": pre, "peak_bw": peak_bw, "post_bw": self.snap()})

    def module_stats(self, i: int, optimizer_factor: float) -> ModuleStats:
        """What ``collect`` records of node ``i``."""
        nd, acts, ms = self.nodes[i], self.act_calls[i], self.fw_ms_calls[i]
        sp = nd.spec
        A, R = (acts[0] if acts else 0), (ms[0] if ms else 0.0)
        sub_params = sum(self.nodes[j].spec.params for j in _subtree(self.nodes, i))
        tr: TradeOff | None = None
        if not sp.no_tradeoff and A > 0 and R > 0:
            if sp.lines is not None:
                tr = lines_tradeoff(sp.lines, A, R)
            elif sp.ops:
                tr = greedy_tradeoff(sp.ops, A, R, int(sum(o.flops for o in sp.ops)))
            else:
                tr = lines_tradeoff(((0.6, 0.05), (1.4, -0.35)), A, R)
        return ModuleStats(
            fqn=nd.fqn, module_type=sp.module_type, parent=None if nd.parent is None else self.nodes[nd.parent].fqn,
            depth=nd.depth, is_leaf=not nd.children, calls=self.calls[i], param_bytes=sub_params, buffer_bytes=0,
            grad_bytes=sub_params, optimizer_bytes=int(optimizer_factor * sub_params), input_bytes=0, output_bytes=0,
            act_bytes=tuple(acts), act_grad_bytes=tuple(sp.tmp for _ in acts), fw_transient_bytes=tuple(self.trans_calls[i]),
            fw_ms=tuple(ms), bw_ms=tuple(2 * m for m in ms), fw_flops=tuple(0 for _ in acts), bw_flops=tuple(0 for _ in acts),
            snapshots=tuple(self.snaps[i]), ops=tuple(sp.ops),
            recompute_stop=sp.recompute_stop if sp.recompute_stop is not None else len(sp.ops), tradeoff=tr,
        )


def build_stats(
    root: Spec,
    *,
    world_size: int = 1,
    optimizer_factor: float = 2.0,
    input_bytes: int = 0,
    loss_tmp: int = 0,
    model_name: str = "synthetic",
    device: DeviceSpec = H100,
) -> ModelStats:
    """Simulate one no-checkpointing step over ``root`` (see the module docstring)."""
    nodes = _flatten(root)
    step = _Step(nodes, optimizer_factor, input_bytes)
    for _ in range(root.repeat):
        step.fw(0)
    # loss: forward is complete, all activations still live
    step.events.append(MemoryEvent(Phase.FW, "", 0, step.fw_counter, 0, step.live["act"] + loss_tmp + step.state(), step.state()))
    # backward: module calls in reverse order of their forward end, parents before their children
    for item in reversed(step.call_roots()):
        step.bw(item)
    opt, state = step.opt, step.state()
    events = step.events
    events.append(MemoryEvent(Phase.OTHER, "", 0, step.fw_counter, step.bw_counter, state + step.live["act"] + opt // 4, state))
    modules = [step.module_stats(i, optimizer_factor) for i in range(len(nodes))]
    peak_ev = max(events, key=lambda e: e.peak_bytes)
    fw_total = sum(step.fw_ms_calls[0])
    h = hashlib.sha256(repr([(m.fqn, m.param_bytes) for m in modules]).encode()).hexdigest()[:16]
    params_total, o = step.params_total, step.orders
    return ModelStats(
        device=device, model_name=model_name, dtype="torch.bfloat16", world_size=world_size, modules=tuple(modules),
        fw_pre_order=tuple(o["fw_pre"]), fw_post_order=tuple(o["fw_post"]), bw_pre_order=tuple(o["bw_pre"]),
        bw_post_order=tuple(o["bw_post"]), events=tuple(events), peak_bytes=peak_ev.peak_bytes, peak_phase=peak_ev.phase,
        peak_module=peak_ev.module,
        peak_snapshot=MemSnapshot(param=params_total, grad=0, optimizer=opt, activation=peak_ev.peak_bytes - peak_ev.state_bytes),
        param_bytes=params_total, grad_bytes=params_total, optimizer_bytes=opt, fw_ms=fw_total, bw_ms=2 * fw_total,
        optimizer_ms=0.1, fw_flops=0, bw_flops=0, fingerprint=h,
    )


def _subtree(nodes: list[_Node], i: int) -> list[int]:
    out = [i]
    for c in nodes[i].children:
        out.extend(_subtree(nodes, c))
    return out


def build_tree(root: Spec, **kw) -> ModuleTree:
    """:func:`build_stats` wrapped in a :class:`ModuleTree`."""
    return ModuleTree(build_stats(root, **kw))


# ---------------------------------------------------------------------------------------------------------
# ready-made trees
# ---------------------------------------------------------------------------------------------------------
def hand_tree(*, state_bytes: int = 0, world_size: int = 1) -> ModuleTree:
    """Root with two blocks, events written by hand (the worked example in tests/solver/test_milp.py).

    b0, b1: A = 4 GiB per call, R = 10 ms, one trade-off line q = 0.2·y + 0.8·r.
    fw_post_order = (b0, b1, ""), bw_pre_order = ("", b1, b0); events (peak_bytes add ``state_bytes``):
    loss (fw, fw_done=3) 10 GiB; b1's backward start (rc, bw_started=2, extra 1 GiB) 10 GiB;
    b0's backward (bw, bw_started=3) 6 GiB; optimizer (other) 3 GiB.
    """
    tr = TradeOff(
        max_discard_bytes=4 * GiB, full_recompute_ms=10.0, points=((0.0, 0.2), (1.0, 1.0)),
        slopes=(0.8,), intercepts=(0.2,), full_recompute_flops=10**12,
    )
    sb = state_bytes
    events = [
        MemoryEvent(Phase.FW, "", 0, 3, 0, 10 * GiB + sb, sb),
        MemoryEvent(Phase.RC, "b1", 0, 3, 2, 10 * GiB + sb, sb, 1 * GiB),
        MemoryEvent(Phase.BW, "b0", 0, 3, 3, 6 * GiB + sb, sb),
        MemoryEvent(Phase.OTHER, "", 0, 3, 3, 3 * GiB + sb, sb),
    ]
    st = manual_stats(
        [("", None, (8 * GiB,), None), ("b0", "", (4 * GiB,), tr), ("b1", "", (4 * GiB,), tr)],
        ("b0", "b1", ""),
        ("", "b1", "b0"),
        events,
        world_size=world_size,
    )
    return ModuleTree(st)


def random_spec(rng: random.Random, max_modules: int = 8) -> Spec:
    """A random small tree: random nesting, repeats (calls), sizes, convex trade-off lines."""
    n = rng.randint(2, max_modules)
    specs = [Spec("m", params=rng.randint(0, 4) * 64 * MiB, fw_ms=rng.uniform(0, 1))]
    for k in range(1, n):
        # favour nesting below non-root modules so that there are internal (checkpointable) modules
        parent = specs[rng.randrange(1, len(specs))] if len(specs) > 1 and rng.random() < 0.6 else specs[0]
        sp = Spec(
            f"c{k}",
            repeat=rng.choice((1, 1, 1, 2)),
            act=rng.randint(0, 16) * 64 * MiB,
            act_calls=None,
            tmp=rng.randint(0, 4) * 16 * MiB,
            params=rng.randint(0, 4) * 32 * MiB,
            fw_ms=rng.uniform(0.1, 5.0),
            lines=random_lines(rng),
        )
        if rng.random() < 0.3:
            sp.act_calls = tuple(rng.randint(0, 16) * 64 * MiB for _ in range(2))
        parent.children.append(sp)
        specs.append(sp)
    return specs[0]


def random_lines(rng: random.Random) -> tuple[tuple[float, float], ...]:
    """Convex, non-decreasing piecewise-linear q(r) on [0, 1] with q(0) = b0 >= 0, as lines."""
    k = rng.randint(1, 3)
    b0 = rng.choice((0.0, 0.0, rng.uniform(0, 0.3)))
    slopes = sorted(rng.uniform(0.05, 2.0) for _ in range(k))
    breaks = sorted(rng.uniform(0.05, 0.95) for _ in range(k - 1))
    lines = []
    q, r0 = b0, 0.0
    for j, s in enumerate(slopes):
        lines.append((s, q - s * r0))
        if j < len(breaks):
            q += s * (breaks[j] - r0)
            r0 = breaks[j]
    return tuple(lines)


def op_stat(index: int, name: str, occ: int, nbytes: int, ms: float, flops: int = 0, kind: str = "") -> OpStat:
    """kind: "" (output saved by autograd), "view", "output" (the module output: free to save) or
    "transient" (not saved by autograd: saving it under SAC costs its bytes)."""
    view, output = kind == "view", kind == "output"
    return OpStat(
        index=index,
        name=name,
        occurrence=occ,
        out_bytes=0 if view else nbytes,
        runtime_ms=ms,
        flops=flops,
        is_view=view,
        saved_by_autograd=kind == "",
        is_output=output,
        save_cost_bytes=0 if (view or output) else nbytes,
    )


def ops_from_rows(rows: Sequence[tuple]) -> tuple[OpStat, ...]:
    """Number ops and count occurrences per name: rows are (name, bytes, ms, flops[, 'view'|'output'])."""
    seen: dict[str, int] = {}
    out = []
    for i, row in enumerate(rows):
        name, nb, ms, fl = row[:4]
        kind = row[4] if len(row) > 4 else ""
        occ = seen.get(name, 0)
        seen[name] = occ + 1
        out.append(op_stat(i, name, occ, nb, ms, fl, kind))
    return tuple(out)


def manual_stats(
    modules: Sequence[tuple[str, str | None, tuple[int, ...], TradeOff | None]],
    fw_post_order: Sequence[str],
    bw_pre_order: Sequence[str],
    events: Sequence[MemoryEvent],
    *,
    world_size: int = 1,
    device: DeviceSpec = H100,
) -> ModelStats:
    """ModelStats written by hand: ``modules`` = (fqn, parent, act_bytes per call, tradeoff) in pre-order.

    Every other field gets a neutral value; orders not given are derived (fw_pre = first-seen pre-order,
    bw_post = reverse of fw_pre).
    """
    children: dict[str | None, list[str]] = {}
    for fqn, parent, _, _ in modules:
        children.setdefault(parent, []).append(fqn)
    mods = []
    for fqn, parent, act, tr in modules:
        calls = sum(1 for f in fw_post_order if f == fqn)
        depth = 0 if parent is None else fqn.count(".") + 1
        empty = {k: MemSnapshot() for k in ("pre_fw", "peak_fw", "post_fw", "pre_bw", "peak_bw", "post_bw")}
        mods.append(
            ModuleStats(
                fqn=fqn, module_type="Module", parent=parent, depth=depth, is_leaf=fqn not in children,
                calls=calls, param_bytes=0, buffer_bytes=0, grad_bytes=0, optimizer_bytes=0,
                input_bytes=0, output_bytes=0, act_bytes=tuple(act), act_grad_bytes=tuple(0 for _ in act),
                fw_transient_bytes=tuple(0 for _ in act), fw_ms=tuple(1.0 for _ in act),
                bw_ms=tuple(2.0 for _ in act), fw_flops=tuple(0 for _ in act), bw_flops=tuple(0 for _ in act),
                snapshots=tuple(empty for _ in act), tradeoff=tr,
            )
        )
    pre = [m[0] for m in modules]
    peak = max(events, key=lambda e: e.peak_bytes)
    return ModelStats(
        device=device, model_name="manual", dtype="torch.float32", world_size=world_size,
        modules=tuple(mods), fw_pre_order=tuple(pre), fw_post_order=tuple(fw_post_order),
        bw_pre_order=tuple(bw_pre_order), bw_post_order=tuple(reversed(pre)), events=tuple(events),
        peak_bytes=peak.peak_bytes, peak_phase=peak.phase, peak_module=peak.module,
        peak_snapshot=MemSnapshot(activation=peak.peak_bytes), param_bytes=0, grad_bytes=0, optimizer_bytes=0,
        fw_ms=3.0, bw_ms=6.0, optimizer_ms=0.0, fw_flops=0, bw_flops=0, fingerprint="manual",
    )
