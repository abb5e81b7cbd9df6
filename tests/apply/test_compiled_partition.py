"""Inductor's partition replayed in the fake step (sacplan.compiled_partition).

The fast tests check the buffer model and the partition on fake tensors (no code generation); the compiled
validation of a transformer (Inductor on CPU) runs under ``-m slow``."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import sacplan
from sacplan.compiled_partition import BufferReplay, partitioned_step, trace_partitions


def _graph() -> torch.fx.GraphModule:
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.relu(torch.mm(x, w)) * 2  # mm: a library kernel; relu: inlined into the multiplication
        return g.t(), g.sum()

    return make_fx(f)(torch.randn(8, 16), torch.randn(16, 32))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_buffer_replay_allocates_inductors_buffers_only():
    """The matmul's output, the fused relu*2 (an output, through its view) and the sum are buffers; relu is
    computed inside the multiplication's kernel, so nothing allocates it; the view runs on its buffer."""
    gm = _graph()
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    with _Ops() as mode:
        t, s = BufferReplay(gm)([x, w])
    assert mode.ops == ["empty_strided", "empty_strided", "t", "empty_strided"]
    assert t.shape == (32, 8) and t.stride() == (1, 32) and s.shape == () and s.dtype == torch.float32


def test_buffer_replay_frees_inputs_at_their_last_read():
    """Boxed, the replay empties the argument list: an input no longer needed is freed before the graph ends."""
    gm = _graph()
    x = torch.randn(8, 16)
    ref = weakref.ref(x)
    args = [x, torch.randn(16, 32)]
    del x
    alive = []

    class Watch(TorchDispatchMode):  # at each op the replay runs: is x still alive?
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            alive.append(ref() is not None)
            return func(*args, **(kwargs or {}))

    with Watch():
        BufferReplay(gm)(args)
    # the matmul's buffer (x read last there: the input list no longer holds it), then the multiplication's
    assert args == [] and alive[:2] == [True, False]


def _mlp(n: int = 3, d: int = 64) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)])


def test_partitioned_saves_of_an_mlp_block():
    """Inductor's partitioner keeps the first Linear's output (the GELU's backward reads it) and the GELU's output
    (the second Linear's weight gradient reads it): 2 x 32 x 256 float32 per block, the block's input aside.
    Blocks 1 and 2 get the same arguments (an activation that requires grad): one trace for both."""
    parts = trace_partitions(_mlp, (torch.randn(32, 64),), ["0", "1", "2"])
    assert [parts[f].saved_bytes for f in "012"] == [2 * 32 * 256 * 4] * 3
    assert parts["1"] is parts["2"] and parts["0"] is not parts["1"]


def test_partitioned_step_of_an_mlp_is_the_eager_step():
    """Where Inductor saves what eager saves (the MLP above), the replayed fake step peaks where eager does,
    within the bias gradients' order (256 bytes here)."""
    x = torch.randn(32, 64)
    eager = sacplan.collect(_mlp, (x,), device="cpu", optimizer=False)
    replayed = partitioned_step(_mlp, (x,), ["0", "1", "2"], device="cpu", optimizer=False)
    assert abs(replayed.peak_bytes - eager.peak_bytes) <= 256


def test_traces_on_torch_releases_without_the_session_context(monkeypatch):
    """torch 2.11 has no ``torch.compiler._compile_session_context`` (a real H200 run fell back to the eager bound):
    the trace sets the flag ``is_compiling()`` reads itself, and saves the same."""
    x = torch.randn(32, 64)
    with_context = trace_partitions(_mlp, (x,), ["0"])["0"].saved_bytes
    monkeypatch.delattr(torch.compiler, "_compile_session_context")
    assert trace_partitions(_mlp, (x,), ["0"])["0"].saved_bytes == with_context
    assert not torch.compiler.is_compiling()  # the flag is put back


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


def test_a_transformer_block_saves_less_under_compile():
    """nn.TransformerEncoderLayer: Inductor decomposes attention and layer norm and recomputes their cheap
    pointwise parts; the replayed step peaks below the eager one."""
    x = torch.randn(4, 32, 64)
    eager = sacplan.collect(_encoder, (x,), device="cpu", optimizer=False)
    replayed = partitioned_step(_encoder, (x,), ["layers.0", "layers.1", "layers.2"], device="cpu", optimizer=False)
    assert replayed.peak_bytes < eager.peak_bytes * 0.95


@pytest.mark.slow  # ~2-4 min: Inductor compiles each block's forward and backward, with and without the plan
def test_compiled_transformer_without_a_plan_is_predicted_within_3_percent():
    from sacplan.alternatives import plan_from_choices

    torch.manual_seed(0)
    x = torch.randn(4, 32, 64)
    tree = sacplan.ModuleTree(sacplan.collect(_encoder, (x,), device="cpu", optimizer=False))
    plan = plan_from_choices(tree, {"layers.0": None}, "block 0 fully checkpointed")
    r = sacplan.validate(_encoder, (x,), plan, compile=True, optimizer=False, timed_steps=0)
    assert "3 repeated blocks compiled" in r.compiled
    assert -0.03 <= r.baseline_peak_error <= 0, r.summary()
    assert r.peak_error <= 0, r.summary()  # with a plan: the bound of sacplan.compiled_saves
