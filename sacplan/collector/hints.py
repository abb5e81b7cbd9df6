"""What to do when the fake step fails: a remedy chosen by the op that failed, the error and the module running.

Each remedy applies to the op it is given for: a mixture-of-experts setting is suggested only when the
failing module is a mixture-of-experts block (a CTC loss's value-dependent shape used to get it too) whose experts
read it (transformers' ``use_experts_implementation`` classes; Switch Transformers' expert loop does not).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sacplan.collector.fakekernels import UnansweredValue
from sacplan.collector.flex import FlexOnCpuTarget

#: Ops that read a tensor's value (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``).
_READ_OPS = ("_local_scalar_dense", "is_nonzero", "item")
#: Ops whose output shape depends on values (fake tensors have none).
_SHAPE_OPS = ("nonzero", "masked_select", "index.Tensor", "unique", "repeat_interleave", "bincount", "argwhere",
              "_ctc_loss", "masked_scatter", "histc")


def is_moe_block(module: nn.Module | None) -> bool:
    """``module`` (or one of its submodules) routes tokens to experts: a mixture-of-experts block."""
    if module is None:
        return False
    for m in module.modules():
        name = type(m).__name__.lower()
        if "moe" in name or "expert" in name or isinstance(getattr(m, "experts", None), nn.Module):
            return True
    return False


def has_experts_setting(module: nn.Module | None) -> bool:
    """``module`` (or a submodule) runs its experts by ``config._experts_implementation`` (transformers'
    ``use_experts_implementation`` classes keep that config), so a dense kernel can be picked there."""
    return module is not None and any(
        hasattr(getattr(m, "config", None), "_experts_implementation") and hasattr(m, "has_gate") for m in module.modules()
    )


def failure_hint(op: Any, e: BaseException, module: nn.Module | None = None) -> str:
    """What to do when the fake step fails in aten op ``op`` (None: not in an op) with ``e``, while ``module``
    (None: unknown or the top level) was running."""
    name = str(op) if op is not None else ""
    text = str(e)
    moe = is_moe_block(module)
    experts = ("pick a dense experts kernel (transformers: config._experts_implementation = 'batched_mm'), which "
               "has no value-dependent shape")
    if "_grouped_mm" in name and "BF16" in text:
        return ("PyTorch's fake (meta) kernel of aten._grouped_mm accepts only bf16 inputs (the real CPU kernel also "
                f"runs fp32): collect in bf16 (dtype=torch.bfloat16, what a GPU target runs), or {experts}.")
    if isinstance(e, FlexOnCpuTarget):
        return ("Collect for the CUDA target you train on (device='h100', 'a100-80gb'...): there FlexAttention runs "
                "its fused kernel, whose saved output and log-sum-exp sacplan plans for.")
    if isinstance(e, UnansweredValue) and e.random:
        return ("sacplan plans one step and a random draw decides what it runs: turn the draw off while collecting "
                "(transformers: config.layerdrop = 0.0, so every layer runs: the step with the most memory, which a plan "
                "must fit), or pass a train_step without it.")
    if moe and (any(s in name for s in _SHAPE_OPS + _READ_OPS) or type(e).__name__ == "DynamicOutputShapeException"):
        if has_experts_setting(module):
            return (f"this mixture-of-experts block's token routing depends on the weights, which fake tensors do not "
                    f"have: {experts}, or pass a train_step that avoids it.")
        return ("this mixture-of-experts block picks its experts' tokens by value (boolean indexing, nonzero, where) "
                "from a routing that depends on the weights, which fake tensors do not have, and it has no setting "
                "for a dense experts kernel: collect a variant whose experts run on fixed shapes (every expert on "
                "every token, weighted by the routing: the memory upper bound), or pass a train_step that does.")
    if any(s in name for s in _READ_OPS) or type(e).__name__ == "DataDependentOutputException":
        return ("sacplan answers a read of a tensor's value (.item(), .tolist(), a Python `if` on a tensor) from the "
                "real example inputs passed to collect, when the value is computed from them alone. Pass real example "
                "tensors (not a factory), compute the value from the inputs only, move the check out of the forward "
                "(e.g. into the data loader), or pass a train_step that avoids it.")
    if any(s in name for s in _SHAPE_OPS) or type(e).__name__ == "DynamicOutputShapeException":
        return (f"{name or 'an op'} has an output shape that depends on tensor values, which fake tensors do not have; "
                "sacplan takes them from the real example inputs when the values come from those alone (a mask or "
                "lengths from the labels). Pass real example tensors (not a factory), or use a fixed-size form "
                "(torch.where / multiplying by the mask instead of boolean indexing), or pass a train_step that avoids it.")
    if type(e).__name__ == "UnsupportedOperatorException" or "fake impl" in text or "Meta" in text:
        return (f"{name or 'this op'} has no fake (meta) kernel, so its output shapes are unknown on fake tensors: "
                "register one (torch.library.register_fake for a custom op: output shapes from the input shapes), "
                "or call a composite of standard ops while collecting.")
    return ("If the model's constructor or forward needs real data (data-dependent control flow, .item(), numpy), "
            "pass a factory that builds it on the meta device, or a train_step that avoids it.")
