"""Compiled regions replayed in the fake step (sacplan.compiled_partition, sacplan.compiled_wrapper).

The fast tests check Inductor's wrapper run without kernels, the tracing of regions on fake tensors, and one tiny
planned block against a real compiled step (Inductor on CPU: its C++ compiler runs); the compiled validations
of transformers run under ``-m slow``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import sacplan
from sacplan.alternatives import plan_from_choices
from sacplan.compiled_partition import compiled_step, trace_regions
from sacplan.compiled_wrapper import load_without_kernels, wrapper_source
from sacplan.errors import UnsupportedModelError


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_inductors_wrapper_runs_without_kernels_on_fakes():
    """relu(x @ w) * 2 and its sum: Inductor allocates the matmul's output (8 x 32 float32), fuses relu and the
    multiplication into a kernel that writes that buffer in place (``# reuse``) and the sum into a scalar buffer.
    Run without kernels: the two allocations and the matmul (a library call) run, no pointwise op does."""
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.relu(torch.mm(x, w)) * 2
        return g.t(), g.sum()

    gm = make_fx(f, decomposition_table=select_decomp_table())(torch.randn(8, 16), torch.randn(16, 32))
    with FakeTensorMode() as mode:
        x, w = torch.randn(8, 16), torch.randn(16, 32)
    source, strides = wrapper_source(gm, [x, w], is_inference=True)
    assert "extern_kernels.mm" in source and "# reuse" in source
    assert strides == [(1, 32), ()]  # the transposed view of the (8, 32) buffer, the scalar
    args = [x, w]
    with mode, _Ops() as ops:
        t, s = load_without_kernels(source)(args)
    assert args == []  # boxed: the inputs are the wrapper's to free
    assert ops.ops.count("empty_strided") == 2 and "mm" in ops.ops
    assert not {"relu", "mul", "sum"} & set(ops.ops)
    assert t.shape == (32, 8) and t.stride() == (1, 32) and s.shape == ()
    assert t.untyped_storage().nbytes() == 8 * 32 * 4


def test_random_ops_of_checkpointed_regions_run_as_plain_ops():
    """A checkpointed region's random op (flash attention has a dropout argument) runs in the wrapper as
    ``run_and_save_rng_state`` (the generator state kept for the recomputation: 5056 bytes for CPU's) and
    ``run_with_rng_state``; a dispatch mode (the fake step's recorder) has no rule for higher-order operators:
    they run as the op beside a state-sized tensor."""
    source = (
        "import torch\nfrom torch._inductor.async_compile import AsyncCompile\nasync_compile = AsyncCompile()\n"
        "def call(args):\n"
        "    x, = args\n"
        "    args.clear()\n"
        "    state, y = torch.ops.higher_order.run_and_save_rng_state(torch.ops.aten.relu.default, x)\n"
        "    z = torch.ops.higher_order.run_with_rng_state(state, torch.ops.aten.relu.default, x)\n"
        "    return state, y, z\n"
    )
    with FakeTensorMode() as mode:
        x = torch.randn(4, 8)
    with mode, _Ops() as ops:
        state, y, z = load_without_kernels(source)([x])
    assert state.dtype == torch.uint8 and state.numel() == torch.get_rng_state().numel() == 5056
    assert ops.ops == ["empty", "relu", "relu"] and y.shape == z.shape == (4, 8)


def test_an_unknown_wrapper_is_refused():
    with pytest.raises(UnsupportedModelError, match="unknown form"):
        load_without_kernels("def call(args):\n    return ()\n")


def _mlp(n: int = 3, d: int = 32) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)])


def test_identical_regions_share_one_compilation():
    """Blocks 1 and 2 get the same arguments (an activation that requires grad) and the same plan: one trace for
    both; block 0's input does not require grad, and a plan inside block 1 makes it differ from block 2."""
    x = torch.randn(16, 32)
    found = trace_regions(_mlp, (x,), ["0", "1", "2"])
    assert found["1"] is found["2"] and found["0"] is not found["1"]
    tree = sacplan.ModuleTree(sacplan.collect(_mlp, (x,), device="cpu", optimizer=False))
    plan = plan_from_choices(tree, {"1": None}, "block 1 fully checkpointed")
    planned = trace_regions(_mlp, (x,), ["0", "1", "2"], plan)
    assert planned["1"] is not planned["2"]


class _OneOfTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_a_region_that_did_not_run_is_named():
    with pytest.raises(UnsupportedModelError, match=r"\['b'\] did not run"):
        trace_regions(_OneOfTwo, (torch.randn(2, 4),), ["a", "b"])


def test_compiled_step_of_an_mlp_is_the_eager_step():
    """Inductor saves what eager saves here (each block's first Linear output, read by the GELU's backward, and
    the GELU's output, read by the weight gradient), and its kernels allocate no more than eager's at the peak:
    the compiled step's fake peak is the eager one, within the bias gradients' order (512 bytes here)."""
    x = torch.randn(16, 32)
    eager = sacplan.collect(_mlp, (x,), device="cpu", optimizer=False)
    replayed = compiled_step(_mlp, (x,), ["0", "1", "2"], device="cpu", optimizer=False)
    assert abs(replayed.peak_bytes - eager.peak_bytes) <= 512


def _small(n: int = 2, d: int = 16) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)])


