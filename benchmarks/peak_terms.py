"""Per-term decomposition of a GPT-style model's step peak for an A100 target: sacplan vs PyTorch's MemTracker.

Both sides run on CPU fake tensors. "sacplan, host kernels" uses the A100's sizes (512 B rounding) with the
host's own kernels (attention="math"), the same kernels MemTracker sees on the fakes; "sacplan, A100 kernels"
routes dropout/SDPA/optimizer state as the A100 runs them (sacplan.collector.kernels).

    PYTHONPATH=$PWD python3 benchmarks/peak_terms.py [--layers 4 --dim 768 --seq 1024 --batch 8]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from sacplan.collector import collect, default_optimizer
from sacplan.devices import get_device


class Block(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.h, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, vocab: int = 50304, p: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, d // 64, p) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    ids = torch.zeros(a.batch, a.seq, dtype=torch.long)
    mk = lambda: GPT(a.layers, a.dim)  # noqa: E731
    loss = lambda out, args: out.float().mean()  # noqa: E731
    a100 = get_device("a100")
    rows = {}
    for label, spec in (("sacplan, A100 kernels", a100), ("sacplan, host kernels", a100.replace(attention="math"))):
        s = collect(mk, (ids,), device=spec, loss_fn=loss)
        snap = s.peak_snapshot
        rows[label] = {
            "param": snap.param, "grad": snap.grad, "optimizer": snap.optimizer, "input": snap.input,
            "activation": snap.activation, "temp": snap.temp, "other": snap.other + snap.buffer, "peak": s.peak_bytes,
        }
    with FakeTensorMode():
        m, x = mk(), torch.zeros(a.batch, a.seq, dtype=torch.long)
        opt = default_optimizer(m.parameters())
        mt = MemTracker()
        mt.track_external(m, opt)
        with mt:
            for i in range(2):
                if i:
                    mt.reset_mod_stats()
                loss(m(x), (x,)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    dev = torch.device("cpu")
    peak = mt.get_tracker_snapshot("peak")[dev]
    name = {"Parameter": "param", "Gradient": "grad", "Optimstate": "optimizer", "Activation": "activation",
            "Temp": "temp", "Buffer": "other", "Other": "other", "Input": "input"}
    ref = {k: 0 for k in rows["sacplan, A100 kernels"]}
    for k, v in peak.items():
        key = name.get(str(getattr(k, "value", k)), "other") if str(k) != "Total" else "peak"
        ref["peak" if "Total" in str(k) else key] += v
    rows["MemTracker (fakes, host kernels)"] = ref
    terms = list(ref)
    print("| term (MiB) | " + " | ".join(rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for t in terms:
        print(f"| {t} | " + " | ".join(f"{r[t] / 2**20:,.2f}" for r in rows.values()) + " |")


if __name__ == "__main__":
    main()
