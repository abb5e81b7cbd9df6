"""sacplan.apply.rng: the generator states a plain region without RNG state is checked against."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from sacplan.apply.rng import generator_states, rng_mismatch
from sacplan.errors import PlanMismatchError


def test_states_change_exactly_when_a_random_number_is_drawn():
    x = torch.ones(4)
    before = generator_states([x])
    assert len(before) == 1 and len(before[0]) == torch.get_rng_state().numel()  # the CPU generator only
    (x * 2).sum()
    assert generator_states([x]) == before
    torch.rand(1)
    assert generator_states([x]) != before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_fake_tensors_of_an_absent_accelerator_add_no_state():
    with FakeTensorMode():
        x = torch.empty(4, device="cuda")
    assert len(generator_states([x])) == 1


def test_the_error_names_the_region_and_says_what_to_do():
    e = rng_mismatch("layers.3.attention", "aten.bernoulli_.float")
    assert isinstance(e, PlanMismatchError)
    assert "'layers.3.attention' draws random numbers (aten.bernoulli_.float)" in str(e) and "Re-plan" in str(e)
