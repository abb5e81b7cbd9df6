"""Repeated-block detection: which modules of a model are its repeated blocks (transformer layers, CNN stages'
residual blocks). One rule, used by the sweep's full-AC reference point, the hand-written baselines of
:mod:`sacplan.alternatives` and the default FSDP units of :mod:`sacplan.distributed`.
"""

from __future__ import annotations

from collections import Counter

from sacplan.fqns import inside
from sacplan.stats import ModelStats

__all__ = ["repeated_blocks"]

#: container types that hold blocks without being one (a ``Sequential`` of layers is not the repeated unit)
_CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict"})


def repeated_blocks(stats: ModelStats) -> tuple[str, ...]:
    """The model's repeated blocks, in forward (module) order; empty when there is none.

    Non-leaf modules of one type whose parents share a type and a depth (so the blocks of a ``ModuleList``,
    or of every stage of a CNN, or of both of T5's stacks), the most numerous such set (at least two). Ties go
    to a type that is not a plain container (``Sequential``/``ModuleList``/``ModuleDict``), then to the outer set
    (a block's own sub-modules repeat as often as the blocks), then to more activation bytes, then to the
    earlier module.
    Failing that, the outermost non-root modules of the most common non-leaf type (at least two).
    """
    mods = list(stats.modules)
    order = {m.fqn: i for i, m in enumerate(mods)}
    mtype = {m.fqn: m.module_type for m in mods}
    # siblings of one type, pooled across parents of one type at one depth (T5's encoder and decoder blocks,
    # a ResNet's stages' residual blocks)
    groups: dict[tuple[str, str, int], list] = {}
    for m in mods:
        if m.parent is not None and not m.is_leaf:
            groups.setdefault((mtype[m.parent], m.module_type, m.depth), []).append(m)
    best_key: tuple | None = None
    best: list = []
    for (_, kind, depth), kids in groups.items():
        if len(kids) < 2:
            continue
        key = (len(kids), kind not in _CONTAINERS, -depth, sum(sum(k.act_bytes) for k in kids), -order[kids[0].fqn])
        if best_key is None or key > best_key:
            best_key, best = key, kids
    if best:
        return tuple(k.fqn for k in best)
    types = Counter(m.module_type for m in mods if not m.is_leaf and m.parent is not None)
    if not types:
        return ()
    common, n = types.most_common(1)[0]
    if n < 2:
        return ()
    chosen = [m.fqn for m in mods if not m.is_leaf and m.parent is not None and m.module_type == common]
    outer = [f for f in chosen if not any(f != o and inside(f, o) for o in chosen)]
    return tuple(outer)
