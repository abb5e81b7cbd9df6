"""A synthetic Llama-7B-shaped :class:`~sacplan.tree.ModuleTree` (sizes derived by hand in :func:`llama_spec`).

Used by the solver tests and ``benchmarks/solver_scaling.py``; built with :mod:`sacplan.testing.synthetic`.
"""

from __future__ import annotations

from sacplan.testing.synthetic import Spec, build_tree, ops_from_rows
from sacplan.tree import ModuleTree


def llama_spec(n_blocks: int, *, hidden: int = 4096, seq: int = 4096, ffn: int = 11008, vocab: int = 32000,
               batch: int = 1, world_size: int = 8, with_ops: bool = True) -> Spec:
    """A Llama-7B-shaped model: root -> tok_embeddings, layers (ModuleList) -> N x TransformerBlock
    (attention_norm, attention (wq, wk, wv, wo), ffn_norm, feed_forward (w1, w2, w3)), norm, output.

    Sizes are bf16 (2 bytes) on an H100-SXM (989 dense bf16 TFLOP/s at 75% -> 742 TFLOP/s for matmuls,
    3.35 TB/s at 80% -> 2.68 TB/s for memory-bound ops), flash attention (no s x s matrices saved), per rank
    with FSDP over ``world_size`` ranks (parameters, gradients and AdamW state sharded).

    With T = b*s*h*2 bytes (32 MiB at 1 x 4096 x 4096) and Tf = b*s*ffn*2 bytes (86 MiB):

    * RMSNorm (torchtitan style: x.float() -> normalise -> type_as -> * weight): keeps the fp32 copy (2T),
      the bf16 normalised tensor (T) and its output (T, saved by the next Linear) = 4T; temp 2T (pow in fp32).
      ~0.08 ms (about 6 passes over T at 2.68 TB/s).
    * attention: wq/wk projections are consumed by RoPE (x.float() -> complex mul -> type_as), which keeps the
      fp32 complex view (2T) and the rotated bf16 tensor (T) for q and k: 6T; wv's output (T) and the flash
      output (T) + log-sum-exp (b*heads*s*4 bytes = 0.5 MiB) are saved; wo's output is the module output and is
      not kept (the residual add saves nothing): 8T + 0.5 MiB = 256.5 MiB. Each projection is 2*s*h*h =
      137 GFLOP -> 0.185 ms; flash forward 4*s*s*h/2 = 137 GFLOP at ~60% -> 0.25 ms; RoPE ~0.03 ms per tensor.
    * feed_forward (SwiGLU): w1 and w3 outputs (saved by silu / mul), silu output and the product (saved by w2)
      = 4Tf = 344 MiB; each projection 2*s*h*ffn = 369 GFLOP -> 0.498 ms; silu / mul ~0.1 ms each.
    * block: residual adds keep nothing (add saves no inputs; the block input/output are transient for it):
      A_block = 4T + 8T + 0.5 MiB + 4T + 4Tf = 856.5 MiB per block, R_block = ~2.9 ms.
    * params per block 4*h*h + 3*h*ffn = 202M -> 404 MB bf16, 1/world_size per rank; optimizer AdamW
      fp32 m, v = 4x the bf16 parameter bytes. Embedding/output 32000*4096 params each.
    * output projection 2*s*h*vocab = 1.07 TFLOP -> 1.45 ms; its fp32 log-softmax (s*vocab*4 = 500 MiB) is
      kept by the loss (attributed to the root).
    """
    T = batch * seq * hidden * 2
    Tf = batch * seq * ffn * 2
    lse = batch * 32 * seq * 4
    p_lin = hidden * hidden * 2 // world_size
    p_ffn = hidden * ffn * 2 // world_size
    p_norm = hidden * 2 // world_size
    p_emb = vocab * hidden * 2 // world_size
    mm_h = 2 * seq * hidden * hidden * batch
    mm_f = 2 * seq * hidden * ffn * batch
    t_h, t_f, t_sdpa = 0.185, 0.498, 0.25
    norm_rows = [
        ("aten._to_copy.default", 2 * T, 0.025, 0),
        ("aten.mul.Tensor", T, 0.04, 0),
        ("aten.mul.Tensor", T, 0.015, 0),
    ]
    attn_rows = [
        ("aten.mm.default", T, t_h, mm_h),  # wv (saved by sdpa)
        ("aten._to_copy.default", 2 * T, t_h + 0.015, mm_h),  # wq + x.float()
        ("aten.view_as_complex.default", 0, 0.001, 0, "view"),
        ("aten._to_copy.default", T, 0.015, 0),  # rotated q, type_as
        ("aten._to_copy.default", 2 * T, t_h + 0.015, mm_h),  # wk + x.float()
        ("aten.view_as_complex.default", 0, 0.001, 0, "view"),
        ("aten._to_copy.default", T, 0.015, 0),  # rotated k
        ("aten.transpose.int", 0, 0.001, 0, "view"),
        ("aten._scaled_dot_product_flash_attention.default", T + lse, t_sdpa, 2 * seq * seq * hidden * batch),
        ("aten.transpose.int", 0, 0.001, 0, "view"),
        ("aten.mm.default", T, t_h, mm_h, "output"),  # wo: module output
    ]
    ffn_rows = [
        ("aten.mm.default", Tf, t_f, mm_f),  # w1
        ("aten.silu.default", Tf, 0.1, 0),
        ("aten.mm.default", Tf, t_f, mm_f),  # w3
        ("aten.mul.Tensor", Tf, 0.1, 0),
        ("aten.mm.default", T, t_f, mm_f, "output"),  # w2
    ]
    attn_ops = ops_from_rows(attn_rows) if with_ops else ()
    ffn_ops = ops_from_rows(ffn_rows) if with_ops else ()
    blk_ops = ops_from_rows(_block_rows(norm_rows, attn_rows, ffn_rows)) if with_ops else ()
    norm_ms = sum(r[2] for r in norm_rows)

    def norm(name: str) -> Spec:
        return Spec(name, act=3 * T, tmp=2 * T, params=p_norm, fw_ms=norm_ms, no_tradeoff=True,
                    module_type="RMSNorm", out=T)

    def lin(name: str, params: int, ms: float, out: int = 0, tmp: int = 0) -> Spec:
        return Spec(name, params=params, fw_ms=ms, no_tradeoff=True, module_type="Linear", out=out, tmp=tmp)

    def block(i: int) -> Spec:
        attn = Spec(
            "attention",
            children=[lin("wq", p_lin, 0.0, tmp=T), lin("wk", p_lin, 0.0, tmp=T), lin("wv", p_lin, t_h, out=T),
                      lin("wo", p_lin, t_h, tmp=T)],
            act=6 * T + T + lse, tmp=2 * T, fw_ms=sum(r[2] for r in attn_rows) - 2 * t_h,
            ops=attn_ops, module_type="Attention",
        )
        ff = Spec(
            "feed_forward",
            children=[lin("w1", p_ffn, t_f, out=Tf), lin("w2", p_ffn, t_f, tmp=T), lin("w3", p_ffn, t_f, out=Tf)],
            act=2 * Tf, fw_ms=0.2, ops=ffn_ops, module_type="FeedForward",
        )
        return Spec(str(i), children=[norm("attention_norm"), attn, norm("ffn_norm"), ff], tmp=T, fw_ms=0.04,
                    ops=blk_ops, module_type="TransformerBlock")

    layers = Spec("layers", children=[block(i) for i in range(n_blocks)], no_tradeoff=True, module_type="ModuleList")
    root = Spec(
        "model",
        children=[
            lin("tok_embeddings", p_emb, 0.02, tmp=T),
            layers,
            norm("norm"),
            lin("output", p_emb, 1.45, tmp=seq * vocab * 2 * batch),
        ],
        act=seq * vocab * 4 * batch, tmp=seq * vocab * 4 * batch, fw_ms=0.6, no_tradeoff=True, module_type="Transformer",
    )
    return root


