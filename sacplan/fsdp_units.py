"""FSDP2 units (``fully_shard`` targets, single modules or groups of modules) and each unit's bytes per rank.

A unit is what one ``fully_shard`` call manages: one module (``fully_shard(model.layers[0])``) or a group
(``fully_shard([model.norm, model.output])``, as torchtitan does). A unit owns the parameters in its members'
subtrees that no nested unit owns; the root ``""`` owns the rest. Group semantics (FSDP2's
``_register_group_forward_hooks``): the group all-gathers at the first member's pre-forward and reshards at
the last member's post-forward; in backward it all-gathers when the first member's backward begins and
reduce-scatters when the last member's backward ends.

Mixed precision (FSDP2 ``MixedPrecisionPolicy``): the sharded parameters, their gradients and the optimizer
state stay in the *master* dtype (the model's own, usually float32); all-gathers produce ``param_dtype``
(compute), reduce-scatters run in ``reduce_dtype``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from sacplan.blocks import repeated_blocks
from sacplan.collector.arguments import parse_dtype
from sacplan.errors import ConfigError
from sacplan.fingerprint import canonical_names, model_fingerprint
from sacplan.fqns import inside
from sacplan.stats import ModelStats, ModuleStats

__all__ = ["Unit", "UnitShard", "each_block_units", "resolve_units", "unit_table", "dtype_bytes"]

UnitSpec = str | Sequence[str | Sequence[str]] | Callable[[str, ModuleStats], bool] | None

_DTYPE_BYTES = {
    "torch.float32": 4, "torch.float": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.half": 2,
    "torch.float64": 8, "torch.double": 8, "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype`` or its name, ``"bfloat16"`` / ``"torch.bfloat16"``); 0 for None."""
    if dtype is None:
        return 0
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    key = str(dtype) if str(dtype).startswith("torch.") else "torch." + str(dtype)
    if key not in _DTYPE_BYTES:
        return torch.empty((), dtype=parse_dtype(dtype)).element_size()  # "bf16", "fp32"...; ConfigError otherwise
    return _DTYPE_BYTES[key]


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` call.

    Attributes:
        members: the module fqns it was called on (one, or a group; ``("",)`` for the root).
        reshard_after_forward: FSDP2's flag for this unit (the root never reshards after forward).
    """

    members: tuple[str, ...]
    reshard_after_forward: bool = True

    @property
    def key(self) -> str:
        """The fqn of a single-module unit, the members joined by ``+`` for a group."""
        return "+".join(self.members)

    @property
    def is_root(self) -> bool:
        return self.members == ("",)

    def contains(self, fqn: str) -> bool:
        """``fqn`` runs inside one of the members."""
        return any(inside(fqn, m) for m in self.members)

    def encloses(self, other: "Unit") -> bool:
        """Every member of ``other`` lies inside a member of this unit (and they differ)."""
        return other != self and all(self.contains(m) for m in other.members)

    def to_json(self) -> str | list[str]:
        return self.members[0] if len(self.members) == 1 else list(self.members)


def each_block_units(stats: ModelStats) -> list[str]:
    """The repeated blocks (:func:`sacplan.blocks.repeated_blocks`) plus the root ``""``."""
    return [""] + list(repeated_blocks(stats))


def _members(spec: Any) -> tuple[str, ...]:
    if isinstance(spec, str):
        return (spec,)
    try:
        members = tuple(spec)
    except TypeError:
        members = ()
    if not members or any(not isinstance(m, str) for m in members):
        raise ConfigError(
            "fsdp_units must be 'each block', a predicate, or a list whose entries are module names (str) or "
            f"groups of module names (a tuple/list of str, as fully_shard([model.norm, model.output])); got entry {spec!r}"
        )
    return members


def _raf_of(reshard_after_forward: bool | Mapping[Any, bool], members: tuple[str, ...]) -> bool:
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    for k, v in reshard_after_forward.items():
        if _members(k) == members:
            return bool(v)
    return True


def resolve_units(
    stats: ModelStats, fsdp_units: UnitSpec, reshard_after_forward: bool | Mapping[Any, bool] = True
) -> list[Unit]:
    """The units of ``fsdp_units`` in module order (first member), the root ``""`` always included.

    ``reshard_after_forward``: one flag for every non-root unit, or a mapping from unit (a fqn, or a tuple of
    fqns for a group) to its flag; units it does not name keep FSDP2's default ``True``.

    Raises:
        ConfigError: a wrong type, an unknown module (with close matches), a module in two units, a group
            whose members are nested in each other, a mapping key that names no unit.
    """
    names = [m.fqn for m in stats.modules]
    if fsdp_units is None or (isinstance(fsdp_units, str) and fsdp_units == "each block"):
        specs: list[tuple[str, ...]] = [(u,) for u in each_block_units(stats)]
    elif isinstance(fsdp_units, str):
        raise ConfigError(f"fsdp_units must be 'each block', a list of module names or a predicate, not {fsdp_units!r}")
    elif callable(fsdp_units):
        specs = [(m.fqn,) for m in stats.modules if fsdp_units(m.fqn, m)]
    else:
        try:
            specs = [_members(s) for s in fsdp_units]
        except TypeError:
            raise ConfigError(f"fsdp_units must be 'each block', a list of module names or a predicate, not {fsdp_units!r}")
    known = set(names)
    seen: dict[str, tuple[str, ...]] = {}
    for members in specs:
        for u in members:
            if u not in known:
                close = difflib.get_close_matches(u, names, n=3)
                raise ConfigError(f"FSDP unit {u!r} is not a module of this model" + (f"; did you mean {close}?" if close else ""))
            if u in seen and seen[u] != members:
                raise ConfigError(f"module {u!r} is in two FSDP units ({seen[u]} and {members}): fully_shard each module once")
            seen[u] = members
        for a in members:
            for b in members:
                if a != b and inside(b, a):
                    raise ConfigError(f"FSDP group {members}: {b!r} lies inside {a!r}; a group's members must be disjoint")
    if ("",) not in specs:
        specs = [("",)] + specs  # fully_shard(root) always comes last and owns the rest
    if isinstance(reshard_after_forward, Mapping):
        for k in reshard_after_forward:
            if _members(k) not in specs:
                raise ConfigError(f"reshard_after_forward names {k!r}, which is not one of the FSDP units {[list(s) for s in specs]}")
    order = {f: i for i, f in enumerate(names)}
    uniq = sorted(set(specs), key=lambda s: min(order[m] for m in s))
    return [Unit(s, True if s == ("",) else _raf_of(reshard_after_forward, s)) for s in uniq]


# ---------------------------------------------------------------------------------------------- bytes
@dataclass(frozen=True)
class UnitShard:
    """One FSDP unit's bytes per rank.

    Attributes:
        fqn: the unit's key (root ``""``, a group's members joined by ``+``).
        param_bytes, grad_bytes, optimizer_bytes: unsharded bytes the unit manages, as collected.
        sharded_param_bytes, sharded_grad_bytes, sharded_optimizer_bytes: one rank's shard (the largest, padded)
            in the master dtype.
        unsharded_bytes: all-gathered parameters in ``param_dtype`` (what compute uses).
        allgather_buffer_bytes: the flat all-gather output (``N ×`` padded shard, ``param_dtype``).
        reduce_scatter_bytes: the flat reduce-scatter input (``N ×`` padded shard, ``reduce_dtype``).
    """

    fqn: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    sharded_param_bytes: int
    sharded_grad_bytes: int
    sharded_optimizer_bytes: int
    unsharded_bytes: int
    allgather_buffer_bytes: int
    reduce_scatter_bytes: int


def check_model(stats: ModelStats, model: nn.Module) -> None:
    """Raise :class:`ConfigError` unless ``model`` is the model ``stats`` were collected from (fingerprint).

    The fingerprint ignores dtypes, so an fp32 model matches stats collected in bf16.
    """
    if stats.fingerprint and model_fingerprint(model) != stats.fingerprint:  # looks through FSDP2 / DDP / compile
        theirs = set(canonical_names(model).values())
        ours = {m.fqn for m in stats.modules}
        containers = {n for n in theirs if any(o != n and inside(o, n) for o in ours) and n not in ours}
        diff = sorted((ours ^ theirs) - containers - {""})[:3]
        raise ConfigError(
            "model is not the model these stats were collected from (module names or parameter shapes differ"
            + (f", e.g. {diff}" if diff else "")
            + "): pass the same architecture (a meta-device copy is fine) or model=None"
        )


def _owner_of(units: list[Unit]) -> Callable[[str], Unit]:
    """The unit owning a parameter of module ``fqn``: the deepest unit containing it."""
    depth = {u: max(m.count(".") + (1 if m else 0) for m in u.members) for u in units}
    ordered = sorted(units, key=lambda u: depth[u], reverse=True)

    def owner(fqn: str) -> Unit:
        return next(u for u in ordered if u.contains(fqn))

    return owner


def unit_params(model: nn.Module, units: list[Unit]) -> dict[Unit, list[tuple[tuple[int, ...], int]]]:
    """Per unit, ``(shape, bytes per element)`` of the parameters it owns (shared parameters counted once)."""
    mods = dict(model.named_modules())
    for u in units:
        for m in u.members:
            if m not in mods:
                close = difflib.get_close_matches(m, list(mods), n=3)
                raise ConfigError(f"FSDP unit {m!r} is not a module of the model" + (f"; did you mean {close}?" if close else ""))
    owner = _owner_of(units)
    out: dict[Unit, list[Any]] = {u: [] for u in units}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[owner(name.rpartition(".")[0])].append((tuple(p.shape), p.element_size()))
    return out


def _own_bytes(stats: ModelStats, units: list[Unit]) -> dict[Unit, list[int]]:
    """Collected [param, grad, optimizer] bytes per unit: its members' subtrees minus nested units'."""
    by = {m.fqn: m for m in stats.modules}
    total = {u: [sum(getattr(by[m], k) for m in u.members) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")] for u in units}
    own = {u: list(v) for u, v in total.items()}
    for u in units:
        parent = min((v for v in units if v.encloses(u)), key=lambda v: -max(len(m) for m in v.members), default=None)
        if parent is not None:
            for i in range(3):
                own[parent][i] -= total[u][i]
    return own


def unit_table(
    stats: ModelStats, units: list[Unit], world_size: int, model: nn.Module | None,
    param_dtype: Any, reduce_dtype: Any, master_dtype: Any,
) -> tuple[dict[Unit, UnitShard], bool]:
    """Each unit's :class:`UnitShard` and whether shapes were approximated (no ``model``).

    Sharded state is in ``master_dtype``; collected bytes (in ``stats.dtype``) are scaled by the ratio of
    element sizes. With ``model`` every parameter's dim 0 is padded to a multiple of ``world_size``.
    """
    N, spec = world_size, stats.device
    own = _own_bytes(stats, units)
    stat_elt = dtype_bytes(stats.dtype)
    p_elt = dtype_bytes(param_dtype) or stat_elt
    r_elt = dtype_bytes(reduce_dtype) or p_elt
    m_ratio = (dtype_bytes(master_dtype) or stat_elt) / stat_elt
    shapes = unit_params(model, units) if model is not None else None
    out: dict[Unit, UnitShard] = {}
    for u in units:
        pb, gb, ob = (max(0, x) for x in own[u])
        if shapes is not None:
            plist = shapes[u]
            numel_full = sum(math.prod(s) for s, _ in plist)
            numel_shard = sum((math.ceil(s[0] / N) * math.prod(s[1:]) if s else 1) for s, _ in plist)
            ratio = numel_shard / numel_full if numel_full else 0.0
        else:
            numel_full = pb // max(1, stat_elt)
            numel_shard = math.ceil(numel_full / N)
            ratio = math.ceil(pb / N) / pb if pb else 0.0
        numel_pad = numel_shard * N
        out[u] = UnitShard(
            fqn=u.key,
            param_bytes=pb,
            grad_bytes=gb,
            optimizer_bytes=ob,
            sharded_param_bytes=spec.round_alloc(math.ceil(pb * ratio * m_ratio)) if pb else 0,
            sharded_grad_bytes=spec.round_alloc(math.ceil(gb * ratio * m_ratio)) if gb else 0,
            sharded_optimizer_bytes=math.ceil(ob * ratio * m_ratio),
            unsharded_bytes=numel_full * p_elt,
            allgather_buffer_bytes=spec.round_alloc(numel_pad * p_elt) if numel_pad else 0,
            reduce_scatter_bytes=spec.round_alloc(numel_pad * r_elt) if gb else 0,
        )
    return out, shapes is None
