"""Differential fuzzer: random models (:mod:`sacplan.testing.fuzzmodels`) planned at random budgets and checked
against their own unplanned CPU step (:func:`sacplan.testing.fuzzcheck.check_spec`): gradients and buffers
bitwise, measured peak within 1% of the prediction, recomputed FLOPs exact, ``remove_plan`` restores the model.

The default test runs a bounded, derandomized set of examples (the same ones every run, so CI is reproducible);
``-m slow`` runs 500. Failures hypothesis finds are shrunk to the smallest model and kept as named tests in
test_regressions.py.

Constructs whose failures are open in another area (issue 24.1's in-place rule first) are left out of the grammar
drawn here, each named in GRAMMAR with its strict-xfail regression test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from sacplan.testing.fuzzcheck import InvalidModel, check_spec, failures
from sacplan.testing.fuzzmodels import Grammar, ModelSpec, spec_strategy

#: The grammar drawn here: everything, less the constructs whose failures are open in another area, each pinned by
#: a strict-xfail test in test_regressions.py (put them back when those tests XPASS):
#: * conv blocks' activations other than ReLU: the fake ``native_batch_norm_backward`` returns the layout of its
#:   output gradient where the CPU kernel returns a contiguous one (test_batchnorm_backward_layout).
#: * ``F.mse_loss``: its CPU kernel returns a 0-d view of the unreduced loss (test_mse_loss_output_storage).
#: * BatchNorm1d as a ``norm`` layer: in a region with it, a saved ``addmm`` after it runs again on recomputation
#:   (recomputed FLOPs over the plan's; test_*_recomputes_a_saved_matmul).
#: Model sizes (fuzzmodels.draw_spec) put peaks near 1 MiB and up, where the one fixed CPU-only constant left out
#: of the memory model (the 5,056-byte RNG-state copy made while recomputing, test_recomputation_copies_the_rng_state)
#: stays under the 1% tolerance; the regression tests pin it at the small sizes where it shows.
GRAMMAR = Grammar(
    conv_acts=("relu",),
    losses=("square", "mean"),
    norm_options=(0, 1),
)

#: Examples of the default test: about 1-2 s each on a quiet 2-core machine (collect, solve, validate's real steps).
DEFAULT_EXAMPLES = 20
SLOW_EXAMPLES = 500

_COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

SPECS = spec_strategy(GRAMMAR)
#: Budget as a fraction between the minimum feasible (0) and the no-checkpointing peak (1), in hundredths.
FRACTIONS = st.integers(0, 100).map(lambda p: p / 100)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the models are tiny, so threads only add overhead on a shared machine (both the
    planned and the unplanned step run with the same setting; the comparison does not depend on it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def check(spec: ModelSpec, fraction: float) -> None:
    try:
        checks = check_spec(spec, (fraction,))
    except InvalidModel:
        reject()  # torch refuses the model itself (e.g. an in-place ReLU overwriting its producer's saved output)
    msg = failures(spec, checks)
    assert not msg, msg


@settings(max_examples=DEFAULT_EXAMPLES, **_COMMON)
@given(spec=SPECS, fraction=FRACTIONS)
def test_random_models_plans_match_unplanned_step(spec: ModelSpec, fraction: float) -> None:
    check(spec, fraction)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **_COMMON)
@given(spec=SPECS, fraction=FRACTIONS)
def test_random_models_plans_match_unplanned_step_many(spec: ModelSpec, fraction: float) -> None:
    check(spec, fraction)