def _within_3_percent_above(r) -> None:
    """Both compiled steps measured at or below their prediction, within 3% (issue 28's target)."""
    assert -0.03 <= r.baseline_peak_error <= 0, r.summary()
    assert -0.03 <= r.peak_error <= 0, r.summary()


def test_a_planned_compiled_step_is_predicted_within_3_percent():
    """Two MLP blocks, block 0 fully checkpointed, each block compiled by Inductor (real C++ kernels on
    this CPU): measured <= predicted, within 3%, without and with the plan (exact when measured, 2026-11-26)."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    tree = sacplan.ModuleTree(sacplan.collect(_small, (x,), device="cpu", optimizer=False))
    plan = plan_from_choices(tree, {"0": None}, "block 0 fully checkpointed")
    r = sacplan.validate(_small, (x,), plan, compile=True, optimizer=False, timed_steps=0)
    assert "2 repeated blocks compiled" in r.compiled
    _within_3_percent_above(r)
    assert r.planned.peak_bytes < r.baseline.peak_bytes


def test_regions_that_cannot_be_traced_keep_the_bound(monkeypatch):
    """Where the regions cannot be compiled on fakes, validate warns and predicts each step from the eager step
    (the bound of sacplan.compiled_saves): at or above the compiled step. Same model and plan as above (the
    compiled graphs are Inductor's cached ones)."""
    import sacplan.validation

    def untraceable(*args, **kwargs):
        raise UnsupportedModelError("no trace in this test")

    monkeypatch.setattr(sacplan.validation, "compiled_step", untraceable)
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    tree = sacplan.ModuleTree(sacplan.collect(_small, (x,), device="cpu", optimizer=False))
    plan = plan_from_choices(tree, {"0": None}, "block 0 fully checkpointed")
    with pytest.warns(UserWarning, match="could not be traced .* without the plan") as caught:
        r = sacplan.validate(_small, (x,), plan, compile=True, optimizer=False, timed_steps=0)
    assert any("with the plan" in str(w.message) for w in caught)
    assert r.predicted_baseline_peak_bytes == tree.stats.peak_bytes  # the eager step's peak
    assert r.baseline_peak_error <= 0 and r.peak_error <= 0, r.summary()


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


@pytest.mark.slow  # ~45 s on 2 loaded cores: Inductor generates the kernels of attention (not compiled)
def test_a_transformer_block_saves_less_under_compile():
    """nn.TransformerEncoderLayer: Inductor decomposes attention and layer norm and recomputes their cheap
    pointwise parts; the compiled step peaks below the eager one."""
    x = torch.randn(4, 32, 64)
    eager = sacplan.collect(_encoder, (x,), device="cpu", optimizer=False)
    replayed = compiled_step(_encoder, (x,), ["layers.0", "layers.1", "layers.2"], device="cpu", optimizer=False)
    assert replayed.peak_bytes < eager.peak_bytes * 0.95


@pytest.mark.slow  # ~2-4 min: Inductor compiles each block's forward and backward, with and without the plan
def test_compiled_transformer_is_predicted_within_3_percent():
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64)
    tree = sacplan.ModuleTree(sacplan.collect(_encoder, (x,), device="cpu", optimizer=False))
    plan = plan_from_choices(tree, {"layers.0": None}, "block 0 fully checkpointed")
    r = sacplan.validate(_encoder, (x,), plan, compile=True, optimizer=False, timed_steps=0)
    assert "3 repeated blocks compiled" in r.compiled
    _within_3_percent_above(r)


@pytest.mark.slow  # ~2-4 min
def test_compiled_llama_with_a_selective_plan_is_predicted_within_3_percent():
    """sacplan's tiny Llama, 4 blocks, planned at half-way between the least feasible budget and the peak (the
    solver saves some matmuls and recomputes the rest): measured <= predicted, within 3%."""
    from sacplan.models import get_model
    from sacplan.solver import min_feasible_budget, solve
    from sacplan.units import Bytes

    p = get_model("llama-tiny")
    x = p.example_inputs(2, 64)

    def build() -> nn.Module:
        return p.build(n_layers=4)

    tree = sacplan.ModuleTree(sacplan.collect(build, x, device="cpu", loss_fn=p.loss_fn, optimizer=False))
    lo, hi = min_feasible_budget(tree), tree.stats.peak_bytes
    plan = solve(tree, Bytes((lo + hi) // 2), gap_rel=0.02, time_limit_s=10)
    assert plan.decisions
    r = sacplan.validate(build, x, plan, loss_fn=p.loss_fn, optimizer=False, compile=True, timed_steps=0)
    _within_3_percent_above(r)
