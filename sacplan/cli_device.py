"""``--device`` for the command line: a known target GPU's name, or a JSON file describing another one.

Used by :mod:`sacplan.cli`; :func:`target_device` resolves the argument before any slow work, with errors that
name what to type (``--device h100-sxm``, ``--device FILE.json``), and :func:`devices_table` is what
``sacplan devices`` prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sacplan.cli_models import UsageError
from sacplan.errors import ConfigError
from sacplan.units import GiB

__all__ = ["DEVICE_JSON_EXAMPLE", "devices_table", "target_device"]


#: A custom target for ``--device FILE.json``: the fields of :class:`sacplan.devices.DeviceSpec`.
DEVICE_JSON_EXAMPLE = '{"name": "MyGPU", "memory_bytes": 103079215104, "peak_flops": {"bf16": 1.2e15}, "hbm_bandwidth": 4.0e12}'


def target_device(name: str) -> Any:
    """``--device``: a known GPU's name or a JSON file of :class:`~sacplan.devices.DeviceSpec` fields.

    Raises:
        UsageError: unknown name (with the close names, written as ``--device`` values), unreadable file.
    """
    from sacplan.devices import DeviceSpec, ambiguous_devices, close_devices, get_device

    if name.lower().endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"--device {name}: no such file; it should hold one JSON object such as {DEVICE_JSON_EXAMPLE}")
        try:
            d = json.loads(path.read_text())
            if not isinstance(d, dict):
                raise ValueError(f"expected a JSON object, got {type(d).__name__}")
            return DeviceSpec.from_dict(d)  # a GPU: its cuBLAS workspaces by default (DeviceSpec)
        except (ValueError, TypeError, ConfigError) as e:
            why = " ".join(str(e).split())
            raise UsageError(f"--device {name}: {why}; write one JSON object such as {DEVICE_JSON_EXAMPLE}") from e
    if ambiguous_devices(name):
        return get_device(name)  # raises, naming the --device values to choose from
    try:
        return get_device(name)
    except ConfigError as e:
        close = close_devices(name)
        hint = f"did you mean {' or '.join(f'--device {c.lower()}' for c in close)}? " if close else ""
        raise UsageError(
            f"unknown device {name!r}: {hint}`sacplan devices` lists the known GPUs; for another accelerator, "
            f"write its figures to a JSON file and pass --device FILE.json, e.g. {DEVICE_JSON_EXAMPLE}"
        ) from e


def devices_table() -> str:
    """The table ``sacplan devices`` prints: name, memory GiB, peak TFLOP/s, HBM GB/s, allocator rounding."""
    from sacplan.devices import list_devices

    rows = [("device", "memory GiB", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "alloc round B")]
    for d in list_devices():
        bf16 = d.peak_flops.get("bf16")
        fp32 = d.peak_flops.get("fp32")
        rows.append((
            d.name,
            f"{d.memory_bytes / GiB:.1f}",
            "-" if bf16 is None else f"{bf16 / 1e12:.1f}",
            "-" if fp32 is None else f"{fp32 / 1e12:.1f}",
            f"{d.hbm_bandwidth / 1e9:.0f}",
            str(d.alloc_round_bytes),
        ))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)
