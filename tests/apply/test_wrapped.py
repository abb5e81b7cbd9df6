"""Fingerprints and module names through wrappers: ``load_plan(model=...)`` and ``apply_plan`` agree.

A plan is made on the bare model; the model it is loaded or applied onto may be wrapped in
``torch.compile`` (whole model or block by block), checkpoint wrappers, DDP or FSDP2 ``fully_shard``
(2 gloo ranks, the harness of ``tests/distributed``). The wrapped model must be accepted exactly when its
unwrapped architecture matches, and fingerprints of bare models must stay those sacplan has always written
(plan files saved before must still load).
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from torch import nn

from sacplan.apply import applied_plan, apply_plan
from sacplan.errors import PlanMismatchError
from sacplan.fingerprint import canonical_fqn, canonical_names, is_wrapper, model_fingerprint
from sacplan.models import get_model, list_models
from sacplan.plan import ModuleDecision, load_plan
from sacplan.solver import solve
from tests.distributed import _mp


def _legacy_fingerprint(model: nn.Module) -> str:
    """``model_fingerprint`` as sacplan computed it before it looked through wrappers (frozen copy)."""

    def canon(fqn: str) -> str:
        for w in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.", "_orig_mod."):
            fqn = fqn.replace(w, "")
            if fqn.startswith(w):
                fqn = fqn[len(w) :]
        return fqn

    h = hashlib.sha256()
    for name, mod in model.named_modules():
        if type(mod).__name__ in ("DistributedDataParallel", "OptimizedModule", "CheckpointWrapper"):
            continue
        h.update(f"m:{canon(name)}:{type(mod).__name__};".encode())
    for name, p in model.named_parameters():
        h.update(f"p:{canon(name)}:{tuple(p.shape)};".encode())
    for name, b in model.named_buffers():
        h.update(f"b:{canon(name)}:{tuple(b.shape)};".encode())
    return h.hexdigest()[:32]


class Residual(nn.Module):
    """A user module that holds its body in an attribute called ``module`` (a wrapper's name)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return x + self.module(x)


class UserNames(nn.Module):
    """Module names that contain wrapper names without any wrapper: ``blocks.0.module``, ``enc_module.0``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            Residual(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))),
            Residual(nn.Linear(16, 16)),
        )
        self.enc_module = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x):
        return self.enc_module(self.blocks(x))


# ------------------------------------------------------------------------------------- bare models
def test_bare_model_fingerprints_are_unchanged():
    for preset in list_models():
        with torch.device("meta"):
            m = preset.build()
        assert model_fingerprint(m) == _legacy_fingerprint(m), preset.name
        assert set(canonical_names(m).values()) == {n for n, _ in m.named_modules()}, preset.name
    m = UserNames()
    assert model_fingerprint(m) == _legacy_fingerprint(m)
    # pinned: what sacplan wrote into plan files for these presets
    assert model_fingerprint(get_model("llama-tiny").build()) == "18a89a3c5395e24af13bf34958af72f8"
    assert model_fingerprint(get_model("cnn-tiny").build()) == "5af50ad478d2e8c54522900e35fce4e2"


def test_user_modules_named_like_wrappers_keep_their_names(tmp_path):
    """``module`` / ``enc_module`` are the user's names: matched exactly, fingerprinted as before."""
    from sacplan.collector import collect
    from sacplan.devices import CPU
    from sacplan.tree import ModuleTree

    names = canonical_names(UserNames())
    assert names == {n: n for n in names} and "blocks.0.module" in names and "enc_module.0" in names
    x = torch.randn(4, 16)
    stats = collect(UserNames, (x,), device=CPU, loss_fn=lambda out, args: out.square().mean())
    base = solve(ModuleTree(stats), f"{stats.peak_bytes * 2}B")  # no checkpointing needed: decisions set below
    plan = dataclasses.replace(
        base, decisions=(ModuleDecision("blocks.0.module"), ModuleDecision("blocks.1"), ModuleDecision("enc_module.0"))
    )
    assert load_plan(plan.save(tmp_path / "p.json"), model=UserNames()) == plan
    torch.manual_seed(0)
    model = UserNames()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(x).square().mean().backward()
    g0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    apply_plan(model, plan)
    assert applied_plan(model) is plan
    mods = dict(model.named_modules())
    assert {n for n, m in mods.items() if "forward" in m.__dict__} == {"blocks.0.module", "blocks.1", "enc_module.0"}
    model(x).square().mean().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p, ref[n]) and torch.equal(p.grad, g0[n]), n


# ---------------------------------------------------------------------------- torch.compile / wrappers
@pytest.fixture(scope="module")
def plan_file(llama_setup, tmp_path_factory):
    _, _, _, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.7))
    assert plan.decisions
    return plan, plan.save(tmp_path_factory.mktemp("plan") / "p.json")


def _compile_blocks(model):
    for i, blk in enumerate(model.layers):
        model.layers[i] = torch.compile(blk, backend="eager")
    return model


