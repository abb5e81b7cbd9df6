"""``apply_plan`` with ``torch.compile`` (single process, ``aot_eager``-equivalent backend on CPU).

The backend is AOTAutograd with no-op compilers that run each forward / backward graph under a dispatch mode
counting FLOPs as sacplan counts them (``sacplan.collector.runtime.op_flops``). ``FlopCounterMode`` cannot be
used for this: Dynamo does not compile while a ``TorchDispatchMode`` is active, so the step would run eagerly.
Recomputation shows up as extra FLOPs in the compiled backward graph. Checked, in both orders (plan then
compile, compile then plan) and with blocks compiled one by one:

* gradients (and BatchNorm statistics) are bitwise those of the compiled model without a plan;
* the compiled step recomputes exactly the plan's ``recompute_flops`` (no dropout). With dropout, eager
  non-reentrant checkpointing also replays ops whose outputs the backward does not need, and the compiled
  partitioner does not, so the compiled recomputation is at most the plan's (and more than zero).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
from torch import nn

from sacplan.apply import applied_plan, apply_plan, remove_plan
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.fingerprint import canonical_fqn, model_fingerprint
from sacplan.models import get_model
from sacplan.models.llama import Llama
from sacplan.solver import solve
from sacplan.tree import ModuleTree
from tests.distributed._flops import CountingBackend

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _setup(name: str, dropout: float = 0.0, frac: float = 0.85):
    if name == "llama":
        preset = get_model("llama-tiny")
        cfg = preset.config.with_(n_layers=2, dropout=dropout)
        model_fn = lambda: Llama(cfg)  # noqa: E731
        args = preset.example_inputs(2, 64)
    else:
        preset = get_model("cnn-tiny")
        model_fn = preset.build
        args = preset.example_inputs(8)
    torch.manual_seed(0)
    stats = collect(model_fn, args, device=CPU, loss_fn=preset.loss_fn)
    plan = solve(ModuleTree(stats), int(stats.peak_bytes * frac))
    assert plan.decisions, "the budget should need checkpointing"
    return model_fn, args, preset.loss_fn, plan


@pytest.fixture(scope="module")
def llama():
    return _setup("llama")


def _step(call: Callable[..., Any], model: nn.Module, args: tuple, loss_fn, backend: CountingBackend):
    """One compiled training step: (FLOPs of the compiled graphs, grads, buffers)."""
    backend.flops = 0
    torch.manual_seed(1)
    loss_fn(call(*args), args).backward()
    grads = {canonical_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return backend.flops, grads, {canonical_fqn(n): b.clone() for n, b in model.named_buffers()}


def _reference(model_fn, args, loss_fn):
    torch.manual_seed(0)
    model = model_fn()
    backend = CountingBackend()
    return _step(torch.compile(model, backend=backend), model, args, loss_fn, backend)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", ["llama", "cnn"])
def test_apply_then_compile_recomputes_the_plan(llama, name):
    model_fn, args, loss_fn, plan = llama if name == "llama" else _setup("cnn", frac=0.8)
    f0, g0, b0 = _reference(model_fn, args, loss_fn)
    torch.manual_seed(0)
    model = model_fn()
    apply_plan(model, plan)
    backend = CountingBackend()
    f1, g1, b1 = _step(torch.compile(model, backend=backend), model, args, loss_fn, backend)
    assert backend.graphs == 2, "one forward and one backward graph: no graph break"
    assert f1 - f0 == sum(d.recompute_flops for d in plan.decisions)
    _assert_same(g0, g1)
    _assert_same(b0, b1)  # BatchNorm running statistics updated once, as without a plan


def test_compile_then_apply_recompiles_and_remove_restores(llama):
    model_fn, args, loss_fn, plan = llama
    f0, g0, _ = _reference(model_fn, args, loss_fn)
    torch.manual_seed(0)
    model = model_fn()
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    assert _step(compiled, model, args, loss_fn, backend)[0] == f0
    assert apply_plan(compiled, plan) is compiled  # the OptimizedModule: its _orig_mod is planned
    assert applied_plan(compiled) is plan and applied_plan(model) is plan
    f1, g1, _ = _step(compiled, model, args, loss_fn, backend)
    assert f1 - f0 == sum(d.recompute_flops for d in plan.decisions)
    _assert_same(g0, g1)
    remove_plan(compiled)
    assert applied_plan(model) is None
    f2, g2, _ = _step(compiled, model, args, loss_fn, backend)
    assert f2 == f0
    _assert_same(g0, g2)


def test_blocks_compiled_one_by_one(llama):
    model_fn, args, loss_fn, plan = llama
    f0, g0, _ = _reference(model_fn, args, loss_fn)
    torch.manual_seed(0)
    model = model_fn()
    fp = model_fingerprint(model)
    backend = CountingBackend()
    for i, blk in enumerate(model.layers):
        model.layers[i] = torch.compile(blk, backend=backend)
    assert any(n.endswith("._orig_mod") for n, _ in model.named_modules())
    assert model_fingerprint(model) == fp  # names now hold "layers.0._orig_mod": sacplan looks through it
    apply_plan(model, plan)
    f1, g1, _ = _step(model, model, args, loss_fn, backend)
    remove_plan(model)  # only the blocks' graphs are counted: compare with the same model without a plan
    f2, g2, _ = _step(model, model, args, loss_fn, backend)
    recompute_in_blocks = sum(d.recompute_flops for d in plan.decisions if d.fqn.startswith("layers."))
    assert f1 - f2 == recompute_in_blocks > 0
    _assert_same(g0, g1)
    _assert_same(g0, g2)


def _logged_policies(monkeypatch) -> list[list[tuple[str, str]]]:
    """Patch ``sacplan.apply.make_policy`` to log each region call's ``(op, decision)`` of its forward."""
    import sacplan.apply as A

    calls: list[list[tuple[str, str]]] = []
    orig = A.make_policy

    def make_policy(*a: Any, **kw: Any) -> Any:
        policy, log = orig(*a, **kw), []
        calls.append(log)

        def logged(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            out = policy(ctx, func, *args, **kwargs)
            if not getattr(ctx, "is_recompute", False):
                log.append((str(func), out.name))
            return out

        return logged

    monkeypatch.setattr(A, "make_policy", make_policy)
    return calls


_VIEWS = ("aten.view.default", "aten._unsafe_view.default")


def _without_dropout(ops: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop views and dropout (eager CPU: empty_like, bernoulli_, div_, mul; traced: native_dropout)."""
    out, skip = [], 0
    for i, (op, decision) in enumerate(ops):
        if skip:
            skip -= 1
            continue
        if op == "aten.empty_like.default" and i + 1 < len(ops) and ops[i + 1][0].startswith("aten.bernoulli_"):
            skip = 3
            continue
        if op != "aten.native_dropout.default" and op not in _VIEWS:
            out.append((op, decision))
    return out


def _eager_flops(model: nn.Module, args: tuple, loss_fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from sacplan.collector.runtime import flop_mapping

    torch.manual_seed(1)
    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as fc:
        loss_fn(model(*args), args).backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def test_dropout_under_compile(monkeypatch):
    """Dropout: the same decisions as eager for every other op, RNG replayed (gradients bitwise).

    Traced, dropout is one ``native_dropout``; eager on CPU it is four ops, one of them an ``aten.mul`` that
    the plan's occurrence numbers count, so the compiled policy must count it too. The plan checkpoints
    whole blocks saving every third ``aten.mul`` (so a count shifted by the dropouts flips decisions); ``full`` saves
    nothing, so every random op is recomputed and its RNG state must be replayed.
    """
    model_fn, args, loss_fn, plan = _setup("llama", dropout=0.1, frac=0.8)
    d0 = plan.decisions[0]
    muls = tuple((0, "aten.mul.Tensor", k) for k in range(0, 40, 3))
    rnd = ((0, "aten.bernoulli_.float", 0),)
    alt = dataclasses.replace(plan, decisions=[
        dataclasses.replace(d0, fqn=f"layers.{i}", discard_ratio=0.5, saved_ops=muls + rnd) for i in range(2)
    ])
    full = dataclasses.replace(plan, decisions=[
        dataclasses.replace(d0, fqn=f"layers.{i}", discard_ratio=1.0, saved_ops=None) for i in range(2)
    ])
    f0, g0, _ = _reference(model_fn, args, loss_fn)
    torch.manual_seed(0)
    eager = model_fn()
    e0 = _eager_flops(eager, args, loss_fn)
    calls = _logged_policies(monkeypatch)
    apply_plan(eager, alt)
    eager_recompute = _eager_flops(eager, args, loss_fn) - e0
    eager_calls = list(calls)
    assert len(eager_calls) == 2 and all(any(op.startswith("aten.bernoulli_") for op, _ in c) for c in eager_calls)
    for p in (alt, full):
        calls.clear()
        torch.manual_seed(0)
        model = model_fn()
        apply_plan(model, p)
        backend = CountingBackend()
        f1, g1, _ = _step(torch.compile(model, backend=backend), model, args, loss_fn, backend)
        _assert_same(g0, g1)
        assert f1 - f0 > 0
        if p is alt:
            # eager replays ops the backward does not need; the compiled partitioner does not
            assert f1 - f0 <= eager_recompute
            traced = [c for c in calls if c][-2:]  # the joint graph's trace (the last one)
            for e, c in zip(eager_calls, traced):
                assert _without_dropout(e) == _without_dropout(c)


# ------------------------------------------------------------------------------------ FSDP2 + compile
def _fsdp_compile(rank: int, ws: int, plan_dict: dict) -> dict:
    from torch.distributed.fsdp import fully_shard

    from sacplan.plan import Plan

    plan = Plan.from_dict(plan_dict)
    preset = get_model("llama-tiny")
    vocab = preset.config.vocab_size
    toks = [torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(1000 + r)) for r in range(ws)]
    torch.manual_seed(0)
    ref = preset.build(n_layers=2)
    all_toks = torch.cat(toks)
    preset.loss_fn(ref(all_toks), all_toks).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out: dict[str, Any] = {}
    for variant in ("no plan", "apply, compile, shard", "shard, compile, apply"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = preset.build(n_layers=2)
        backend = CountingBackend()
        if variant == "apply, compile, shard":  # torchtitan's order: AC, compile each block, then FSDP
            apply_plan(model, plan)
        if variant != "shard, compile, apply":
            for i, blk in enumerate(model.layers):
                model.layers[i] = torch.compile(blk, backend=backend)
        for blk in model.layers:
            fully_shard(blk)
        fully_shard(model)
        if variant == "shard, compile, apply":
            for blk in model.layers:
                blk.compile(backend=backend)  # in place: FSDPTransformerBlock stays in the tree
            apply_plan(model, plan)
        x = toks[rank]
        preset.loss_fn(model(x), x).backward()
        diff = 0.0
        for n, p in model.named_parameters():
            diff = max(diff, float((p.grad.full_tensor() - ref_grads[canonical_fqn(n)]).abs().max()))
        from torch._dynamo.utils import counters

        out[variant] = dict(flops=backend.flops, graphs=backend.graphs, max_grad_diff=diff,
                            graph_breaks=sum(counters["graph_break"].values()))
    return out


def _fsdp_compile_worker(rank: int, ws: int, rdzv: str, plan_dict: dict, q: Any) -> None:
    from tests.distributed import _mp

    _mp.init(rank, ws, rdzv)
    _mp.guarded(rank, q, lambda: _fsdp_compile(rank, ws, plan_dict))


@pytest.mark.distributed
def test_fsdp2_with_compiled_blocks(tmp_path):
    """2 gloo ranks, blocks compiled: plan applied before compile and FSDP2, or after both."""
    from sacplan.distributed import shard_stats
    from sacplan.solver import baseline_peak, min_feasible_budget
    from tests.distributed import _mp

    preset = get_model("llama-tiny")
    x = torch.randint(0, preset.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1000))
    stats = collect(lambda: preset.build(n_layers=2), x, device=CPU, loss_fn=preset.loss_fn)
    with torch.device("meta"):
        meta = preset.build(n_layers=2)
    per_rank = shard_stats(stats, 2, model=meta)
    tree = ModuleTree(per_rank)
    units = [u for u in per_rank.meta["distributed"]["units"] if u]
    lo, base = min_feasible_budget(tree, fsdp_units=units), baseline_peak(tree)
    plan = solve(tree, lo + (base - lo) // 2, fsdp_units=units)
    assert plan.decisions and all(d.fqn.startswith("layers.") for d in plan.decisions)
    planned = sum(d.recompute_flops for d in plan.decisions)
    for r in _mp.spawn(_fsdp_compile_worker, 2, tmp_path, plan.to_dict()):
        base_flops = r["no plan"]["flops"]
        for variant, v in r.items():
            if variant == "rank":
                continue
            assert v["max_grad_diff"] < 1e-6, (r["rank"], variant)
            assert v["graphs"] >= 2 and v["graph_breaks"] == 0, (r["rank"], variant)
            assert v["flops"] - base_flops == (0 if variant == "no plan" else planned), (r["rank"], variant)
