"""The module tree the solver reads: nodes in forward pre-order with their stats and the step orders.

``ModuleTree`` is built from :class:`~sacplan.stats.ModelStats` and adds structure (parent/children
indices, depth, leaf flags, subtree ranges) without changing any number. It round-trips through JSON
(``to_dict``/``from_dict``) and converts to PyTorch's reference ``ModuleInfo`` dict
(``torch.distributed._tools.ilp_utils``) so the reference solver can run on the same numbers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from sacplan.errors import ConfigError
from sacplan.stats import ModelStats, ModuleStats

TREE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Node:
    """One module in the tree.

    Attributes:
        index: position in forward pre-order (root = 0).
        fqn: fully qualified name (root = ``""``).
        parent: index of the parent node, ``None`` for the root.
        children: indices of the child nodes, in forward order.
        depth: 0 for the root.
        is_leaf: the module has no child modules that ran.
        subtree_end: nodes ``index .. subtree_end - 1`` form this node's subtree.
        stats: the module's :class:`ModuleStats`.
    """

    index: int
    fqn: str
    parent: int | None
    children: tuple[int, ...]
    depth: int
    is_leaf: bool
    subtree_end: int
    stats: ModuleStats

    def is_ancestor_of(self, other: "Node") -> bool:
        """True if ``other`` lies strictly inside this node's subtree."""
        return self.index < other.index < self.subtree_end


