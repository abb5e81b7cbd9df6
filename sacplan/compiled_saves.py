"""What a compiled, planned region saves beyond the eager step: the selective-checkpoint policy under Inductor.

The bound :func:`sacplan.validation.validate` keeps for a planned compiled step whose regions cannot be compiled
on fake tensors (:mod:`sacplan.compiled_partition` predicts the others exactly).

Under ``torch.compile`` the plan's policy is applied to the traced graph, where each op is already decomposed
into the primitives Inductor compiles: every node of a saved op's decomposition is tagged "must save", and the
partitioner saves those the backward reads. For ``native_layer_norm`` the backward reads the normalized input
``(x - mean) * rstd`` (input-sized) and ``rstd / D``, so a saved layer norm keeps its output *and* the
normalized input, where the eager step keeps the output with ``mean`` and ``rstd`` (measured on 4 compiled
LayerNorm-Linear-GELU-Linear blocks, forward graphs of ``TORCH_LOGS=aot_graphs``: ``benchmarks/RESULTS.md``).
The partitioner then drops the region's input where nothing else reads it (the eager checkpoint holds it): a
layer norm that is the module's first op, on an input the step made, costs nothing extra (its normalized input
replaces the input); elsewhere, and on the model's own input (kept anyway), its normalized input is counted in
full (an upper bound where the partitioner drops other inputs too).

Batch norm in training mode writes its running statistics: under compile the plan's policy saves every op that
writes a buffer (:mod:`sacplan.apply.policy`), and its backward reads its input, which the partitioner then keeps
too (measured: a fully checkpointed compiled conv block keeps its convolution outputs). Both are always saved:
the batch norm and the op before it that allocated its input.

Layout copies (:mod:`sacplan.compiled_layout`): the channels-last weight copies a replayed region makes are
saved by the compiled graph even when the region is checkpointed (its recomputation reads them): always saved.

Other ops are counted as in the eager step: measured only for layer norm (fused RMS norm, softmax and the
attention kernels are not measured under compile).

A checkpointed module *enclosing* compiled regions (a plan's selective region around compiled blocks): the
compiled regions' saves (AOTAutograd's ``ctx.save_for_backward``) are packed by the enclosing checkpoint's
saved-tensor hooks, so its forward discards them as the eager step's would, and its backward recomputes them by
running the compiled forward again, whose buffers are Inductor's, not the eager step's. Measured (fuzz seed 13,
two compiled BatchNorm1d blocks in a checkpointed container, :mod:`sacplan.compiled_partition`'s replay equal to
the real step byte for byte): the forward ends 67,584 B lower than without the plan, as eager predicts, but the
compiled forward also writes an input-sized scratch buffer besides its output, so the recomputation holds
66,048 B more than the eager recomputation and the planned step peaks there (929,840 B), 6.99% above the eager
prediction (864,816 B). The bound counts the enclosing module as discarding nothing of its compiled regions (their
ops always saved in the enclosing module's stats; what it runs outside them stays free): it predicts that step
at 929,336 B, the unplanned peak, 504 B (0.05%) under the measurement, which is the compiled recomputation's
scratch (kernel buffers of compiled regions are not modelled by this bound, with or without a plan).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from sacplan.compiled_layout import WEIGHT_COPY_OP
from sacplan.fqns import inside
from sacplan.stats import ModelStats, ModuleStats, OpStat

__all__ = ["BUFFER_WRITING_NORMS", "COMPILED_EXTRA_SAVES", "enclosed_positions", "with_compiled_saves"]

#: ops whose saving under compile also keeps a tensor the size of their output (their normalized input)
COMPILED_EXTRA_SAVES = frozenset({"aten.native_layer_norm.default"})
#: training-mode batch norms, which write their running statistics (buffers): saved under compile
BUFFER_WRITING_NORMS = frozenset({"aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
                                  "aten.cudnn_batch_norm.default", "aten.miopen_batch_norm.default"})


def _inside(fqn: str, regions: Iterable[str]) -> bool:
    return any(inside(fqn, r) for r in regions)


def _always_saved(ops: tuple[OpStat, ...], layout_replayed: bool) -> set[int]:
    """Positions of the ops a compiled region saves whatever the plan says: batch norms writing running statistics
    and the op before each that allocated its input, and (``layout_replayed``) the channels-last weight copies."""
    out: set[int] = set()
    for p, o in enumerate(ops):
        if layout_replayed and o.name == WEIGHT_COPY_OP:
            out.add(p)
        if o.name in BUFFER_WRITING_NORMS:
            out.add(p)
            q = next((q for q in range(p - 1, -1, -1) if ops[q].out_bytes > 0 and not ops[q].is_view), None)
            if q is not None:
                out.add(q)
    return out


def _ops(ops: tuple[OpStat, ...], layout_replayed: bool, external_input: bool) -> tuple[OpStat, ...]:
    forced = _always_saved(ops, layout_replayed)
    out = []
    for p, o in enumerate(ops):
        # the module's first op reading an input the step made: its normalized input replaces that input, which
        # the eager checkpoint holds and the compiled backward no longer reads
        replaces_input = p == 0 and not external_input
        if o.name in COMPILED_EXTRA_SAVES and o.save_cost_bytes > 0 and not replaces_input:
            o = dataclasses.replace(o, save_cost_bytes=o.save_cost_bytes + o.out_bytes)
        if p in forced and -1 not in o.tied_to:
            o = dataclasses.replace(o, tied_to=(*o.tied_to, -1))  # -1: always saved (sacplan.opgroups)
        out.append(o)
    return tuple(out)


def _op_key(o: OpStat) -> tuple:
    return (o.name, o.out_bytes, o.is_view, o.is_random)


def enclosed_positions(ops: tuple[OpStat, ...], enclosed: Iterable[tuple[OpStat, ...]]) -> set[int]:
    """Positions in ``ops`` (a module's forward ops) of the ops that ran inside the ``enclosed`` modules (each one's
    own op sequence), found in order: at each position, the longest enclosed sequence that starts there
    (name, output bytes, view, random), then on past it. A module's ops include those of the modules it calls, each
    call a contiguous run; an own op sequence equal to an enclosed one's is taken for it (saved: the bound only
    grows)."""
    seqs = sorted({tuple(_op_key(o) for o in e) for e in enclosed if e}, key=len, reverse=True)
    keys = [_op_key(o) for o in ops]
    out: set[int] = set()
    p = 0
    while p < len(keys):
        hit = next((len(q) for q in seqs if tuple(keys[p:p + len(q)]) == q), 0)
        out.update(range(p, p + hit))
        p += max(hit, 1)
    return out


def _always_saved_in(m: ModuleStats, positions: set[int]) -> ModuleStats:
    """``m`` with the ops at ``positions`` always saved (``tied_to`` -1), its ``act_bytes`` (what full checkpointing
    frees, bytes) less their save costs."""
    ops = tuple(dataclasses.replace(o, tied_to=(*o.tied_to, -1)) if p in positions and -1 not in o.tied_to else o
                for p, o in enumerate(m.ops))
    forced = sum(max(0, b.save_cost_bytes) for a, b in zip(m.ops, ops) if b.tied_to != a.tied_to)
    return dataclasses.replace(m, ops=ops, act_bytes=tuple(max(0, a - forced) for a in m.act_bytes))


def with_compiled_saves(stats: ModelStats, regions: Iterable[str], layout_replayed: bool = False) -> ModelStats:
    """``stats`` as a plan for the compiled step keeps them, inside the compiled regions (fqns, ``""`` for the whole
    model): each op of :data:`COMPILED_EXTRA_SAVES` costs its output twice to save (bytes); with
    ``layout_replayed`` (the stats of :func:`~sacplan.compiled_layout.replay_layout`) the channels-last weight
    copies are always saved, checkpointed or not (measured: a fully checkpointed compiled conv block keeps them),
    and so are training-mode batch norms with the op that made their input. A module enclosing compiled regions
    always saves the ops that ran inside them (module docstring): checkpointing it discards only what it runs
    outside them."""
    regions = tuple(regions)

    def module(m: ModuleStats) -> ModuleStats:
        if not _inside(m.fqn, regions):
            enclosed = [r.ops for r in stats.modules if r.fqn in regions and inside(r.fqn, m.fqn)]
            return _always_saved_in(m, enclosed_positions(m.ops, enclosed)) if enclosed else m
        ops = _ops(m.ops, layout_replayed, m.input_external_bytes > 0)
        # act_bytes is what full checkpointing frees: no longer the copies now always saved
        forced = sum(max(0, b.save_cost_bytes) for a, b in zip(m.ops, ops) if b.tied_to != a.tied_to)
        return dataclasses.replace(m, ops=ops, act_bytes=tuple(max(0, a - forced) for a in m.act_bytes))

    return dataclasses.replace(stats, modules=tuple(module(m) for m in stats.modules))
