"""A Llama-style decoder-only transformer, small enough to read in one screen.

Shapes use ``B`` batch, ``S`` sequence, ``D`` model dim, ``H`` query heads, ``KV`` key/value heads,
``hd = D // H`` head dim, ``F`` feed-forward hidden dim and ``V`` vocabulary.

Building on the ``meta`` device is cheap (nothing is allocated), which is how sacplan plans for models
that do not fit the host::

    with torch.device("meta"):
        model = Llama(LLAMA_PRESETS["llama-70b"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")       # fake storage; the forward runs on shapes only
        logits = model(tokens)

To run a meta-built model for real, ``to_empty`` it onto a device and call :meth:`Llama.init_weights`
(which also recomputes the rotary table); nothing calls it automatically.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sacplan.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and behaviour of a :class:`Llama`.

    Attributes:
        vocab_size: number of token ids.
        dim: model (residual stream) width ``D``.
        n_layers: number of :class:`TransformerBlock` s.
        n_heads: query heads ``H``; ``dim`` must be a multiple of it.
        n_kv_heads: key/value heads for grouped-query attention; ``None`` means ``n_heads`` (plain MHA).
        hidden_dim: SwiGLU hidden width ``F``; ``None`` derives it with Llama's rule
            (``2/3 * 4 * dim``, times ``ffn_dim_multiplier``, rounded up to ``multiple_of``), see
            :attr:`ffn_hidden_dim`.
        multiple_of: rounding of the derived ``hidden_dim``.
        ffn_dim_multiplier: optional factor of the derived ``hidden_dim``.
        norm_eps: RMSNorm epsilon.
        max_seq_len: longest sequence (size of the rotary / learned position table).
        rope_theta: rotary base frequency (10 000 for Llama 2, 500 000 for Llama 3).
        positions: ``"rotary"`` (RoPE on q and k) or ``"learned"`` (an ``nn.Embedding`` added to the input).
        dropout: probability used on attention probabilities (SDPA ``dropout_p``) and on the attention
            and MLP outputs, in training mode only; ``0`` runs no dropout op at all.
        tie_embeddings: the output projection shares the token embedding's weight.
        use_kv_cache: start with the inference KV cache on (see :meth:`Llama.enable_kv_cache`). Keep it
            off for training and planning.
    """

    vocab_size: int = 32_000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    hidden_dim: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    positions: str = "rotary"
    dropout: float = 0.0
    tie_embeddings: bool = False
    use_kv_cache: bool = False

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"LlamaConfig.{field_name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ConfigError(f"LlamaConfig: dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ConfigError(
                f"LlamaConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.hidden_dim is not None and self.hidden_dim <= 0:
            raise ConfigError(f"LlamaConfig.hidden_dim must be positive, got {self.hidden_dim}")
        if self.positions not in ("rotary", "learned"):
            raise ConfigError(f"LlamaConfig.positions must be 'rotary' or 'learned', got {self.positions!r}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ConfigError(f"LlamaConfig: rotary positions need an even head dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LlamaConfig.dropout must lie in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used (``n_kv_heads`` or ``n_heads``)."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden width actually used (``hidden_dim`` or Llama's rule)."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def with_(self, **changes: Any) -> LlamaConfig:
        """A copy with some fields changed, e.g. ``cfg.with_(n_layers=2)``."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown LlamaConfig field(s) {unknown}; fields are {sorted(names)}")
        return dataclasses.replace(self, **changes)


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    # For tests: runs a CPU training step in milliseconds. hidden 192 (rule with multiple_of=32).
    "llama-tiny": LlamaConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128
    ),
    # For examples on a laptop. hidden 704 (rule with multiple_of=32).
    "llama-small": LlamaConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, multiple_of=32, max_seq_len=512),
    # Llama 3.2 1B. The released model reaches 131 072 tokens through Llama-3 RoPE scaling, which is not
    # modelled here; the table stops at 8192.
    "llama-1b": LlamaConfig(
        vocab_size=128_256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192,
        max_seq_len=8192, rope_theta=500_000.0, tie_embeddings=True,
    ),
    # Llama 2 7B: 6,738,415,616 parameters.
    "llama-7b": LlamaConfig(
        vocab_size=32_000, dim=4096, n_layers=32, n_heads=32, hidden_dim=11_008, max_seq_len=4096
    ),
    # Llama 3 8B.
    "llama-8b": LlamaConfig(
        vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14_336,
        max_seq_len=8192, rope_theta=500_000.0,
    ),
    # Llama 2 13B.
    "llama-13b": LlamaConfig(
        vocab_size=32_000, dim=5120, n_layers=40, n_heads=40, hidden_dim=13_824, max_seq_len=4096
    ),
    # Llama 3 70B.
    "llama-70b": LlamaConfig(
        vocab_size=128_256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28_672,
        max_seq_len=8192, rope_theta=500_000.0,
    ),
}


# -- building blocks ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2) + eps) * weight``, normalised in float32 and cast back (as in Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(max_seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """cos/sin of RoPE angles: ``(max_seq_len, head_dim // 2, 2)`` float32, last axis ``[cos, sin]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)  # (max_seq_len, hd/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)  # (max_seq_len, hd/2, 2)


def apply_rotary(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate consecutive pairs of ``x`` (B, S, heads, hd) by the angles of ``rope`` (S, hd/2, 2), or by its
    first ``S`` rows when it is longer (a pipeline stage without the embedding passes the whole table: under
    sequence parallelism its input holds a shard of the sequence, and only the attention sees all of it).

    Same result as Llama's complex-number form, computed in float32 and cast back.
    """
    B, S, n, hd = x.shape
    if rope.shape[0] != S:
        rope = rope[:S]  # (S, hd/2, 2)
    pairs = x.float().reshape(B, S, n, hd // 2, 2)  # (B, S, n, hd/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos = rope[..., 0].view(1, S, 1, hd // 2)
    sin = rope[..., 1].view(1, S, 1, hd // 2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, S, n, hd/2, 2)
    return out.flatten(3).type_as(x)  # (B, S, n, hd)


class Attention(nn.Module):
    """Causal grouped-query self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        # Inference KV cache (plain attributes, not buffers: never in state_dict, never planned for).
        self.caching = False
        self.cache_k: Tensor | None = None  # (B, KV, past, hd)
        self.cache_v: Tensor | None = None

    @property
    def cache_len(self) -> int:
        return 0 if self.cache_k is None else self.cache_k.shape[2]

    def reset_cache(self) -> None:
        self.cache_k = self.cache_v = None

    def forward(self, x: Tensor, rope: Tensor | None) -> Tensor:
        B, S, D = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)  # (B, S, H, hd)
        k = self.wk(x).view(B, S, self.n_kv_heads, self.head_dim)  # (B, S, KV, hd)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)  # (B, S, KV, hd)
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, hd)

        mask = None
        if self.caching:
            if self.cache_k is not None:
                past = self.cache_k.shape[2]
                k = torch.cat((self.cache_k, k), dim=2)  # (B, KV, past + S, hd)
                v = torch.cat((self.cache_v, v), dim=2)
                # Query i sits at position past + i and sees keys 0..past + i (bottom-right causal).
                mask = torch.ones(S, past + S, dtype=torch.bool, device=x.device).tril(diagonal=past)
            self.cache_k, self.cache_v = k.detach(), v.detach()

        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, S, hd)
        y = y.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)  # (B, S, D)
        y = self.wo(y)
        if self.dropout > 0:
            y = F.dropout(y, self.dropout, self.training)
        return y


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.w1 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, S, F) -> (B, S, D)
        if self.dropout > 0:
            y = F.dropout(y, self.dropout, self.training)
        return y


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, rope: Tensor | None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope)  # (B, S, D)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, S, D)