def _block_rows(norm_rows, attn_rows, ffn_rows) -> list[tuple]:
    """A block's ops: its sub-modules' ops in forward order; wo/w2 outputs and the first residual add are
    transient inside the block (the residual add keeps nothing): not saved by autograd, they cost their bytes
    to save under SAC."""
    T = attn_rows[0][1]
    rows = list(norm_rows) + list(attn_rows[:-1])
    rows.append(("aten.mm.default", T, attn_rows[-1][2], attn_rows[-1][3], "transient"))  # wo
    rows.append(("aten.add.Tensor", T, 0.02, 0, "transient"))  # h = x + attention(...)
    rows += list(norm_rows) + list(ffn_rows[:-1])
    rows.append(("aten.mm.default", T, ffn_rows[-1][2], ffn_rows[-1][3], "transient"))  # w2
    rows.append(("aten.add.Tensor", T, 0.02, 0, "output"))
    return rows


def llama_tree(n_blocks: int, *, world_size: int = 8, with_ops: bool = True, **kw) -> ModuleTree:
    """:func:`llama_spec` simulated (stats per rank for ``world_size`` FSDP ranks)."""
    return build_tree(
        llama_spec(n_blocks, world_size=world_size, with_ops=with_ops, **kw),
        world_size=world_size,
        optimizer_factor=4.0,
        model_name=f"llama7b-{n_blocks}L",
        loss_tmp=4096 * 32000 * 4,
    )

