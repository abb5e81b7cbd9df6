"""What the fuzz tests share: hypothesis settings (the same examples every run, so CI is reproducible) and one
intra-op thread while they run (the models are tiny: threads only add overhead on a shared machine; a planned and
an unplanned step run with the same setting, so the comparison does not depend on it)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck

#: Settings of every fuzz test besides ``max_examples``.
FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread in this process (spawned ranks set their own: sacplan.gloo_ranks.join_gloo)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