class ModuleTree:
    """Module hierarchy of a collected step with per-module stats.

    Args:
        stats: the collected :class:`ModelStats` (modules must be in forward pre-order).
    """

    def __init__(self, stats: ModelStats) -> None:
        if not isinstance(stats, ModelStats):
            raise ConfigError(
                f"ModuleTree needs the ModelStats that sacplan.collect() returns, got {type(stats).__name__}"
            )
        self.stats = stats
        mods = stats.modules
        if not mods:
            raise ConfigError("ModelStats has no modules: collect a model with at least one module")
        index = {m.fqn: i for i, m in enumerate(mods)}
        if len(index) != len(mods):
            raise ConfigError("ModelStats lists a module twice")
        children: list[list[int]] = [[] for _ in mods]
        parents: list[int | None] = []
        for i, m in enumerate(mods):
            if m.parent is None:
                if i != 0:
                    raise ConfigError(f"module {m.fqn!r} has no parent but is not the first (root) module")
                parents.append(None)
                continue
            if m.parent not in index:
                raise ConfigError(f"module {m.fqn!r} names parent {m.parent!r}, which is not in the stats")
            p = index[m.parent]
            if p >= i:
                raise ConfigError(f"module {m.fqn!r} comes before its parent: modules must be in forward pre-order")
            parents.append(p)
            children[p].append(i)
        # Subtree ranges (pre-order => contiguous); computed right to left.
        end = list(range(1, len(mods) + 1))
        for i in range(len(mods) - 1, -1, -1):
            for c in children[i]:
                end[i] = max(end[i], end[c])
        self.nodes: tuple[Node, ...] = tuple(
            Node(
                index=i,
                fqn=m.fqn,
                parent=parents[i],
                children=tuple(children[i]),
                depth=m.depth,
                is_leaf=not children[i],
                subtree_end=end[i],
                stats=m,
            )
            for i, m in enumerate(mods)
        )
        self._index = index

    # -- access ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._index

    @property
    def root(self) -> Node:
        return self.nodes[0]

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(n.fqn for n in self.nodes)

    def node(self, fqn: str) -> Node:
        """The node named ``fqn``; a :class:`ConfigError` naming close matches when absent."""
        try:
            return self.nodes[self._index[fqn]]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(fqn, list(self._index), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise ConfigError(f"no module named {fqn!r} in this model{hint}") from None

    def index_of(self, fqn: str) -> int:
        return self.node(fqn).index

    def ancestors(self, fqn: str) -> list[Node]:
        """Ancestors of ``fqn``, nearest first (the node itself excluded)."""
        out = []
        n = self.node(fqn)
        while n.parent is not None:
            n = self.nodes[n.parent]
            out.append(n)
        return out

    def descendants(self, fqn: str) -> list[Node]:
        n = self.node(fqn)
        return list(self.nodes[n.index + 1 : n.subtree_end])

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.is_leaf]

    # -- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"schema": "sacplan.tree", "version": TREE_SCHEMA_VERSION, "stats": self.stats.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModuleTree":
        if d.get("schema") != "sacplan.tree":
            raise ConfigError("not a sacplan module tree (missing schema 'sacplan.tree')")
        if int(d.get("version", -1)) > TREE_SCHEMA_VERSION:
            raise ConfigError(
                f"module tree version {d.get('version')} is newer than this sacplan supports "
                f"({TREE_SCHEMA_VERSION}); upgrade sacplan"
            )
        return cls(ModelStats.from_dict(d["stats"]))

    # -- PyTorch reference adapter -----------------------------------------------------------------
    def to_torch_module_info(self) -> dict[str, Any]:
        """PyTorch's ``ModuleInfo`` dict (``torch.distributed._tools.ilp_utils``) for these numbers.

        Each field means what ``ilp_utils.aggregate_stats`` makes of PyTorch's ``MemTracker`` entered around
        the step (as PyTorch's own ILP test does: model, optimizer and input made before it). sacplan's
        ``activation`` category is MemTracker's ``ACT`` (bytes the forward allocates, the model output and the
        loss included; the example inputs, which MemTracker never sees, excluded) and ``temp`` is its ``TEMP``
        (bytes the backward allocates), so with the first call's snapshots (sizes in bytes, times in ms):
        ``param_per_module = grad_per_module`` = subtree parameter bytes; ``grad_total`` = ``grad`` at the
        backward start; ``act_fw_per_module`` = activation bytes full checkpointing frees (MemTracker's
        post-forward minus pre-forward ``ACT`` minus the output); ``act_bw_per_module`` = ``activation`` at the
        backward peak; ``act_grad_per_module`` = ``temp`` at the backward peak minus at the backward start;
        ``act_total`` = ``activation`` after the forward; ``input_per_module`` = input bytes the step allocated
        (``input_bytes - input_external_bytes``: MemTracker counts only storages it tracks, so the example
        inputs count 0); ``output_per_module`` = output bytes. Two MemTracker quirks are not copied: it counts
        a storage once per tensor viewing it, and sees positional inputs only; sacplan counts each storage
        once and keyword inputs too. ``sac_memory = act_fw_per_module`` (so the reference's ``ACM == IA``) and
        ``sac_runtime`` = full recompute ms, with sacplan's trade-off lines as slopes/intercepts (same (r, q)
        units as the reference's pwlf fit).
        """
        mod_stats: list[dict[str, Any]] = []
        for n in self.nodes:
            s = n.stats
            snap = s.snapshots[0] if s.snapshots else {}
            pre_bw = snap.get("pre_bw")
            peak_bw = snap.get("peak_bw")
            post_fw = snap.get("post_fw")
            t = s.tradeoff
            is_leaf = n.is_leaf or t is None
            act_fw = s.act_bytes[0] if s.act_bytes else 0
            bps = [p[0] for p in t.points] if t is not None else []
            mod_stats.append(
                {
                    "fqn": n.fqn,
                    "param_per_module": s.param_bytes,
                    "grad_per_module": s.param_bytes,
                    "grad_total": pre_bw.grad if pre_bw else 0,
                    "act_fw_per_module": act_fw,
                    "act_bw_per_module": max(0, peak_bw.activation) if peak_bw else 0,
                    "act_grad_per_module": (peak_bw.temp - pre_bw.temp) if peak_bw and pre_bw else 0,
                    "act_total": post_fw.activation if post_fw else 0,
                    "input_per_module": s.input_bytes - s.input_external_bytes,
                    "output_per_module": s.output_bytes,
                    "fw_runtime_per_module": sum(s.fw_ms),
                    "bw_runtime_per_module": sum(s.bw_ms),
                    "is_leaf": is_leaf,
                    "sac_runtime": 0 if is_leaf else t.full_recompute_ms,
                    "sac_memory": 0 if is_leaf else act_fw,
                    "n_segments": 0 if is_leaf else len(t.slopes),
                    "slopes": [] if is_leaf else list(t.slopes),
                    "intercepts": [] if is_leaf else list(t.intercepts),
                    "breakpoints": [] if is_leaf else bps,
                    "tradeoff_curve": OrderedDict() if is_leaf else OrderedDict((p[0], p[1]) for p in t.points),
                }
            )
        first_seen = lambda order: list(dict.fromkeys(order))  # noqa: E731 - keep first call only
        # PyTorch's ModTracker names the root module by its class name; keep sacplan fqns but make the root
        # non-empty so the reference's prefix tests (``name + '.' in other``) work.
        root_alias = self.stats.modules[0].module_type or "Model"

        def alias(fqn: str) -> str:
            return root_alias if fqn == "" else f"{root_alias}.{fqn}"

        for m in mod_stats:
            m["fqn"] = alias(m["fqn"])
        return {
            "mod_order": {
                "fw_pre_order": [alias(f) for f in first_seen(self.stats.fw_pre_order)],
                "bw_pre_order": [alias(f) for f in first_seen(self.stats.bw_pre_order)],
                "fw_post_order": [alias(f) for f in first_seen(self.stats.fw_post_order)],
                "bw_post_order": [alias(f) for f in first_seen(self.stats.bw_post_order)],
            },
            "mod_stats": mod_stats,
        }

    @staticmethod
    def torch_fqn_to_sacplan(torch_fqn: str) -> str:
        """Map an fqn from :meth:`to_torch_module_info` back to sacplan's (root alias stripped)."""
        head, _, rest = torch_fqn.partition(".")
        return rest


def as_tree(obj: Any) -> ModuleTree:
    """``obj`` as a :class:`ModuleTree`: a tree is itself, the :class:`ModelStats` that ``collect`` returns is
    wrapped; anything else is a :class:`~sacplan.errors.ConfigError` saying what to pass."""
    if isinstance(obj, ModuleTree):
        return obj
    if isinstance(obj, ModelStats):
        return ModuleTree(obj)
    raise ConfigError(
        f"expected the collected step: a sacplan.ModuleTree or the ModelStats sacplan.collect() returns, got "
        f"{type(obj).__name__}; e.g. tree = sacplan.ModuleTree(sacplan.collect(model, inputs, device='h100'))"
    )
