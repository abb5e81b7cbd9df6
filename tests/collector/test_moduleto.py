"""``Module.to()`` inside a collected forward (sacplan.collector.moduleto) and the hint an experts loop gets
(sacplan.collector.hints): Switch Transformers' router casts its classifier to its own dtype on every call, and
its experts pick tokens with ``nonzero``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sacplan
from sacplan.collector.hints import failure_hint, has_experts_setting
from sacplan.collector.moduleto import unchanged_module_to
from sacplan.errors import CollectionError


class CastingRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(torch.float32)  # as Switch's router: its own dtype, a no-op
        return self.classifier(x)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x)


def test_a_cast_to_its_own_dtype_inside_the_forward_collects_as_without_it():
    x = torch.randn(8, 16)
    cast = sacplan.collect(CastingRouter, (x,), device="cpu", optimizer=False)
    plain = sacplan.collect(Plain, (x,), device="cpu", optimizer=False)
    assert cast.peak_bytes == plain.peak_bytes and cast.events == plain.events


def test_other_conversions_still_convert_and_to_is_restored():
    original = nn.Module.to
    with unchanged_module_to():
        m = nn.Linear(4, 4)
        assert m.to(torch.float32) is m and m.to("cpu") is m
        assert m.to(torch.float64).weight.dtype == torch.float64  # a real change runs nn.Module.to
    assert nn.Module.to is original


class LoopExperts(nn.Module):
    """Switch's experts: a token loop by value, no ``config._experts_implementation``."""

    def __init__(self) -> None:
        super().__init__()
        self.expert_0, self.expert_1 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for i, expert in enumerate((self.expert_0, self.expert_1)):
            (idx,) = torch.where(route == i)
            out.index_add_(0, idx, expert(x[idx]))
        return out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 2)
        self.experts = LoopExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x).argmax(-1))


def test_an_experts_loop_without_a_dense_setting_gets_a_remedy_that_applies():
    with pytest.raises(CollectionError) as err:
        sacplan.collect(MoE, (torch.randn(8, 16),), device="cpu", optimizer=False)
    msg = str(err.value)
    assert "'experts'" in msg and "nonzero" in msg and "no setting for a dense experts kernel" in msg
    assert "_experts_implementation" not in msg


def test_the_dense_experts_setting_is_named_only_where_the_experts_read_it():
    class Config:
        _experts_implementation = None

    class Experts(nn.Module):  # as transformers' use_experts_implementation classes keep them
        def __init__(self) -> None:
            super().__init__()
            self.config, self.has_gate = Config(), True

    e = RuntimeError("aten.nonzero.default")
    assert has_experts_setting(Experts()) and not has_experts_setting(LoopExperts())
    assert "_experts_implementation = 'batched_mm'" in failure_hint("aten.nonzero.default", e, Experts())
    assert "_experts_implementation" not in failure_hint("aten.nonzero.default", e, LoopExperts())
