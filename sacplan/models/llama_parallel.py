"""torchtitan's 2-D layout for :class:`~sacplan.models.llama.Llama`: tensor / sequence parallel, then FSDP2.

:func:`parallelize_llama` is what torchtitan's ``parallelize_llama`` does for its Llama 3 (``apply_tp`` with
sequence parallelism, then ``apply_fsdp``), written for this package's module names::

    tok_embeddings   RowwiseParallel(input Replicate, output Shard(1))       vocab rows split, seq-sharded out
    layers.i
      attention_norm SequenceParallel()                                      norm on the seq shard
      attention      PrepareModuleInput((Shard(1), None) -> (Replicate(), None))   all-gather the sequence
      attention.wq/wk/wv  ColwiseParallel()                                  heads split: H/TP, KV/TP per rank
      attention.wo   RowwiseParallel(output Shard(1))                        reduce-scatter to the seq shard
      ffn_norm       SequenceParallel()
      feed_forward   PrepareModuleInput(Shard(1) -> Replicate())
      feed_forward.w1/w3  ColwiseParallel(); feed_forward.w2  RowwiseParallel(output Shard(1))
    norm             SequenceParallel()
    output           ColwiseParallel(input Shard(1), output Replicate())     full logits on every TP rank

FSDP2 (on the ``dp_shard`` dimension): every block, then ``[norm, output]`` as one group with
``reshard_after_forward=False``, then the root, each with ``mp_policy`` (torchtitan's defaults). The attention
modules' head counts are divided by the TP degree, as torchtitan's ``view(bs, seqlen, -1, head_dim)`` does.

A pipeline stage (:class:`~sacplan.pipeline.presets.LlamaStage`: blocks in a ``ModuleDict``, the embedding only
on the first stage, ``norm``/``output`` only on the last) gets the same plan for the modules it has, as
torchtitan parallelizes each stage's model chunk; under pipeline parallelism torchtitan keeps the blocks
unsharded between forward and backward (``reshard_after_forward=False``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sacplan.errors import ConfigError

__all__ = ["parallelize_llama", "llama_blocks", "llama_tp_plan"]


def llama_tp_plan(block: bool) -> dict[str, Any]:
    """torchtitan's ``parallelize_module`` plan: of one transformer block (``block=True``) or of the root's
    embedding, final norm and output projection (``block=False``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    if not block:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def llama_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Llama (``layers``: a ``ModuleList``) or of a pipeline stage (a ``ModuleDict``
    keyed by global layer index)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _dim(mesh: Any, name: str) -> Any | None:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if name not in names:
        return None
    sub = mesh[name]
    return sub if sub.size() > 1 else None


def parallelize_llama(
    model: nn.Module,
    mesh: Any,
    *,
    mp_policy: Any = None,
    tp_dim: str = "tp",
    dp_dim: str = "dp_shard",
    plan: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply torchtitan's TP plan on ``mesh[tp_dim]`` and FSDP2 on ``mesh[dp_dim]`` (either may be absent or 1).

    Args:
        model: a :class:`~sacplan.models.llama.Llama` (on ``meta`` for planning, or real).
        mesh: a ``DeviceMesh`` with named dimensions.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (None: FSDP2's default, no casting).
        tp_dim, dp_dim: the mesh dimension names.
        plan: a sacplan :class:`~sacplan.plan.Plan` to apply before parallelizing (the place of torchtitan's
            ``apply_ac``); None: no checkpointing.
        reshard_after_forward: FSDP2's choice for the blocks; torchtitan's default is True without pipeline
            parallelism and False with it (each microbatch would all-gather the blocks again).

    Returns:
        ``model`` (parallelized in place).

    Raises:
        ConfigError: the TP degree does not divide the heads, KV heads, FFN width, model dim or (on a model or
            stage holding the embedding or output layer) the vocabulary.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "layers"):
        raise ConfigError(f"parallelize_llama needs a sacplan Llama, got {type(model).__name__}")
    if plan is not None:
        from sacplan.apply import apply_plan

        apply_plan(model, plan)
    tp = _dim(mesh, tp_dim)
    blocks = llama_blocks(model)
    ends = {k: v for k, v in llama_tp_plan(block=False).items() if getattr(model, k, None) is not None}
    if tp is not None:
        n = tp.size()
        sizes = [("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("hidden_dim", cfg.ffn_hidden_dim), ("dim", cfg.dim)]
        if "tok_embeddings" in ends or "output" in ends:
            sizes.append(("vocab_size", cfg.vocab_size))
        for what, value in sizes:
            if value % n:
                raise ConfigError(f"tensor parallel degree {n} does not divide {what}={value}: pick a TP degree dividing it")
        if ends:
            parallelize_module(model, tp, ends)
        for blk in blocks:
            parallelize_module(blk, tp, llama_tp_plan(block=True))
            blk.attention.n_heads //= n
            blk.attention.n_kv_heads //= n
    dp = _dim(mesh, dp_dim)
    if dp is not None:
        kw = {"mesh": dp, "mp_policy": mp_policy or MixedPrecisionPolicy()}
        for blk in blocks:
            fully_shard(blk, reshard_after_forward=reshard_after_forward, **kw)
        if getattr(model, "output", None) is not None:
            fully_shard([model.norm, model.output], reshard_after_forward=False, **kw)
        fully_shard(model, **kw)
    return model
