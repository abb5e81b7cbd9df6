"""How ops are named and matched across hosts (a leaf module: used by evaluate, apply and plan).

An op is recognised inside one call of a module's forward by ``(family, occurrence)``: the family is the
overload name (``"aten.mm.default"``), except that every attention kernel is the family ``"<attention>"``
(CPU, flash, memory-efficient and cuDNN kernels differ by device) and every random op is ``"<random>"``
(random ops are saved or recomputed together, and devices implement dropout with different ops).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

ATTENTION = "<attention>"
RANDOM = "<random>"

_ATTENTION_NAMES = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)


def is_attention(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in _ATTENTION_NAMES)


def resolve_op(name: str) -> Any:
    """The ``torch.ops`` overload for a name like ``"aten.mm.default"`` (``None`` if unknown here)."""
    ns, _, rest = name.partition(".")
    packet_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), packet_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def is_attention_op(func: Any) -> bool:
    """:func:`is_attention` of an op overload, worked out once per overload (collection asks it for every op)."""
    return is_attention(str(func))


def is_random_op(func: Any) -> bool:
    """Random in the SAC sense: draws numbers from the RNG (attention kernels only with dropout, handled apart)."""
    if is_attention_op(func):
        return False
    return torch.Tag.nondeterministic_seeded in func.tags


def op_argument(func: Any, args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    """The argument ``name`` of an op call, passed by keyword or by position (``default`` when its schema has none
    or the call leaves it out)."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else default
    return default


def attention_dropout_p(func: Any, args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` argument of an op call (0.0 when its schema has none): an attention kernel draws random
    numbers exactly when it is above 0."""
    return float(op_argument(func, args, kwargs, "dropout_p", 0.0))


def draws_random_numbers(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``func`` draws from the RNG: a random op, or an attention kernel called with dropout."""
    if is_attention_op(func):
        return attention_dropout_p(func, args, kwargs) > 0
    return is_random_op(func)


def is_inplace_op(func: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def family(name: str, is_random: bool = False) -> str:
    """The family an op is matched by (see module docstring)."""
    if is_random:
        return RANDOM
    if is_attention(name):
        return ATTENTION
    return name


def op_keys(ops: Any) -> list[tuple[str, int]]:
    """``(family, occurrence)`` of each :class:`~sacplan.stats.OpStat` in a module call, in order."""
    seen: dict[str, int] = {}
    keys = []
    for o in ops:
        fam = family(o.name, o.is_random)
        occ = seen.get(fam, 0)
        seen[fam] = occ + 1
        keys.append((fam, occ))
    return keys


def saved_op_keys(saved_ops: Any) -> frozenset[tuple[str, int]]:
    """``(family, occurrence)`` keys of a plan decision's ``saved_ops`` entries ``(index, name, occurrence)``.

    Random ops are decided together, so any saved random op becomes the single key ``(RANDOM, 0)``.
    """
    keys = set()
    for entry in saved_ops or ():
        name, occurrence = entry[1], entry[2]
        op = resolve_op(name)
        if op is not None and is_random_op(op):
            keys.add((RANDOM, 0))
        else:
            keys.add((family(name), int(occurrence)))
    return frozenset(keys)


def dropout_is_fused(device_name: str) -> bool:
    """Whether stats/plans for ``device_name`` number dropout as one ``native_dropout`` (a CUDA target).

    Collection routes dropout to ``native_dropout`` for every target whose attention is fused (a GPU,
    see :mod:`sacplan.collector.kernels`); the CPU spec keeps the host's decomposed dropout. Unknown names
    (a custom spec) count as GPUs unless named ``"CPU"``.
    """
    from sacplan.devices import get_device
    from sacplan.errors import UnknownDeviceError

    if not device_name:
        return False
    try:
        return get_device(device_name).attention == "flash"
    except UnknownDeviceError:
        return device_name.upper() != "CPU"