def _checkpoint_blocks(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, blk in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(blk)
    return model


_WRAPS = {
    "compile": lambda m: torch.compile(m, backend="eager"),
    "compile blocks": _compile_blocks,
    "compile blocks and root": lambda m: torch.compile(_compile_blocks(m), backend="eager"),
    "checkpoint_wrapper blocks": _checkpoint_blocks,
}


@pytest.mark.parametrize("wrap", list(_WRAPS))
def test_load_plan_accepts_wrapped_model(llama_setup, plan_file, wrap):
    model_fn = llama_setup[0]
    plan, path = plan_file
    bare = model_fn()
    wrapped = _WRAPS[wrap](model_fn())
    assert {n for n, _ in wrapped.named_modules()} != {n for n, _ in bare.named_modules()}
    assert model_fingerprint(wrapped) == model_fingerprint(bare) == plan.fingerprint
    assert set(canonical_names(wrapped).values()) == {n for n, _ in bare.named_modules()}
    loaded = load_plan(path, model=wrapped)
    assert loaded == plan
    if not wrap.startswith("checkpoint_wrapper"):
        apply_plan(wrapped, loaded)  # the same model apply_plan accepts
        assert applied_plan(wrapped) is loaded
        names = canonical_names(wrapped)
        mods = {names[n] for n, m in wrapped.named_modules() if "forward" in m.__dict__ and not is_wrapper(m)}
        assert set(mods) == {d.fqn for d in plan.decisions}


@pytest.mark.parametrize("wrap", list(_WRAPS))
def test_load_plan_rejects_other_wrapped_model(plan_file, wrap):
    from sacplan.models.llama import Llama

    _, path = plan_file
    cfg = get_model("llama-tiny").config
    fewer = _WRAPS[wrap](Llama(cfg.with_(n_layers=2)))
    with pytest.raises(PlanMismatchError, match="does not have|fingerprint"):
        load_plan(path, model=fewer)
    wider = _WRAPS[wrap](Llama(cfg.with_(n_layers=4, dim=128)))
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        load_plan(path, model=wider)
    with pytest.raises(PlanMismatchError, match="another model"):
        apply_plan(wider, load_plan(path))


def test_canonical_fqn_drops_wrapper_segments():
    assert canonical_fqn("module.layers.0.attn") == "layers.0.attn"
    assert canonical_fqn("_orig_mod.layers.0._orig_mod.attn.wq.weight") == "layers.0.attn.wq.weight"
    assert canonical_fqn("layers.0._orig_mod") == "layers.0"
    assert canonical_fqn("layers.0._checkpoint_wrapped_module") == "layers.0"
    assert canonical_fqn("module") == canonical_fqn("_orig_mod") == ""
    assert canonical_fqn("layers.0.attn") == "layers.0.attn"


# ----------------------------------------------------------------------------------- DDP / FSDP2
def _load_wrapped(rank: int, ws: int, path: str, plan_dict: dict) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sacplan.models.llama import Llama
    from sacplan.plan import Plan

    plan = Plan.from_dict(plan_dict)
    cfg = get_model("llama-tiny").config
    out: dict = {}

    def fsdp(m):
        for blk in m.layers:
            fully_shard(blk)
        fully_shard(m)
        return m

    for mode, wrap in (("ddp", DDP), ("fsdp", fsdp)):
        torch.manual_seed(0)
        model = wrap(Llama(cfg.with_(n_layers=4, dropout=0.1)))  # the plan's model (conftest.llama_setup)
        out[f"{mode}_type"] = type(model).__name__
        out[f"{mode}_fingerprint"] = model_fingerprint(model)
        out[f"{mode}_loads"] = load_plan(path, model=model) == plan
        apply_plan(model, plan)
        out[f"{mode}_applied"] = applied_plan(model) is plan
        for kind, other in (("fewer", cfg.with_(n_layers=2)), ("wider", cfg.with_(n_layers=4, dim=128))):
            try:
                load_plan(path, model=wrap(Llama(other)))
                out[f"{mode}_{kind}"] = "accepted"
            except PlanMismatchError as e:
                out[f"{mode}_{kind}"] = str(e)
    return out


def _worker(rank: int, ws: int, rdzv: str, path: str, plan_dict: dict, q) -> None:
    _mp.init(rank, ws, rdzv)
    _mp.guarded(rank, q, lambda: _load_wrapped(rank, ws, path, plan_dict))


@pytest.mark.distributed
def test_load_plan_accepts_ddp_and_fsdp2_wrapped_model(plan_file, tmp_path):
    plan, path = plan_file
    for r in _mp.spawn(_worker, 2, tmp_path, str(path), plan.to_dict()):
        assert r["ddp_type"] == "DistributedDataParallel" and r["fsdp_type"] == "FSDPLlama"
        for mode in ("ddp", "fsdp"):
            assert r[f"{mode}_fingerprint"] == plan.fingerprint
            assert r[f"{mode}_loads"] and r[f"{mode}_applied"]
            assert "does not have" in r[f"{mode}_fewer"] or "field 'fingerprint'" in r[f"{mode}_fewer"]
            assert "field 'fingerprint'" in r[f"{mode}_wider"]
