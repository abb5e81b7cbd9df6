"""The ``nn.Module`` s of the fuzz grammar (:mod:`sacplan.testing.fuzzmodels`): one class per leaf kind, the
containers, the whole :class:`FuzzModel`, its inputs and loss, and how it trains (:func:`model_dtype`,
:func:`make_optimizer`, :func:`forward_loss`, :func:`train_step`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from sacplan.collector.calling import as_inputs, call_model
from sacplan.testing.fuzzmodels import CONTAINER_KINDS, LEAF_KINDS, Layer, ModelSpec


# ------------------------------------------------------------------------------------------ modules
def activation_module(name: str, inplace: bool) -> nn.Module:
    if name == "gelu":  # nn.GELU has no in-place form: approximate="tanh" as its variant
        return nn.GELU(approximate="tanh" if inplace else "none")
    return {"relu": nn.ReLU, "silu": nn.SiLU, "hardswish": nn.Hardswish}[name](inplace=inplace)


def activation_fn(name: str, x: torch.Tensor, inplace: bool) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)
    return {"relu": F.relu, "silu": F.silu, "hardswish": F.hardswish}[name](x, inplace=inplace)


class ScaledGelu(torch.autograd.Function):
    """A custom autograd Function saving its input (as hand-fused activations do)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x) * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(F.gelu(xd) * 2, xd, g)
        return gx


