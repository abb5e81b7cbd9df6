"""validate(): real CPU steps against predictions — the judge of the memory model."""

from __future__ import annotations

import pytest

from sacplan.solver import solve
from sacplan.validation import validate

#: Predicted vs measured peak must agree this closely (the issue asks for 5%; the model achieves <1%
#: on these models because the tracker's timeline and the allocator's events see the same tensors).
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def llama_reports(llama_setup):
    model_fn, inputs_fn, loss_fn, tree = llama_setup
    reports = []
    for frac in (0.85, 0.7, 0.55):
        plan = solve(tree, int(tree.stats.peak_bytes * frac))
        reports.append((frac, plan, validate(model_fn, inputs_fn, plan, loss_fn=loss_fn, device="cpu")))
    return reports


def test_measured_peak_falls_with_budget(llama_reports):
    peaks = [r.planned.peak_bytes for _, _, r in llama_reports]
    assert peaks[0] > peaks[1] > peaks[2]
    assert all(r.planned.peak_bytes < r.baseline.peak_bytes for _, _, r in llama_reports)


def test_predicted_peak_matches_measured(llama_reports):
    for frac, plan, r in llama_reports:
        assert abs(r.baseline_peak_error) < TOLERANCE, r.summary()
        assert abs(r.peak_error) < TOLERANCE, r.summary()
        # The plan was solved on the same host stats, so its own prediction is this host's prediction.
        assert r.predicted_peak_bytes <= plan.budget_bytes
        assert r.planned.peak_bytes <= plan.budget_bytes * (1 + TOLERANCE)


def test_recompute_flops_and_gradients(llama_reports):
    for _, plan, r in llama_reports:
        assert r.measured_recompute_flops == r.predicted_recompute_flops
        assert r.predicted_recompute_flops == sum(d.recompute_flops for d in plan.decisions)
        assert r.grads_bitwise_equal and r.grads_match


def test_tracker_cross_checks_profiler(llama_reports):
    for _, _, r in llama_reports:
        for m in (r.baseline, r.planned):
            assert m.tracker_peak_bytes is not None
            assert abs(m.tracker_peak_bytes - m.peak_bytes) / m.peak_bytes < TOLERANCE


def test_cnn(cnn_setup):
    model_fn, inputs_fn, loss_fn, tree = cnn_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.8))
    r = validate(model_fn, inputs_fn, plan, loss_fn=loss_fn, device="cpu")
    assert abs(r.peak_error) < 0.05, r.summary()
    assert r.measured_recompute_flops == r.predicted_recompute_flops
    assert r.grads_match
    assert "predicted" in r.summary()


def test_plan_for_gpu_is_repredicted_on_host(llama_setup):
    """A plan made for an H100 is re-evaluated on this host's stats before comparing."""
    from sacplan.collector import collect
    from sacplan.solver import min_feasible_budget
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes

    model_fn, inputs_fn, loss_fn, _ = llama_setup
    stats = collect(model_fn, inputs_fn(), device="h100", loss_fn=loss_fn)
    tree = ModuleTree(stats)  # midway: the H100's 64 MiB of cuBLAS workspaces are a large part of this tiny peak
    plan = solve(tree, Bytes((int(min_feasible_budget(tree)) + stats.peak_bytes) // 2))
    r = validate(model_fn, inputs_fn, plan, loss_fn=loss_fn, device="cpu")
    assert r.plan_predicted_peak_bytes == plan.predicted_peak_bytes
    assert abs(r.peak_error) < 0.05, r.summary()
    assert r.grads_bitwise_equal


def test_cuda_requested_without_cuda(llama_setup):
    import torch

    from sacplan.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    model_fn, inputs_fn, loss_fn, tree = llama_setup
    plan = solve(tree, int(tree.stats.peak_bytes * 0.8))
    with pytest.raises(ConfigError, match="CUDA"):
        validate(model_fn, inputs_fn, plan, device="cuda")


def test_rerun_difference_measures_kernel_noise():
    """On CUDA validate runs the baseline's first backward twice; the difference is what nondeterministic kernels
    change by themselves (a plan within twice that matches). Here a model whose every call differs slightly."""
    import torch
    from torch import nn

    from sacplan.validation import _rerun_difference

    class Drifting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x) * (1 + self.calls * 1e-3)

    torch.manual_seed(0)
    m, x = Drifting(), torch.randn(3, 4)

    def loss(out, args):
        return out.sum()

    loss(m(x), (x,)).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    noise = _rerun_difference(m, (x,), loss, 1, grads)
    # the scale moved from 1.001 to 1.002: weight gradient = column sums of x times it, bias gradient = 3 rows times it
    expected = max(float((x.sum(0).abs() * 1e-3).max()), 3 * 1e-3)
    assert noise == pytest.approx(expected, rel=1e-4)
    m.calls = 0
    still = nn.Linear(4, 4)
    loss(still(x), (x,)).backward()
    assert _rerun_difference(still, (x,), loss, 1, [p.grad.clone() for p in still.parameters()]) == 0.0