class Llama(nn.Module):
    """Token ids ``(B, S)`` -> logits ``(B, S, V)`` in the parameters' dtype."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = (
            nn.Embedding(config.max_seq_len, config.dim) if config.positions == "learned" else None
        )
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if config.positions == "rotary":
            # Non-persistent: rebuilt from the config, never saved. Built on whatever device is current
            # (meta included); after ``to_empty`` call ``init_weights`` to make it real again.
            self.register_buffer(
                "rope_cache", rotary_table(config.max_seq_len, config.head_dim, config.rope_theta), persistent=False
            )
        else:
            self.register_buffer("rope_cache", None, persistent=False)
        if config.use_kv_cache:
            self.enable_kv_cache()

    # -- weights -------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """(Re)initialise every parameter and recompute the rotary table, on the model's device.

        Linear and embedding weights are drawn from ``N(0, std)``, norms set to one. Call this after
        ``to_empty`` on a model built on the ``meta`` device; a model built on a real device is already
        initialised (PyTorch's default init) and need not call it.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute the rotary table in float32 on its current device (after ``to_empty`` or a dtype cast)."""
        if self.rope_cache is not None:
            c = self.config
            self.rope_cache = rotary_table(c.max_seq_len, c.head_dim, c.rope_theta, device=self.rope_cache.device)

    # -- KV cache ------------------------------------------------------------------------------------
    @property
    def caching(self) -> bool:
        """Whether forward calls append to (and attend over) the per-layer KV cache."""
        return any(layer.attention.caching for layer in self.layers)

    def enable_kv_cache(self) -> None:
        """Turn the inference KV cache on (empty). Each forward then continues the previous sequence."""
        for layer in self.layers:
            layer.attention.caching = True
            layer.attention.reset_cache()

    def disable_kv_cache(self) -> None:
        """Turn the KV cache off and drop it. Required before planning or training with sacplan."""
        for layer in self.layers:
            layer.attention.caching = False
            layer.attention.reset_cache()

    def reset_kv_cache(self) -> None:
        """Empty the cache but keep caching on (start a new sequence)."""
        for layer in self.layers:
            layer.attention.reset_cache()

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, tokens: Tensor) -> Tensor:
        B, S = tokens.shape
        start = self.layers[0].attention.cache_len if (self.caching and len(self.layers)) else 0
        if start + S > self.config.max_seq_len:
            raise ConfigError(
                f"sequence of {start + S} tokens exceeds max_seq_len={self.config.max_seq_len}; "
                "build the model with a larger max_seq_len"
            )
        h = self.tok_embeddings(tokens)  # (B, S, D)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(torch.arange(start, start + S, device=tokens.device))  # (B, S, D)
        rope = self.rope_cache[start : start + S] if self.rope_cache is not None else None  # (S, hd/2, 2)
        for layer in self.layers:
            h = layer(h, rope)  # (B, S, D)
        h = self.norm(h)
        return self.output(h)  # (B, S, V)


# -- inputs and loss used by the presets ---------------------------------------------------------------


def example_tokens(batch: int, seq: int, vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """Deterministic pseudo-random token ids ``(batch, seq)`` int64, made on ``device`` (meta works)."""
    n = torch.arange(batch * seq, device=device, dtype=torch.int64)
    return ((n * 2_654_435_761 + 12_345) % vocab_size).view(batch, seq)


def next_token_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits`` (B, S, V) predicting ``tokens[:, 1:]``; the last position is ignored.

    The logits are upcast to float32 as training loops do; targets are the inputs shifted left by one
    and padded with ``-100`` (ignored), so no slice of the logits is copied.
    """
    targets = F.pad(tokens[:, 1:], (0, 1), value=-100)  # (B, S)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=-100)
