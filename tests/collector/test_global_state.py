"""``collect`` leaves no global state behind, whether the step succeeds or raises.

The recorder installs global module hooks (``register_module_forward_pre_hook`` and a ``with_kwargs`` /
``always_call`` ``register_module_forward_hook``), a saved-tensors hook pair and a wrapper around
``torch.UntypedStorage.resize_``. Afterwards every ``torch.nn.modules.module._global_*`` registry, the saved
tensors hooks stack, ``resize_`` and the mode stacks must be exactly as before: a leftover
``_global_forward_hooks_with_kwargs`` entry (torch's handle does not remove it) made every later
``torch.compile``d module warn about global hooks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.modules.module as nn_module
from torch import nn

from sacplan.collector import collect
from sacplan.collector.kernels import HOST_DECOMPOSED_OPS
from sacplan.collector.runtime import RuntimeModel
from sacplan.collector.tracker import StepRecorder
from sacplan.devices import CPU
from sacplan.errors import CollectionError
from sacplan.models import get_model


def _global_state() -> dict:
    state: dict = {
        name: list(value.items())  # ids and hook objects, in order
        for name, value in vars(nn_module).items()
        if name.startswith("_global_") and isinstance(value, dict)
    }
    assert {"_global_forward_hooks", "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
            "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"} <= state.keys()
    state["_global_is_full_backward_hook"] = nn_module._global_is_full_backward_hook
    state["UntypedStorage.resize_"] = vars(torch.UntypedStorage).get("resize_")
    state["saved_tensors_hooks top"] = torch._C._autograd._top_saved_tensors_default_hooks(True)
    state["saved_tensors_hooks enabled"] = torch._C._autograd._saved_tensors_hooks_is_enabled()
    state["dispatch modes"] = torch._C._len_torch_dispatch_stack()
    state["function modes"] = torch._C._len_torch_function_stack()
    state["grad enabled"] = torch.is_grad_enabled()
    for fw, bw in HOST_DECOMPOSED_OPS:  # a CUDA target's collection gives the host these kernels for a while
        for op in (fw, bw):
            state[f"aten::{op} CPU kernel"] = torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CPU")
    return state


def _pack(t):
    return t


def _unpack(t):
    return t


@pytest.fixture(params=["bare", "inside saved_tensors_hooks"])
def outer(request):
    """Run the collection bare, or inside a saved-tensors hooks context that must be on top again after it."""
    if request.param == "bare":
        yield None
    else:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield (_pack, _unpack)


def _check_unchanged(run, outer) -> None:
    before = _global_state()
    assert before["saved_tensors_hooks top"] == outer
    run()
    after = _global_state()
    for key in before:  # one key at a time, so a failure names the registry
        assert after[key] == before[key], key


def test_collect_restores_global_state(outer):
    _check_unchanged(lambda: collect("llama-tiny", device=CPU), outer)


def test_collect_for_a_cuda_target_restores_global_state(outer):
    _check_unchanged(lambda: collect("llama-tiny", device="h100"), outer)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CPU")


class _Boom(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if self.where == "forward":
            raise RuntimeError("boom in forward")
        y = self.lin(x)
        return _FailingBackward.apply(y) if self.where == "backward" else y


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("device", [CPU, "h100"], ids=["cpu", "h100"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_collect_that_raises_restores_global_state(outer, where, device):
    model = nn.Sequential(nn.Linear(8, 8), _Boom(where))

    def run():
        with pytest.raises(CollectionError, match=f"boom in {where}"):
            collect(model, (torch.randn(4, 8),), device=device)

    _check_unchanged(run, outer)


def test_recorder_that_fails_to_enter_restores_global_state(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    def fail(self):
        raise RuntimeError("cannot push the mode")

    rec = StepRecorder(nn.Linear(2, 2), CPU, RuntimeModel(CPU))
    monkeypatch.setattr(TorchDispatchMode, "__enter__", fail)

    def run():
        with pytest.raises(RuntimeError, match="cannot push"):
            rec.__enter__()

    _check_unchanged(run, None)


def test_torch_compile_after_collect_does_not_see_global_hooks():
    if nn_module._has_any_global_hook():
        pytest.skip("global module hooks were registered before this test (not by sacplan.collect)")
    collect("llama-tiny", device=CPU)
    assert not nn_module._has_any_global_hook()
    torch._dynamo.reset()
    try:
        model = get_model("llama-tiny").build(n_layers=1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.compile(model, backend="eager")(torch.zeros(1, 8, dtype=torch.long))
    finally:
        torch._dynamo.reset()
    assert not [w for w in seen if "global hooks" in str(w.message)]


class _ReadsLabels(nn.Module):
    """Reads a value (answered from the real labels) and runs a CTC loss (a fake kernel of the collection)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, x, labels):
        assert labels.max() < 5
        log_probs = self.lin(x).log_softmax(-1).transpose(0, 1)
        lengths = (labels > 0).sum(-1)
        return nn.functional.ctc_loss(log_probs, labels[labels > 0], torch.full((2,), 6), lengths)


@pytest.mark.parametrize("device", [CPU, "h100"], ids=["cpu", "h100"])
def test_collect_answering_values_restores_global_state(outer, device):
    import torch._dynamo
    import torch.nn.attention.flex_attention as fa

    labels = torch.tensor([[1, 2, 0], [3, 0, 0]])
    flex = (fa.flex_attention_hop, fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)
    compile_disabled = torch._dynamo.config.disable
    _check_unchanged(lambda: collect(_ReadsLabels(), (torch.randn(2, 6, 8), labels), device=device,
                                     loss_fn=lambda out: out), outer)
    assert (fa.flex_attention_hop, fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG) == flex
    assert torch._dynamo.config.disable == compile_disabled
