"""``sacplan plan MODEL --pp N``: one plan per pipeline stage (the CLI's pipeline path; :mod:`sacplan.cli` hands
over here when ``--pp`` is given).

The preset is split into stages (:mod:`sacplan.pipeline.presets`), every rank collected over the schedule's step
(:func:`~sacplan.pipeline.collect_pipeline`), each rank's stats composed with the other parallel dimensions
(:func:`per_rank_stats`: ``--world-size``'s simulated FSDP2/DDP sharding) or collected on the composed mesh
(:func:`stage_mesh`: ``--tp``/``--dp-shard`` run torchtitan's layout on every stage, :mod:`sacplan.pipeline.mesh`),
planned (:func:`~sacplan.pipeline.solve_pipeline`) and printed stage by stage; ``-o`` writes the one pipeline plan
file.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sacplan.cli_mesh import layout_views_ok, mesh_requested, mp_policy_of, shard_for_world_size
from sacplan.errors import ConfigError

__all__ = ["add_pipeline_args", "per_rank_stats", "plan_pipeline", "stage_mesh"]


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """``--pp``, ``--microbatches``, ``--schedule``, ``--stages-per-rank`` on the ``plan`` command."""
    g = p.add_argument_group("pipeline parallelism (Llama presets)")
    g.add_argument("--pp", type=int, default=None, metavar="N", help="pipeline ranks: print one plan per stage")
    g.add_argument("--microbatches", type=int, default=None, metavar="M", help="microbatches per step (default 2 x --pp)")
    g.add_argument("--schedule", default="1f1b", help="1f1b (default), gpipe or interleaved1f1b")
    g.add_argument("--stages-per-rank", type=int, default=2, metavar="V",
                   help="stages each rank holds under interleaved1f1b (default 2)")


def per_rank_stats(stats: list[Any], args: argparse.Namespace) -> list[Any]:
    """Each pipeline rank's stats composed with the other parallel dimensions of ``args`` (``--world-size``: FSDP2
    or DDP over that many data-parallel ranks, with ``--mixed-precision``'s policy as for one stage,
    :func:`sacplan.cli_mesh.shard_for_world_size`)."""
    return [shard_for_world_size(s, args) for s in stats]


def stage_mesh(args: argparse.Namespace) -> dict[str, Any]:
    """``collect_pipeline``'s ``mesh``/``parallelize`` for ``--tp``/``--dp-shard`` (torchtitan's layout per stage,
    blocks not resharded after forward as torchtitan does under pipeline parallelism; ``--mixed-precision``'s
    policy), or ``{}`` without them."""
    if not mesh_requested(args):
        return {}
    import functools

    from sacplan.models.llama_parallel import parallelize_llama

    return {"mesh": {"dp_shard": args.dp_shard or 1, "tp": args.tp or 1},
            "parallelize": functools.partial(parallelize_llama, mp_policy=mp_policy_of(args), reshard_after_forward=False)}


def plan_pipeline(args: argparse.Namespace, spec: Any, device: Any, budget: Any, knobs: dict[str, Any]) -> int:
    """Collect, plan and print every stage (see module docstring); returns the exit code."""
    from sacplan.collector import parse_dtype
    from sacplan.pipeline.collect import collect_pipeline
    from sacplan.pipeline.plans import solve_pipeline
    from sacplan.pipeline.presets import preset_pipeline
    from sacplan.pipeline.schedule import MULTI_STAGE, schedule_key

    pp = int(args.pp)
    if pp < 1:
        raise ConfigError(f"--pp must be at least 1, got {pp}")
    if spec.preset is None:
        raise ConfigError("--pp builds pipeline stages for the built-in Llama presets; for your own model call "
                          "sacplan.collect_pipeline(stage_fns, inputs, ...) from Python")
    key = schedule_key(args.schedule)
    per_rank = int(args.stages_per_rank) if key in MULTI_STAGE else 1
    mb = int(args.microbatches) if args.microbatches is not None else 2 * pp
    if mb < 1:
        raise ConfigError(f"--microbatches must be at least 1, got {mb}")
    batch = args.batch if args.batch is not None else mb  # one sequence per microbatch unless --batch says
    if batch % mb:
        raise ConfigError(f"--batch {batch} does not split into {mb} microbatches; give a multiple of --microbatches")
    say = None if args.quiet else (lambda s: print(f"sacplan: {s}", file=sys.stderr, flush=True))
    dtype = parse_dtype(knobs["dtype"])
    composed = stage_mesh(args)
    tp = composed.get("mesh", {}).get("tp", 1)
    if knobs["seq"] is not None and knobs["seq"] % tp:
        raise ConfigError(f"--seq {knobs['seq']} does not split into {tp} sequence shards (the TP layout's sequence "
                          f"parallelism hands each stage a shard): give a multiple of --tp {tp}")
    # The stages are built in --dtype (the rotary table stays fp32, as the whole preset keeps it), or as fp32
    # masters under the mesh's mixed-precision policy; collect_pipeline is given no dtype, which would cast them
    # whole (the rotary table too).
    stage_dtype = None if composed and mp_policy_of(args) is not None else dtype
    fns, tokens, loss = preset_pipeline(spec.preset, pp * per_rank, batch=batch, seq=knobs["seq"], dtype=stage_dtype,
                                        overrides=spec.overrides)
    with layout_views_ok():
        stats = collect_pipeline(fns, tokens, schedule=key, microbatches=mb, num_ranks=pp, loss_fn=loss,
                                 target=tokens, device=device, model_name=spec.label, progress=say, **composed)
    stats = per_rank_stats(stats, args)
    if say:
        say("solving every rank")
    limit = {} if args.time_limit is None else {"time_limit_s": args.time_limit}
    plan = solve_pipeline(stats, budget, solver=args.solver, **limit)
    if args.output:
        plan.save(args.output)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        print(f"batch {batch} ({mb} microbatches of {batch // mb}), seq {knobs['seq']}, dtype {knobs['dtype']}")
        if composed:
            dims = stats[0].meta["distributed"]["mesh"]
            print(f"mesh {' x '.join(f'{k} {v}' for k, v in dims.items())}: each stage planned as its rank at "
                  "coordinate 0 of the other dimensions (the largest shards), observed on PyTorch's fake process group")
        print(plan.summary())
        if args.output:
            print(f"\npipeline plan written to {args.output}")
    return 0
