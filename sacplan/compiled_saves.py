"""What a compiled, planned region saves beyond the eager step: the selective-checkpoint policy under Inductor.

Under ``torch.compile`` the plan's policy is applied to the traced graph, where each op is already decomposed
into the primitives Inductor compiles: every node of a saved op's decomposition is tagged "must save", and the
partitioner saves those the backward reads. For ``native_layer_norm`` the backward reads the normalized input
``(x - mean) * rstd`` (input-sized) and ``rstd / D``, so a saved layer norm keeps its output *and* the
normalized input, where the eager step keeps the output with ``mean`` and ``rstd`` (measured on 4 compiled
LayerNorm-Linear-GELU-Linear blocks, forward graphs of ``TORCH_LOGS=aot_graphs``: ``benchmarks/RESULTS.md``).
The partitioner may then drop the region's input, which the eager checkpoint holds, so counting the normalized
input in full is an upper bound: exact where the region's input is kept anyway (the model's input), one
input too many where it is dropped.

Other ops are counted as in the eager step: measured only for layer norm (fused RMS norm, softmax and the
attention kernels are not measured under compile).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from sacplan.stats import ModelStats, ModuleStats

__all__ = ["COMPILED_EXTRA_SAVES", "with_compiled_saves"]

#: ops whose saving under compile also keeps a tensor the size of their output (their normalized input)
COMPILED_EXTRA_SAVES = frozenset({"aten.native_layer_norm.default"})


def _inside(fqn: str, regions: Iterable[str]) -> bool:
    return any(r == "" or fqn == r or fqn.startswith(r + ".") for r in regions)


def _module(m: ModuleStats) -> ModuleStats:
    ops = tuple(
        dataclasses.replace(o, save_cost_bytes=o.save_cost_bytes + o.out_bytes)
        if o.name in COMPILED_EXTRA_SAVES and o.save_cost_bytes > 0 else o
        for o in m.ops
    )
    return dataclasses.replace(m, ops=ops)


def with_compiled_saves(stats: ModelStats, regions: Iterable[str]) -> ModelStats:
    """``stats`` with each op of :data:`COMPILED_EXTRA_SAVES` inside a compiled region (fqn or ``""`` for the
    whole model) costing its output twice to save (bytes): the prediction of a plan for the compiled step."""
    regions = tuple(regions)
    return dataclasses.replace(stats, modules=tuple(_module(m) if _inside(m.fqn, regions) else m for m in stats.modules))
