"""``--tp``, ``--dp-shard`` and ``--mixed-precision`` of ``sacplan plan`` / ``sweep``.

* ``--tp T --dp-shard D`` (Llama presets): one rank's step of torchtitan's 2-D layout
  (:func:`sacplan.models.llama_parallel.parallelize_llama`) on PyTorch's fake process group, ``T x D`` ranks
  (:func:`sacplan.collector.collect` with ``mesh=``). ``--batch`` is the per-rank batch.
* ``--mixed-precision bf16``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with fp32
  master parameters (torchtitan's default). With ``--tp/--dp-shard`` the policy is in the parallelize function;
  with ``--world-size`` the simulated path (:func:`sacplan.distributed.shard_stats`) uses it.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from typing import Any, Iterator

from sacplan.cli_models import UsageError

__all__ = ["add_mesh_args", "check_mesh_args", "mesh_requested", "collect_on_mesh", "layout_views_ok", "mp_policy_of"]

_MIXED = ("bf16", "fp16")


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """The three flags, on a ``plan``/``sweep`` parser."""
    p.add_argument("--tp", type=int, default=None, metavar="T",
                   help="tensor (+sequence) parallel degree: torchtitan's TP plan for the Llama presets, planned per rank")
    p.add_argument("--dp-shard", type=int, default=None, metavar="D",
                   help="FSDP2 degree on the 2-D mesh with --tp (each block, [norm, output], root), observed on the fake process group")
    p.add_argument("--mixed-precision", choices=_MIXED, default=None,
                   help="FSDP2 MixedPrecisionPolicy: compute in this dtype, fp32 master params and reduce (torchtitan's default)")


def mesh_requested(args: argparse.Namespace) -> bool:
    return getattr(args, "tp", None) is not None or getattr(args, "dp_shard", None) is not None


def check_mesh_args(args: argparse.Namespace, spec: Any) -> None:
    """Refuse combinations that cannot mean anything, before collecting.

    Raises:
        UsageError: a degree below 1; ``--tp/--dp-shard`` with ``--world-size``, ``--ddp``, ``--fsdp-units``,
            ``--dtype`` or a model that is not a Llama preset; ``--mixed-precision`` with ``--dtype``.
    """
    for flag, v in (("--tp", getattr(args, "tp", None)), ("--dp-shard", getattr(args, "dp_shard", None))):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be at least 1, got {v}")
    mixed = getattr(args, "mixed_precision", None)
    if mixed is not None and args.dtype is not None:
        raise UsageError("--mixed-precision sets the compute dtype (fp32 master params); drop --dtype")
    if not mesh_requested(args):
        if mixed is not None and (args.world_size is None or args.world_size < 2 or getattr(args, "ddp", False)):
            raise UsageError("--mixed-precision is FSDP2's policy: give --dp-shard (and --tp), or --world-size N for the simulated FSDP2")
        return
    clash = [f for f, v in (("--world-size", args.world_size), ("--ddp", getattr(args, "ddp", False)),
                            ("--fsdp-units", getattr(args, "fsdp_units", None))) if v]
    if clash:
        raise UsageError(f"--tp/--dp-shard run the 2-D layout itself; drop {', '.join(clash)}")
    from sacplan.models.llama import LlamaConfig

    if spec.preset is None or not isinstance(spec.preset.config, LlamaConfig):
        raise UsageError(
            "--tp/--dp-shard have a built-in layout for the Llama presets only; for your own model call "
            "sacplan.collect(..., mesh={'dp_shard': D, 'tp': T}, parallelize=your_fn) from Python"
        )


def mp_policy_of(args: argparse.Namespace) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``--mixed-precision`` (None without it)."""
    mixed = getattr(args, "mixed_precision", None)
    if mixed is None:
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dt = torch.bfloat16 if mixed == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)


def shard_for_world_size(stats: Any, args: argparse.Namespace) -> Any:
    """``stats`` per data-parallel rank for ``--world-size`` (FSDP2 over ``--fsdp-units``, default each block, or
    ``--ddp``; ``--mixed-precision``'s policy), :func:`sacplan.distributed.shard_stats`; as they are without it."""
    ws = getattr(args, "world_size", None)
    if ws is None or ws <= 1:
        return stats
    from sacplan.distributed import shard_stats

    units: Any = "each block"
    if getattr(args, "fsdp_units", None):
        units = [u.strip() for u in args.fsdp_units.split(",") if u.strip()]
    return shard_stats(stats, ws, fsdp_units=units, mode="ddp" if getattr(args, "ddp", False) else "fsdp",
                       mp_policy=mp_policy_of(args))


def collect_on_mesh(args: argparse.Namespace, spec: Any, device: Any, knobs: dict[str, Any], progress: Any) -> Any:
    """Per-rank stats of the preset on a ``{"dp_shard": D, "tp": T}`` fake mesh (rank 0: the largest shards)."""
    from sacplan.collector import parse_dtype

    p, overrides = spec.preset, dict(spec.overrides or {})
    policy = mp_policy_of(args)
    # mixed precision: fp32 masters, FSDP2 casts; otherwise the model in --dtype (bf16 by default)
    dtype = None if policy is not None else parse_dtype(knobs["dtype"])
    mesh = {"dp_shard": args.dp_shard or 1, "tp": args.tp or 1}
    with layout_views_ok():
        return _collect_preset(p, overrides, dtype, policy, mesh, device, knobs, spec.label, progress)


@contextlib.contextmanager
def layout_views_ok() -> Iterator[None]:
    """Silence FSDP2's warning that a wrapped module returned a view: torchtitan's layout hands on outputs
    through ``to_local()`` (views), and nothing writes to them in place."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        yield


def _collect_preset(p: Any, overrides: dict, dtype: Any, policy: Any, mesh: dict, device: Any, knobs: dict,
                    label: str, progress: Any) -> Any:
    from sacplan.collector import collect
    from sacplan.models.llama_parallel import parallelize_llama

    return collect(
        lambda: p.build(dtype=dtype, **overrides),
        lambda: p.example_inputs(knobs["batch"], knobs["seq"]),
        device=device,
        loss_fn=p.loss_fn,
        model_name=label,
        progress=progress,
        mesh=mesh,
        parallelize=lambda model, dm: parallelize_llama(model, dm, mp_policy=policy),
    )
