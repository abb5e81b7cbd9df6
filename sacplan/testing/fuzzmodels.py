"""A grammar of small random models for differential fuzzing of sacplan (see :mod:`sacplan.testing.fuzzcheck`).

A model is described by a :class:`ModelSpec` — plain frozen data, so a failing example prints as a literal that a
regression test can paste — and built by :func:`sacplan.testing.fuzzmodules.build_model`. Every layer maps a
``(batch, seq, dim)`` tensor to one of the same shape, so layers compose freely:

* ``linear`` — ``Linear`` followed by an activation *module* (ReLU / SiLU / Hardswish / GELU, optionally
  ``inplace=True``: the activation is then a module alone, a checkpoint unit of its own);
* ``mlp`` — up-projection, functional activation (in place or not), dropout, down-projection;
* ``conv1d`` / ``conv2d`` — transpose / reshape to channels, ``Conv`` → ``BatchNorm`` (train mode) → activation
  module (the BatchNorm + in-place activation pattern of mobile CNNs);
* ``norm`` — ``LayerNorm``, ``RMSNorm`` or ``BatchNorm1d``;
* ``attention`` — SDPA with no mask, ``is_causal``, a boolean or additive mask buffer or a mask passed as a
  keyword argument; attention dropout; grouped-query heads through ``enable_gqa`` or ``expand`` + ``reshape``;
* ``shape`` — view / transpose / reshape, chunk (GLU), slice + cat, expand;
* ``inplace`` — in-place residual add and in-place multiply by a parameter or a buffer;
* ``custom`` — a custom ``autograd.Function`` saving its input;
* ``twice`` — one ``Linear`` called twice in a forward;
* ``buffers`` — persistent and non-persistent buffers in the forward;
* ``kwargs`` — a sub-module whose forward takes keyword-only tensor and float arguments;
* containers ``seq`` / ``list`` / ``dict`` / ``residual`` nesting other layers.

The modules are in :mod:`sacplan.testing.fuzzmodules` (:func:`~sacplan.testing.fuzzmodules.build_model`,
``make_inputs``, ``loss_fn``). The model has an input stage (``Embedding`` of token ids, or ``Linear`` of features),
the body and a head; with ``tie`` the head shares the embedding's weight (or, with features, a ``Linear`` of the
body shares the first one's). Inputs are keyword arguments when ``kwargs_inputs``.

Each model also draws how it is trained (drawn last, so a seed's model is the same with or without these axes):
``precision`` — ``"fp32"``, ``"bf16"`` (the model cast to bf16 by ``dtype=torch.bfloat16`` in collect and validate,
floating inputs in bf16) or ``"autocast"`` (fp32 weights, forward and loss under
``torch.autocast("cpu", dtype=torch.bfloat16)``, through ``train_step=``); ``optimizer`` — ``"none"``, ``"sgd"``
(momentum 0.9) or ``"adamw"`` (:func:`~sacplan.testing.fuzzmodules.make_optimizer`).

Drawing: :func:`draw_spec` takes a :class:`Picker` (integers and choices), so the same grammar serves
hypothesis (whose picks shrink: the first option and the lower bound are the simplest) and a plain seeded
``random.Random`` (:class:`RandomPicker`, for benchmarks).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

T = TypeVar("T")

ACTIVATIONS = ("relu", "silu", "hardswish", "gelu")
LEAF_KINDS = ("linear", "mlp", "conv1d", "conv2d", "norm", "attention", "shape", "inplace", "custom", "twice",
              "buffers", "kwargs")
CONTAINER_KINDS = ("seq", "list", "dict", "residual")
LOSSES = ("square", "mean", "mse_loss")
#: How the step computes: fp32, bf16 weights (``dtype=torch.bfloat16``), or CPU bf16 autocast over fp32 weights.
PRECISIONS = ("fp32", "bf16", "autocast")
#: The optimizer step after the backward: none, SGD with momentum, AdamW.
OPTIMIZERS = ("none", "sgd", "adamw")
#: Variants per leaf kind (``Layer.option`` is taken modulo this).
OPTIONS = {"linear": 2, "mlp": 4, "conv1d": 2, "conv2d": 2, "norm": 3, "attention": 5, "shape": 4, "inplace": 3,
           "custom": 1, "twice": 2, "buffers": 2, "kwargs": 2}


def _short_repr(obj: Any) -> str:
    """``Class(field=value, ...)`` with only the fields that differ from their defaults (pasteable, short)."""
    parts = [f"{f.name}={getattr(obj, f.name)!r}" for f in fields(obj) if getattr(obj, f.name) != _default(f)]
    return f"{type(obj).__name__}({', '.join(parts)})"


def _default(f: Any) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


@dataclass(frozen=True, repr=False)
class Layer:
    """One layer of a fuzz model (see the module docstring for kinds and options).

    Attributes:
        kind: a leaf kind (``LEAF_KINDS``) or a container kind (``CONTAINER_KINDS``).
        act: activation name (``ACTIVATIONS``) where the kind has one.
        inplace: the activation runs in place.
        option: kind-specific variant (mask type, shape op...), modulo ``OPTIONS[kind]``.
        dropout: dropout probability where the kind has dropout (0 or 0.1-ish).
        heads, kv_heads: attention heads (``kv_heads`` divides ``heads``; fewer: grouped-query attention).
        children: a container's layers.
    """

    kind: str
    act: str = "relu"
    inplace: bool = False
    option: int = 0
    dropout: float = 0.0
    heads: int = 1
    kv_heads: int = 1
    children: tuple["Layer", ...] = ()

    __repr__ = _short_repr

    def walk(self) -> "Iterator[Layer]":
        """This layer and every layer nested in it, in pre-order."""
        yield self
        for c in self.children:
            yield from c.walk()


@dataclass(frozen=True, repr=False)
class ModelSpec:
    """A whole fuzz model and its inputs.

    Attributes:
        layers: the body, in order.
        dim: model width (even, divisible by every layer's heads).
        batch, seq: input sizes (``seq`` even: ``conv2d`` folds it into a 2 x seq/2 image).
        vocab: token vocabulary (0: float features of width ``dim`` instead of token ids).
        tie: weight tying (embedding and head, or two ``Linear`` of the body).
        kwargs_inputs: inputs passed as keyword arguments.
        seed: seed of weights, inputs and dropout.
        loss: of a feature model (token models use cross-entropy): ``"square"`` (mean squared error to the
            ``labels`` keyword input, or to 0), ``"mean"`` (the mean output: its gradient reaches the head
            expanded, with stride 0) or ``"mse_loss"`` (``F.mse_loss``).
        precision: ``PRECISIONS``: ``"fp32"``, ``"bf16"`` (weights and floating inputs in bf16) or ``"autocast"``
            (fp32 weights, forward and loss under CPU bf16 autocast).
        optimizer: ``OPTIMIZERS``: ``"none"``, ``"sgd"`` (momentum 0.9) or ``"adamw"``.
    """

    layers: tuple[Layer, ...] = field(default_factory=tuple)
    dim: int = 16
    batch: int = 2
    seq: int = 8
    vocab: int = 0
    tie: bool = False
    kwargs_inputs: bool = False
    seed: int = 0
    loss: str = "square"
    precision: str = "fp32"
    optimizer: str = "none"

    __repr__ = _short_repr

    def walk(self) -> "Iterator[Layer]":
        """Every layer of the body, nested ones included, in pre-order."""
        for l in self.layers:
            yield from l.walk()


# ------------------------------------------------------------------------------------------ drawing
class Picker(Protocol):
    """Source of random decisions; simplest answers are the lower bound and the first option."""

    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...


class RandomPicker:
    """A :class:`Picker` over ``random.Random(seed)``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


@dataclass(frozen=True)
class Grammar:
    """What :func:`draw_spec` may draw (everything by default; a test leaves out a construct whose failure is open
    elsewhere and pinned by a regression test).

    Attributes:
        kinds: leaf kinds (``LEAF_KINDS``).
        inplace_acts: activations that may run in place.
        conv_acts: activations after a conv block's BatchNorm.
        losses: losses of feature models (``LOSSES``).
        norm_options: ``norm`` variants (0 LayerNorm, 1 RMSNorm, 2 BatchNorm1d).
        max_layers: layers of the body (at least 1).
        max_depth: container nesting.
        inplace_in_residual: activations inside a ``residual`` container may run in place (False: only outside).
        feature_tie: a feature model (``vocab`` 0) may tie two ``Linear`` weights (token models always may).
        attention_dropout: ``attention`` layers may have dropout (other kinds always may).
        precisions: precisions drawn (``PRECISIONS``; the first is the simplest, where shrinking goes).
        optimizers: optimizers drawn (``OPTIMIZERS``).
    """

    kinds: tuple[str, ...] = LEAF_KINDS
    inplace_acts: tuple[str, ...] = ACTIVATIONS
    conv_acts: tuple[str, ...] = ACTIVATIONS
    losses: tuple[str, ...] = LOSSES
    norm_options: tuple[int, ...] = (0, 1, 2)
    max_layers: int = 5
    max_depth: int = 2
    inplace_in_residual: bool = True
    feature_tie: bool = True
    attention_dropout: bool = True
    precisions: tuple[str, ...] = PRECISIONS
    optimizers: tuple[str, ...] = OPTIMIZERS


#: The grammar the fuzz tests (tests/fuzz/test_fuzz.py) and benchmarks/fuzz.py draw: the whole grammar but what is
#: open below (every construct the fuzzer knows; when a finding stays open, leave its construct out here and pin it with a
#: strict-xfail test in tests/fuzz/test_regressions.py, to put back when that test XPASSes).
#: Model sizes (draw_spec) put peaks near 1 MiB and up. The 5,056-byte RNG-state copy a recomputation makes is in
#: the memory model (none for regions without random ops; test_recomputation_*_rng_state pin it at small sizes, where
#: it shows); where a region with dropout has its rc stretch peak before its recomputation, the copy is over-counted
#: (at most 5,056 B, the safe side).
#: Open: CPU bf16 autocast is left out (``benchmarks/fuzz.py --full`` draws it). The saved weight cast autocast's cache
#: holds until the forward ends is modelled (test_autocast_saved_weight_cast_held_until_the_forward_ends passes), but
#: ``benchmarks/fuzz.py --seeds 0:250 --full`` still fails 4 autocast models: seed 249 under-predicted by 2.6% (the
#: allocator sees ~32 KiB per checkpointed region more than the tracker on real tensors, under autocast only; it
#: was so before) and seeds 78, 201, 213 over-predicted by 1.2-1.5% (benchmarks/RESULTS.md, helper ``autocastfw``).
CHECKED = Grammar(precisions=("fp32", "bf16"))


def draw_layer(pick: Picker, dim: int, depth: int, grammar: Grammar = Grammar()) -> Layer:
    """One layer; containers nest up to ``depth`` more levels."""
    kind = pick.choice(grammar.kinds + (CONTAINER_KINDS if depth > 0 else ()))
    if kind in CONTAINER_KINDS:
        n = pick.integer(1, 3)
        inner = grammar
        if kind == "residual" and not grammar.inplace_in_residual:
            inner = dataclasses.replace(grammar, inplace_acts=())
        return Layer(kind, children=tuple(draw_layer(pick, dim, depth - 1, inner) for _ in range(n)))
    heads = pick.choice([h for h in (1, 2, 4) if dim % (2 * h) == 0])
    kv = pick.choice([k for k in (1, 2, 4) if heads % k == 0])
    act = pick.choice(grammar.conv_acts if kind in ("conv1d", "conv2d") else ACTIVATIONS)
    inplace = pick.choice((False, True)) and act in grammar.inplace_acts
    option = pick.choice(grammar.norm_options) if kind == "norm" else pick.integer(0, OPTIONS[kind] - 1)
    dropout = pick.choice((0.0, 0.25))
    if kind == "attention" and not grammar.attention_dropout:
        dropout = 0.0
    return Layer(kind, act=act, inplace=inplace, option=option, dropout=dropout, heads=heads, kv_heads=kv)


def draw_spec(pick: Picker, grammar: Grammar = Grammar()) -> ModelSpec:
    """A random :class:`ModelSpec` of ``grammar`` (tiny: a CPU step takes milliseconds)."""
    dim = pick.choice((64, 128))
    n = pick.integer(1, grammar.max_layers)
    layers = tuple(draw_layer(pick, dim, grammar.max_depth, grammar) for _ in range(n))
    batch, seq, vocab = pick.integer(2, 4), pick.choice((32, 64)), pick.choice((0, 128))
    tie = pick.choice((False, True)) and (vocab > 0 or grammar.feature_tie)
    return ModelSpec(layers=layers, dim=dim, batch=batch, seq=seq, vocab=vocab, tie=tie,
                     kwargs_inputs=pick.choice((False, True)), seed=pick.integer(0, 2**16),
                     loss=pick.choice(grammar.losses), precision=pick.choice(grammar.precisions),
                     optimizer=pick.choice(grammar.optimizers))


def draw_repeated_spec(pick: Picker, grammar: Grammar = Grammar()) -> ModelSpec:
    """A random :class:`ModelSpec` whose body is one ``list`` container of 2-3 identical leaf layers of ``grammar``
    (the repeated blocks ``validate(..., compile=True)`` compiles one by one), without dropout (compiled graphs
    with and without a plan draw different random numbers: their gradients could not be compared)."""
    dim = pick.choice((64, 128))
    block = dataclasses.replace(draw_layer(pick, dim, 0, grammar), dropout=0.0)
    n = pick.integer(2, 3)
    batch, seq, vocab = pick.integer(2, 4), pick.choice((32, 64)), pick.choice((0, 128))
    return ModelSpec(layers=(Layer("list", children=(block,) * n),), dim=dim, batch=batch, seq=seq, vocab=vocab,
                     seed=pick.integer(0, 2**16), loss=pick.choice(grammar.losses),
                     precision=pick.choice(grammar.precisions), optimizer=pick.choice(grammar.optimizers))


def spec_strategy(grammar: Grammar = Grammar(), draw: Callable[..., ModelSpec] | None = None) -> Any:
    """A hypothesis strategy of :class:`ModelSpec` drawn by ``draw`` (default :func:`draw_spec`; hypothesis is
    imported here: only tests need it)."""
    from hypothesis import strategies as st

    @st.composite
    def specs(data: Callable[[Any], Any]) -> ModelSpec:
        return (draw_spec if draw is None else draw)(hypothesis_picker(data), grammar)

    return specs()


def hypothesis_picker(data: Callable[[Any], Any]) -> Picker:
    """A :class:`Picker` drawing from a hypothesis ``@composite`` strategy's ``draw`` (so hypothesis shrinks the
    choices)."""
    from hypothesis import strategies as st

    class _Pick:
        def integer(self, lo: int, hi: int) -> int:
            return data(st.integers(lo, hi))

        def choice(self, options: Sequence[T]) -> T:
            return data(st.sampled_from(options))

    return _Pick()