class LinearAct(nn.Module):
    """``Linear`` then an activation module (option 1: no bias)."""

    def __init__(self, d: int, layer: Layer) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d, bias=layer.option % 2 == 0)
        self.act = activation_module(layer.act, layer.inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Mlp(nn.Module):
    """Up, functional activation (in place or not), dropout, down; option bit 0: residual."""

    def __init__(self, d: int, layer: Layer) -> None:
        super().__init__()
        self.layer = layer
        self.up, self.down, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(layer.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(self.drop(activation_fn(self.layer.act, self.up(x), self.layer.inplace)))
        return x + h if self.layer.option % 2 else h


class ConvBlock(nn.Module):
    """Conv → BatchNorm (train mode) → activation module over channels; 1-d over the sequence or 2-d over a
    2 x seq/2 image (option 1: no bias on the conv, and no affine BatchNorm)."""

    def __init__(self, d: int, layer: Layer, two_d: bool) -> None:
        super().__init__()
        conv, norm = (nn.Conv2d, nn.BatchNorm2d) if two_d else (nn.Conv1d, nn.BatchNorm1d)
        plain = layer.option % 2 == 1
        self.two_d = two_d
        self.conv = conv(d, d, 3, padding=1, bias=not plain)
        self.bn = norm(d, affine=not plain)
        self.act = activation_module(layer.act, layer.inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = x.transpose(1, 2)
        if self.two_d:
            h = h.reshape(b, d, 2, t // 2)
        h = self.act(self.bn(self.conv(h)))
        return h.reshape(b, d, t).transpose(1, 2)


class Norm(nn.Module):
    """LayerNorm, RMSNorm or BatchNorm1d (over the transposed sequence) by option."""

    def __init__(self, d: int, layer: Layer) -> None:
        super().__init__()
        self.kind = layer.option % 3
        self.norm = (nn.LayerNorm(d), nn.RMSNorm(d), nn.BatchNorm1d(d))[self.kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2) if self.kind == 2 else self.norm(x)


class Attention(nn.Module):
    """SDPA self-attention. Options: 0 no mask, 1 ``is_causal``, 2 boolean mask buffer, 3 additive float mask
    buffer, 4 boolean mask as a keyword argument (``forward(x, *, mask)``). Grouped-query heads use
    ``enable_gqa`` for even options, ``expand`` + ``reshape`` of k / v for odd ones."""

    def __init__(self, d: int, seq: int, layer: Layer) -> None:
        super().__init__()
        self.h, self.kv, self.hd = layer.heads, layer.kv_heads, d // layer.heads
        self.mode, self.p = layer.option % 5, layer.dropout
        self.q = nn.Linear(d, d)
        self.kvp = nn.Linear(d, 2 * self.kv * self.hd)
        self.o = nn.Linear(d, d)
        tril = torch.ones(seq, seq, dtype=torch.bool).tril()
        self.register_buffer("mask", tril if self.mode == 2 else torch.zeros(seq, seq).masked_fill(~tril, -1e4))

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k, v = self.kvp(x).view(b, t, 2 * self.kv, self.hd).transpose(1, 2).chunk(2, dim=1)
        gqa = self.kv != self.h
        if gqa and self.mode % 2 == 1:
            rep = self.h // self.kv
            k = k[:, :, None].expand(b, self.kv, rep, t, self.hd).reshape(b, self.h, t, self.hd)
            v = v[:, :, None].expand(b, self.kv, rep, t, self.hd).reshape(b, self.h, t, self.hd)
            gqa = False
        attn_mask = {2: self.mask, 3: self.mask, 4: mask}.get(self.mode)
        p = self.p if self.training else 0.0
        extra = {"enable_gqa": True} if gqa else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=self.mode == 1, **extra)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class ShapeOps(nn.Module):
    """Options: 0 view / transpose / reshape, 1 chunk (a GLU), 2 slice + cat, 3 expand of a mean."""

    def __init__(self, d: int, layer: Layer) -> None:
        super().__init__()
        self.mode = layer.option % 4
        self.fc = nn.Linear(d, 2 * d if self.mode == 1 else d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.fc(x)
        if self.mode == 0:
            return h.view(b, t, 2, d // 2).transpose(2, 3).reshape(b, t, d) * x
        if self.mode == 1:
            a, g = h.chunk(2, dim=-1)
            return a * torch.sigmoid(g)
        if self.mode == 2:
            return torch.cat([h[..., d // 2:], h[..., : d // 2]], dim=-1) * h[:, :1].tanh()
        return h + h.mean(1, keepdim=True).expand(b, t, d)


class InPlace(nn.Module):
    """In-place arithmetic on the block's own intermediates: ``h += x`` (residual), then option 0 ``h *= gain``
    (a parameter), 1 ``h.mul_(scale)`` (a buffer), 2 ``h.add_(h.sigmoid())`` then ``h *= 0.5``."""

    def __init__(self, d: int, layer: Layer) -> None:
        super().__init__()
        self.mode = layer.option % 3
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.register_buffer("scale", torch.linspace(1.5, 0.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h += x
        if self.mode == 0:
            h *= self.gain
        elif self.mode == 1:
            h.mul_(self.scale)
        else:
            h.add_(h.sigmoid())
            h *= 0.5
        return h


class Custom(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledGelu.apply(self.fc(x))


class Twice(nn.Module):
    """One ``Linear`` called twice (option 1: the second call through an activation module in between)."""

    def __init__(self, d: int, layer: Layer) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = activation_module(layer.act, layer.inplace) if layer.option % 2 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.fc(x)))


class Buffers(nn.Module):
    """A persistent scale buffer and a non-persistent positional table (option 1: a step counter buffer
    incremented in place each forward, as BatchNorm's ``num_batches_tracked``)."""

    def __init__(self, d: int, seq: int, layer: Layer) -> None:
        super().__init__()
        self.count = layer.option % 2 == 1
        self.fc = nn.Linear(d, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.register_buffer("pos", torch.sin(torch.arange(seq * d, dtype=torch.float32).view(seq, d)), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count:
            self.steps.add_(1)
        return self.fc(x * self.scale + self.pos)


class KwInner(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, *, gain: torch.Tensor, shift: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(x) * gain + shift
        return h if bias is None else h + bias


class Kwargs(nn.Module):
    """Calls a sub-module with keyword arguments: a parameter, a float and (option 1) a tensor computed here."""

    def __init__(self, d: int, layer: Layer) -> None:
        super().__init__()
        self.with_bias = layer.option % 2 == 1
        self.inner = KwInner(d)
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = x.mean(-1, keepdim=True) if self.with_bias else None
        return self.inner(x, gain=self.gain, shift=0.5, bias=bias)


class MaskedCall(nn.Module):
    """Builds a causal boolean mask and hands it to ``attn`` as a keyword argument."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return self.attn(x, mask=torch.ones(t, t, dtype=torch.bool, device=x.device).tril())


# ------------------------------------------------------------------------------------------ containers
class ListStack(nn.Module):
    def __init__(self, mods: list[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.items:
            x = m(x)
        return x


class DictStack(nn.Module):
    def __init__(self, mods: list[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleDict({f"m{i}": m for i, m in enumerate(mods)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.items.values():
            x = m(x)
        return x


class Residual(nn.Module):
    def __init__(self, mods: list[nn.Module]) -> None:
        super().__init__()
        self.body = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def layer_module(layer: Layer, d: int, seq: int) -> nn.Module:
    """The ``nn.Module`` of one :class:`Layer`."""
    k = layer.kind
    if k in CONTAINER_KINDS:
        mods = [layer_module(c, d, seq) for c in layer.children]
        return {"seq": lambda: nn.Sequential(*mods), "list": lambda: ListStack(mods), "dict": lambda: DictStack(mods),
                "residual": lambda: Residual(mods)}[k]()
    if k == "attention":
        attn = Attention(d, seq, layer)
        return MaskedCall(attn) if attn.mode == 4 else attn
    simple: dict[str, Callable[[], nn.Module]] = {
        "linear": lambda: LinearAct(d, layer), "mlp": lambda: Mlp(d, layer), "conv1d": lambda: ConvBlock(d, layer, False),
        "conv2d": lambda: ConvBlock(d, layer, True), "norm": lambda: Norm(d, layer), "shape": lambda: ShapeOps(d, layer),
        "inplace": lambda: InPlace(d, layer), "custom": lambda: Custom(d), "twice": lambda: Twice(d, layer),
        "buffers": lambda: Buffers(d, seq, layer), "kwargs": lambda: Kwargs(d, layer),
    }
    if k not in simple:
        raise ValueError(f"unknown fuzz layer kind {k!r}; kinds: {LEAF_KINDS + CONTAINER_KINDS}")
    return simple[k]()


class FuzzModel(nn.Module):
    """Input stage (``Embedding`` or ``Linear``), the body (an ``nn.Sequential`` of layers) and a head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d = spec.dim
        self.spec = spec
        self.inp: nn.Module = nn.Embedding(spec.vocab, d) if spec.vocab else nn.Linear(d, d)
        self.body = nn.Sequential(*[layer_module(l, d, spec.seq) for l in spec.layers])
        self.head = nn.Linear(d, spec.vocab or d, bias=False)
        if spec.tie:
            tie_weights(self)

    def forward(self, x: torch.Tensor | None = None, *, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.body(self.inp(x)))


def tie_weights(model: FuzzModel) -> None:
    """Embedding and head share a weight; without an embedding, the first two square bias-free-compatible
    ``Linear`` of the model share the first one's weight (the input stage and the head otherwise)."""
    if model.spec.vocab:
        model.head.weight = model.inp.weight  # type: ignore[union-attr]
        return
    squares = [m for m in model.modules() if isinstance(m, nn.Linear) and m.in_features == m.out_features]
    first, second = squares[0], squares[1]  # inp and head are always square
    second.weight = first.weight


def build_model(spec: ModelSpec) -> nn.Module:
    """The model of ``spec``, its weights from ``spec.seed``, in train mode."""
    torch.manual_seed(spec.seed)
    return FuzzModel(spec).train()


def make_inputs(spec: ModelSpec) -> Any:
    """The forward's inputs (a tuple, or keyword arguments when ``spec.kwargs_inputs``), from ``spec.seed``."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    if spec.vocab:
        x = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)
        labels = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)
    else:
        x = torch.randn(spec.batch, spec.seq, spec.dim, generator=g)
        labels = torch.randn(spec.batch, spec.seq, spec.dim, generator=g)
        dtype = model_dtype(spec)
        if dtype is not None:  # a bf16 model takes bf16 features (fp32 ones fail in its first Linear)
            x, labels = x.to(dtype), labels.to(dtype)
    return {"x": x, "labels": labels} if spec.kwargs_inputs else (x,)


def loss_fn(spec: ModelSpec) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """``(output, inputs) -> loss``: cross-entropy on token models, ``spec.loss`` on feature models."""

    def loss(out: torch.Tensor, inputs: Any) -> torch.Tensor:
        if spec.vocab:
            labels = inputs["labels"] if isinstance(inputs, dict) else torch.zeros(out.shape[:-1], dtype=torch.long)
            return F.cross_entropy(out.flatten(0, 1), labels.flatten())
        target = inputs["labels"] if isinstance(inputs, dict) else torch.zeros_like(out)
        if spec.loss == "mean":
            return out.mean()
        if spec.loss == "mse_loss":
            return F.mse_loss(out, target)
        return (out - target).square().mean()

    return loss


# ------------------------------------------------------------------------------------------ training
def model_dtype(spec: ModelSpec) -> torch.dtype | None:
    """The ``dtype=`` of collect and validate for ``spec.precision`` (``torch.bfloat16`` for ``"bf16"``, else
    None: fp32 weights, under autocast too)."""
    return torch.bfloat16 if spec.precision == "bf16" else None


def make_optimizer(spec: ModelSpec) -> Callable[[Any], torch.optim.Optimizer] | bool:
    """The ``optimizer=`` of collect and validate for ``spec.optimizer``: ``False`` (none), SGD with momentum 0.9
    or AdamW (foreach, as collect's default) as a factory ``params -> Optimizer``."""
    if spec.optimizer == "none":
        return False
    if spec.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if spec.optimizer == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True)
    raise ValueError(f"unknown fuzz optimizer {spec.optimizer!r}; one of none, sgd, adamw")


def forward_loss(spec: ModelSpec, model: nn.Module, inputs: Any) -> torch.Tensor:
    """The loss of one forward of ``model`` on ``inputs`` (a tuple or keyword arguments), the forward and the loss
    under CPU bf16 autocast when ``spec.precision`` is ``"autocast"``."""
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if spec.precision == "autocast" else contextlib.nullcontext()
    with cast:
        return loss_fn(spec)(call_model(model, as_inputs(inputs)), inputs)


def train_step(spec: ModelSpec) -> Callable[[nn.Module, Any, torch.optim.Optimizer | None], None]:
    """A ``train_step=`` for collect and validate, ``(model, inputs, optimizer) -> None``: :func:`forward_loss`,
    backward, the optimizer step when there is one, gradients set to None."""

    def step(model: nn.Module, inputs: Any, opt: torch.optim.Optimizer | None) -> None:
        forward_loss(spec, model, inputs).backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    return step
