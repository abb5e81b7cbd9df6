"""Failures the differential fuzzer (test_fuzz.py) found, each shrunk to its smallest model and kept as a named test.

Each test runs the full check of :func:`sacplan.testing.fuzzcheck.check_spec` (gradients and buffers bitwise,
peak within 1%, recomputed FLOPs exact, ``remove_plan`` restores) at the budget that failed. Fixed ones pass; open
ones are ``xfail(strict=True)`` with their root cause, so the fix that lands turns them into a failure to
notice ("XPASS(strict)"): then drop the mark (and widen test_fuzz.py's grammar where it left the case out).
"""

from __future__ import annotations

import dataclasses

import pytest

from sacplan.testing.fuzzcheck import check_compiled, check_spec, failures
from sacplan.testing.fuzzmodels import Layer, ModelSpec

# one_thread: an autouse fixture, as test_fuzz.py (the CPU attention workspace follows the thread count)
from tests.fuzz._settings import one_thread  # noqa: F401


def assert_exact(spec: ModelSpec, fraction: float = 0.0) -> None:
    msg = failures(spec, check_spec(spec, (fraction,)))
    assert not msg, msg


# ------------------------------------------------------------------------------------------ fixed
def test_linear_called_twice_on_a_transposed_input() -> None:
    """The ``Linear`` of ``Twice`` copies its non-contiguous first input (a conv's transposed output) and keeps
    nothing of its own on the second call: ``select_candidates`` divided the stashed RNG state by those 0 bytes
    (ZeroDivisionError in ``solve``). Fixed in sacplan/solver/candidates.py ``_overheads``."""
    spec = ModelSpec(layers=(Layer("conv1d"), Layer("twice")), dim=64, batch=2, seq=32)
    assert_exact(spec, 0.0)


def test_mean_loss_gradient_reaches_the_head_expanded() -> None:
    """``out.mean()``'s gradient reaches the head ``Linear`` with stride 0; the CPU ``mm`` copies it into a
    contiguous temporary (one activation more than predicted: +4 KiB, +15% on this model). Fixed in
    sacplan/collector/workspace.py (measured like the other CPU workspaces)."""
    assert_exact(ModelSpec(layers=(), dim=16, batch=4, seq=16, loss="mean"), 0.0)


def test_cpu_flash_attention_workspace() -> None:
    """The CPU flash attention kernels allocate score blocks and accumulators beyond their outputs: +2.7% over the
    predicted peak on one attention layer. Fixed in sacplan/collector/workspace.py (measured)."""
    assert_exact(ModelSpec(layers=(Layer("attention"),), dim=32, seq=16), 0.0)


def test_batchnorm_backward_layout() -> None:
    """Conv1d → BatchNorm1d → GELU over a transposed sequence: GELU's backward hands BatchNorm a non-contiguous
    gradient. The CPU ``native_batch_norm_backward`` returns a contiguous grad_input (the input's layout); the fake
    (torch's meta kernel) returned the gradient's layout, so the convolution backward's workspace was measured for
    a non-contiguous gradient it never sees: predicted peak one activation too high (-8,192 B, -3.4%). Fixed in
    sacplan/collector/fakekernels.py (``LAYOUT_KERNELS``: grad_input in the input's suggested memory format, as
    the CPU, native CUDA and cuDNN kernels allocate it)."""
    assert_exact(ModelSpec(layers=(Layer("conv1d", act="gelu"),), dim=64, seq=16), 0.0)


def test_mse_loss_output_storage() -> None:
    """``F.mse_loss(out, target)`` (mean): the kernel computes the elementwise loss into an input-sized tensor and
    returns the mean as a 0-d tensor on that storage (``resize_({})`` keeps the bytes), so the loss holds
    input-sized bytes (8 KiB here) until it is freed; the fake result had a 4-byte storage: predicted peak one
    activation too low (+2% on this model). Fixed in sacplan/collector/fakekernels.py (``LAYOUT_KERNELS``:
    mse / smooth L1 / BCE / soft margin, CPU and CUDA alike) and the losses' input-sized temporaries in
    sacplan/collector/workspace.py."""
    assert_exact(ModelSpec(layers=(Layer("linear"),) * 2, dim=64, seq=16, loss="mse_loss"), 0.0)


def test_attention_batchnorm_kwargs_region_recomputes_a_saved_matmul() -> None:
    """A ``Sequential`` region of attention, BatchNorm1d over the transposed sequence and a sub-module called with
    keyword arguments, checkpointed with ``addmm`` #0, #2, #3, the attention kernel, ``add_`` and the batch norm
    saved: ``FlopCounterMode`` counted 196,608 recomputed FLOPs where the plan predicted 131,072, and the planned
    peak was +2,560 B over. Root cause (a per-op log of the policy's decisions against the collected op list):
    not the keys on recomputation but the forward itself. The CPU ``native_batch_norm`` returns a contiguous
    output, the meta kernel kept the transposed input's strides; transposed back, the real output is not
    contiguous, so the next ``Linear`` runs ``clone`` + ``mm`` where the fake step ran ``view`` + ``addmm``: the
    plan's ``addmm`` keys after the batch norm named other ops (or none) in the real step. Fixed in
    sacplan/collector/fakekernels.py (``native_batch_norm`` laid out as the target's kernel lays it);
    tests/apply/test_op_keys.py pins the keys."""
    spec = ModelSpec(layers=(Layer("seq", children=(Layer("attention"), Layer("norm", option=2), Layer("kwargs"))),
                             Layer("shape", option=1)), dim=32, batch=2, seq=16, loss="mean")
    assert_exact(spec, 0.0)


def test_gelu_backward_workspace_after_a_conv_block() -> None:
    """Found by ``benchmarks/fuzz.py --seeds 0:500`` once conv blocks drew every activation (seed 46: planned and
    unplanned peaks +4.2%, +65,536 B, with sacplan's tracker on the real tensors equal to the prediction: bytes no
    op output holds). Shrunk: Conv1d → BatchNorm1d → GELU, transposed back, under ``mse_loss``: +16,128 B
    (+2.34%). The CPU ``gelu_backward`` (exact GELU) keeps two input-sized temporaries when its output gradient
    (transposed) is not laid out as its input. Fixed in sacplan/collector/workspace.py (measured like the other
    CPU workspaces)."""
    assert_exact(ModelSpec(layers=(Layer("conv1d", act="gelu"),), dim=64, batch=4, seq=64, loss="mse_loss"), 1.0)


def test_custom_function_batchnorm_region_recomputes_a_saved_matmul() -> None:
    """``body`` (a custom ``autograd.Function`` block, BatchNorm1d over the transposed sequence, a slice + cat
    block) checkpointed: the plan saved ``addmm`` #1, ``FlopCounterMode`` counted 3,145,728 recomputed FLOPs where
    the plan predicted 0 and the peak was +7% over. Two causes, both in the collector: the batch norm output
    layout of the attention test above (the real step runs ``clone`` + ``mm`` after the batch norm: fixed with
    it, the FLOPs are exact), then +62,976 B that sacplan's tracker did not see on the real tensors: the custom
    Function's backward runs exact GELU's backward on a transposed gradient, whose CPU kernel keeps two
    input-sized temporaries (fixed with test_gelu_backward_workspace_after_a_conv_block)."""
    spec = ModelSpec(layers=(Layer("custom"), Layer("norm", option=2), Layer("seq", children=(Layer("shape", option=2),))),
                     dim=128, batch=3, seq=32)
    assert_exact(spec, 0.38)


def test_tied_weight_gradients_accumulate_out_of_place() -> None:
    """The first failure of ``-m slow`` after the fixes above (shrunk by hypothesis): two ``Linear`` layers and
    the head tied to the input projection: unplanned and planned peaks +32,768 B (+5.85%), with sacplan's
    tracker on the real tensors equal to the prediction. The tied weight's two gradients are summed by the
    engine's input buffer out of place: the first is ``mm(...).t()``, a view, whose storage its base shares, so
    ``can_accumulate_inplace`` refuses; the collector counted the sum in place. Fixed in
    sacplan/collector/tracker.py ``accumulation_input`` (a view is never summed in place)."""
    assert_exact(ModelSpec(layers=(Layer("linear", heads=2), Layer("linear", heads=2)), dim=128, seq=32, tie=True), 0.0)


def test_linear_after_transposed_batchnorm_forward_peak_over_predicted() -> None:
    """The first failure of ``-m slow`` after the batch norm layout fixes (example 19, shrunk by hypothesis, fraction
    0): unplanned and planned peaks predicted 515.27 KiB, measured 484.78 KiB (-31,224 B, -6.29%), sacplan's
    tracker on the *real* tensors saying 515.27 KiB too; BatchNorm1d was left out of the checked grammar for it.
    Root cause (per-op log, 2026-11-26: the tracker on the real tensors against the allocator's profiler events,
    each op marked): ``fc(x * scale + pos)`` on the transposed BatchNorm output runs ``at::linear``'s matmul path
    (``clone`` + ``mm``), whose bias add is ``output.add_(bias)`` on plain tensors but ``at::add(output, bias)``
    under any Python dispatch mode (``isTensorSubclassLike``, "composite compliance"): the tracker's own mode made
    the real step hold the matmul output and the sum at once (the allocator under a marking dispatch mode also read
    527,640 B; without one, 496,416 B). Fixed in sacplan/collector/linearbias.py (the bias add's peak deferred as
    the engine's gradient accumulation is: counted only if the matmul output outlives it) and
    sacplan/collector/tracker.py: a fake tensor's ``prim.device`` query, which ``linear`` makes after the add
    while the matmul output is still alive, no longer settles a deferred peak (on fakes it counted the peak)."""
    spec = ModelSpec(layers=(Layer("buffers"), Layer("norm", option=2), Layer("buffers", dropout=0.25),
                             Layer("norm", dropout=0.25, heads=2, kv_heads=2)),
                     dim=64, batch=3, seq=64, tie=True, seed=15721, loss="mean")
    assert_exact(spec, 0.0)


# ------------------------------------------------------------------------------------------ RNG state (fixed)
def test_recomputation_copies_the_rng_state() -> None:
    """``torch.utils.checkpoint`` recomputes under ``torch.random.fork_rng``, which copies the CPU generator's state
    (``torch.get_rng_state()``, 5,056 B) for the length of the recomputation, on top of the state stashed at the
    forward (``checkpoint_state_bytes``). The planned peak lay in the recomputation of ``body``: 832 B over the
    prediction (+1.3%); elsewhere +5,056 B.

    Fixed by construction (sacplan/devices.py ``checkpoint_state_bytes``, sacplan/stats.py ``draws_random``): no
    region here draws random numbers, so the plan says ``preserve_rng_state=False`` and ``apply`` checkpoints
    without the state (no stash, no copy; nothing to replay, so the same gradients); the model keeps none."""
    spec = ModelSpec(layers=(Layer("seq", children=(Layer("linear", act="silu"),)), Layer("linear", act="silu")),
                     dim=32, batch=2, seq=16, vocab=64)
    assert_exact(spec, 0.0)


def test_rng_copy_outside_the_stretch_peak() -> None:
    """The counter-example to adding the copy at every rc event: here the rc stretch peaks in the loss's backward,
    before the recomputation starts; must stay exact.

    Measured 2026-11-26 (the tracker on the planned real step, ``torch.get_rng_state`` registered): the real peak,
    235,464 B, is in the loss's backward; ``body``'s recomputation starts at 186,312 B live, the fork_rng copy
    brings it to 191,368 and the one op it really recomputes to 207,752. The model's rc value for ``body``,
    235,464 without the copy, is the base at ``body``'s backward start (197,640) with every discarded tensor
    back plus the transient (32,768): a selective recomputation that takes cached ops from the cache
    re-materialises less than that. No region draws random numbers, so no region keeps the state or copies it
    (the test above); for one that does, sacplan/evaluate.py ``rng_copy_bytes`` adds the copy at its rc events,
    where a stretch like this one's comes out over by at most the copy, never under."""
    assert_exact(ModelSpec(layers=(Layer("linear"),) * 3, dim=64, seq=32), 0.0)


@pytest.mark.parametrize("fraction", [0.0, 0.3])
def test_recomputation_with_dropout_copies_the_rng_state(fraction: float) -> None:
    """Attention with dropout (the CPU math path: ``bernoulli_`` in the region) must replay its random numbers, so
    its region keeps the RNG state and its recomputation holds ``fork_rng``'s copy: without the copy in the model
    the planned peak was +5,056 B (+6.1%) at fraction 0 and +3,008 B (+3.6%) at 0.3. Fixed in
    sacplan/evaluate.py ``rng_copy_bytes`` (evaluation and solver)."""
    assert_exact(ModelSpec(layers=(Layer("attention", dropout=0.25),), dim=32, seq=16), fraction)


# ------------------------------------------------------------------------------------------ in place (issue 24.1)
# Before main's in-place safety rule (issue 24.1) these gave an autograd error or wrong gradients; since it, the
# gradients are bitwise; three then failed on the peak alone (+5,056 B: the RNG-state copy, fixed above).
def test_inplace_silu_module_alone() -> None:
    """``Linear`` → ``SiLU(inplace=True)`` three times: each activation module mutates its own input (was: "one of
    the variables needed for gradient computation has been modified by an inplace operation")."""
    assert_exact(ModelSpec(layers=(Layer("linear", act="silu", inplace=True),) * 3, dim=64, seq=32), 0.0)


def test_inplace_hardswish_module_alone() -> None:
    """``Linear`` → ``Hardswish(inplace=True)``, then a ``Linear`` (was: autograd's in-place error)."""
    assert_exact(ModelSpec(layers=(Layer("linear", act="hardswish", inplace=True), Layer("linear")), dim=64, seq=32), 0.0)


def test_inplace_functional_silu_after_linear() -> None:
    """``F.silu(up(x), inplace=True)`` inside an MLP region whose plan saved ``addmm`` and ``silu_``: gradients
    differed (max |diff| 3e-6) before issue 24.1's rule."""
    assert_exact(ModelSpec(layers=(Layer("mlp", act="silu", inplace=True),) * 2, dim=64, seq=32), 0.0)


def test_inplace_arithmetic_on_a_saved_output() -> None:
    """``h = fc(x); h += x; h *= gain`` (``gain`` a parameter) in one region: the plan saved ``addmm`` / ``add_``
    outputs that later ops of the region mutate in place (gradients differed by up to 6e-3 before issue 24.1's
    rule; the module is now checkpointed whole)."""
    assert_exact(ModelSpec(layers=(Layer("inplace"),), dim=64, batch=3, seq=32), 0.0)


def test_inplace_sigmoid_add_region_recomputes_at_its_first_unpack() -> None:
    """Found by the default grammar's examples without shrinking (2026-11-26; on main too): ``h = fc(x);
    h += x; h.add_(h.sigmoid()); h *= 0.5`` checkpointed whole (no RNG state). Predicted 594.01 KiB (608,264 B,
    ``body``'s backward), measured 578.02 KiB (the loss's backward); sacplan's tracker on the real planned step
    agrees with the allocator, and the unplanned prediction is exact.

    Root cause (the allocator's per-op log of the planned and unplanned steps, 2026-11-26): the memory model
    brings a checkpointed call's discarded bytes back at its backward's start (its rc event, then its bw events
    at the unplanned level). ``torch.utils.checkpoint`` (non-reentrant) recomputes at the first *unpack* of a
    saved tensor instead, and here the region's last ops' backwards unpack nothing: ``h *= 0.5`` and
    ``h.add_(s)`` on a view of the ``addmm`` output run as ``CopySlices`` / ``AsStridedBackward0`` (peak of
    ``body``'s unplanned backward, 608,276 B, in the second ``CopySlices``) before ``SigmoidBackward0``
    unpacks ``s`` and triggers the recomputation. In the planned step that stretch runs one activation (49,152 B)
    lower (559,124 B), below the step's real peak. The fix belongs in the collector's events (place a call's rc
    event and its ``bw_started`` position at the first unpack of a tensor it packed, not at its backward
    pre-hook); the error is on the safe side.

    Fixed in sacplan/collector/module_hooks.py (``note_unpack``): the recorder's pack hook tags each saved tensor
    with the forward op that saved it, its unpack hook begins (``bw_pre_order``, rc segment) every call whose
    backward has begun and whose op saved the tensor read; a call that saved nothing begins at its outputs'
    gradient as before. Predicted 578.01 KiB (the loss's backward) against 578.02 KiB measured."""
    assert_exact(ModelSpec(layers=(Layer("inplace", option=2),), dim=128, batch=3, seq=32), 0.09)


# ------------------------------------------------------------------------------------------ from the slow run (fixed)
def test_residual_inplace_block_backward_under_predicted() -> None:
    """``benchmarks/fuzz.py --seeds 0:500`` seed 487 (on main too: +3.66% unplanned), shrunk by hand: a token
    model whose body is ``x + inplace(x)`` with ``h = fc(x); h += x; h.add_(h.sigmoid()); h *= 0.5``.
    Unplanned peak predicted 640,964 B, measured 706.51 KiB (+65,548 B, one (4, 32, 128) fp32 activation);
    sacplan's tracker on the real tensors agrees with the allocator, so the fake step runs a different
    backward from the real one: the real peak is in the in-place chain's backward (three activation-sized
    allocations, then ``mul``), where ``x``'s gradient arrives by three paths (the residual, ``fc`` and
    ``h += x``). Suspect was: which of those sums the engine does in place (``accumulation_input``).

    Root cause (2026-11-26): the one of test_inplace_activation_in_a_residual_branch: ``h`` is ``fc``'s 3-D view of
    its 2-D ``addmm``, so each of ``h += x``, ``h.add_(...)``, ``h *= 0.5`` regenerates ``h``'s node, on the real
    tensors as an ``AsStridedBackward0`` (a zeroed base-sized gradient each), on the fake ones as a replayed
    ``ViewBackward0`` (an alias). Fixed there (sacplan/collector/inplaceviews.py): exact."""
    spec = ModelSpec(layers=(Layer("residual", children=(Layer("inplace", option=2),)),), dim=128, batch=4, seq=32,
                     vocab=128)
    assert_exact(spec, 1.0)


# ------------------------------------------------------------------------------------------ from the slow run (fixed)
def test_rmsnorm_then_inplace_saved_mutations_peak() -> None:
    """The first failure of ``-m slow`` (its 8th example: +31,744 B, +3.8%), shrunk: RMSNorm → ``h = fc(x);
    h += x; h.mul_(scale)`` (``scale`` a buffer), the whole ``body`` checkpointed saving ``mean``, ``add_.Scalar``,
    ``rsqrt``, ``addmm``, ``add_.Tensor``, ``mul_.Tensor`` (the last three write one storage). Measured peak
    375.45 KiB against 343.95 KiB predicted (+32,256 B, about one 2x64x64 fp32 activation); sacplan's own tracker
    on the real tensors sees 370.51 KiB, so the bytes are real tensors at the dispatcher. Gradients and FLOPs are
    exact. Root cause (per-op log of the tracker on the planned and unplanned real steps, 2026-11-26): the saved
    ``addmm`` makes ``body``'s *output* ``h`` (``save_cost_bytes`` 0: an output is live anyway). Unplanned, ``h``
    dies when the head's backward has used it; planned, the selective region's cache still holds it through
    ``body``'s recomputation and backward, where the peak is (at ``mul_``'s backward: ``h`` + the two recomputed
    RMSNorm tensors + the in-place-on-view backward's ``new_zeros`` / ``clone`` temporaries). The fix is an
    option-dependent term: a save list that holds the call's output op adds its bytes at the events between the
    output's death in the unplanned step (a storage-free position the collector can record) and the call's
    backward end; the MILP rows need it per option, which is why it was not patched in.

    Fixed by construction (sacplan/opgroups.py, sacplan/collector/assemble.py ``output_kept_outside``): an op making
    the module's output that only later modules' backwards read is never saved, so no option holds the output past
    its death; ``body`` now recomputes the ``addmm`` group and the peak is exact."""
    spec = ModelSpec(layers=(Layer("norm", option=1), Layer("inplace", option=1)), dim=64, seq=64, vocab=128, loss="mean")
    assert_exact(spec, 0.2)


def test_inplace_silu_after_custom_function_peak() -> None:
    """The one failure in 500 random examples of the checked grammar (no shrinking; time ran out): a ModuleDict of
    a custom ``autograd.Function`` block and ``Linear`` → ``SiLU(inplace=True)``, then ``Linear`` →
    ``Hardswish(inplace=True)``; ``body.0`` saves both ``addmm``, the ``clone`` issue 24.1's rule adds and
    ``silu_``: planned peak +5,332 B (+1.65%) — the RNG-state copy's 5,056 B plus 276 B not accounted for. With no
    RNG state for regions that draw no random numbers (``body.0`` draws none; the dropout is in ``body.1``) it is
    within 1%."""
    spec = ModelSpec(
        layers=(Layer("dict", children=(Layer("custom", act="silu", heads=4), Layer("linear", act="silu", inplace=True))),
                Layer("linear", act="hardswish", inplace=True, dropout=0.25, heads=4, kv_heads=4)),
        dim=64, seq=32, vocab=128, kwargs_inputs=True, seed=380,
    )
    assert_exact(spec, 0.84)


def test_inplace_activation_in_a_residual_branch() -> None:
    """Found by ``-m slow`` after the fixes above, shrunk: ``x + ReLU(inplace=True)(Linear(x))``, ``body`` fully
    checkpointed at the minimum budget: planned peak +16,384 B (+8.3%, one 2x32x64 fp32 activation); the same
    before this branch's changes (+8.1% with the RNG state then stashed), so not the memory model's.

    Root cause (the tracker's per-op log of the fake and the real unplanned step, 2026-11-26): the collected stats
    record ``body.0.body``'s backward segment 16,384 B low *without any plan* (180,744 fake, 197,128 real); the
    unplanned step peaks elsewhere at the same 197,128 B (the loss's backward), which hid it, and the plan lowers
    that one. The in-place ReLU writes a view (the ``Linear``'s 3-D output viewing its 2-D ``addmm``), so autograd
    rebases the view's ``grad_fn``: on real CPU tensors to ``AsStridedBackward0`` (``new_zeros`` of the base,
    ``as_strided``, ``copy_``: a base-sized gradient, while the residual's other branch still holds the incoming
    one), on fake tensors (Python-dispatch subclasses: autograd replays views) to ``ViewBackward0``, an alias. The
    fix belongs in the collector (count the base-sized gradient an ``AsStridedBackward0`` makes where the fake
    step replays a view).

    Fixed in sacplan/collector/inplaceviews.py: after an in-place op on a fake view, a pre-hook on the replayed
    alias node runs the real ``as_strided_backward`` ops (``new_zeros`` of the base's extent, ``as_strided``,
    ``copy_``) on the incoming gradient; planned peak +8.31% → exact, unplanned unchanged (exact), and in-place
    activations are back in ``residual`` containers of ``fuzzmodels.CHECKED``."""
    spec = ModelSpec(layers=(Layer(kind="residual", children=(Layer(kind="linear", inplace=True),)),), dim=64, seq=32)
    assert_exact(spec, 0.0)


def test_tied_linear_weights_in_a_feature_model() -> None:
    """Found by ``-m slow`` next, shrunk: a feature model whose body ``Linear`` shares the input ``Linear``'s weight,
    width 128, no plan at all: the *unplanned* peak is +32,768 B (+7.7%, one 2x32x128 fp32 activation) over the
    prediction; the same on main before this branch. Untied, or at width 64, it is exact. sacplan's tracker on the
    real tensors agrees with the fake step segment by segment (2026-11-26), so the bytes are allocated below the
    dispatcher (a CPU kernel's scratch, as the ``mm`` stride-0 copy of test_mean_loss_gradient_reaches_the_head_expanded
    was). Fixed with test_tied_weight_gradients_accumulate_out_of_place (found on another branch the same day): the
    tied weight's two gradients are summed out of place (the first is a ``.t()`` view), which the tracker counted
    in place; its real-tensor run agreed only because it applied the same rule."""
    assert_exact(ModelSpec(layers=(Layer("linear"),), dim=128, seq=32, tie=True), 0.0)


def test_attention_dropout_region_peak() -> None:
    """Found by ``-m slow`` (shrunk): one attention layer with dropout (CPU math path, ``bernoulli_`` in the region),
    width 64, ``body.0`` saving both projections, the first ``bmm`` and the dropout group: planned peak +4,800 B
    (+1.53%); the unplanned peak exact, and not the fork_rng copy (freed before the peak). Root cause (the
    allocator's per-op log of the planned step, 2026-11-26): the peak is ``body.0.o``'s ``AddmmBackward0`` right
    after ``body.0``'s recomputation, with ``body.0``'s RNG-state stash (5,056 B) still held. ``body.0.o``,
    ``body.0`` and ``body`` (a one-layer ``Sequential``) return the same tensor, so their backward pre-hooks fire
    at once, innermost first, and the collected events of that backward are labelled ``body``;
    ``ModelStats.backward_active`` then dropped ``body.0`` (not an enclosing module of ``body``) and its stash
    went uncounted. Fixed in sacplan/stats.py (``_enclosed_burst``: a call stays inside its backward while only
    its enclosing modules began after it); the prediction is now 256 B over (the recomputation frees a bias
    gradient's worth before the peak)."""
    assert_exact(ModelSpec(layers=(Layer("attention", dropout=0.25),), dim=64, seq=32), 0.0)


def test_region_saving_its_last_relu_output_counted_once() -> None:
    """The first failure of ``-m slow`` on main after the day's merges (the drawn examples changed with the checked
    grammar; the same prediction on both merged branches alone, so not from the merge): ``body`` = Linear → SiLU,
    Linear → ReLU, checkpointed at the minimum budget saving only its last op, ``relu`` (its output is the body's
    output, read by relu's own backward). Predicted 336.76 KiB at ``body``'s rc event, measured 320.76 KiB
    (-16,384 B, the safe side); sacplan's tracker on the real planned step agrees with the allocator, and full
    checkpointing of ``body`` predicts the same rc value. Not root-caused: the rc event's value (base at the
    backward's start + discarded bytes back + transient) against what the recomputation really re-materialises
    (sacplan/timeline.py, sacplan/evaluate.py) is where to look, as for the RNG copy's rc value.

    Root cause (the collected events against the real step, 2026-11-26): ``relu``'s output, ``body``'s output, is
    counted twice at the rc event. The base holds it (in the unplanned step ``relu``'s own saved tensor keeps it
    alive to ``body``'s backward) and the transient holds it again, as the fresh copy a recomputation re-running
    ``relu`` makes. In the planned step it is there once: saved by the plan (the cache holds it, the
    recomputation takes it from there) or, under full checkpointing, not saved (the original dies with the
    head's backward, the recomputation makes the one copy). Fixed in sacplan/collector/module_hooks.py
    (``_settle_rc_output``): an output storage the call made, alive at its rc event, saved by one of its ops and
    dead by the end of its backward (so those saves alone held it) leaves the transient: 32,768 B less at
    ``body``'s rc event (and at ``body.0.1.act``'s, ``body.0.1``'s, ``body.0``'s), the plan's peak exact."""
    spec = ModelSpec(layers=(Layer("seq", children=(Layer("linear", act="silu"), Layer("linear"))),), dim=64, seq=64)
    assert_exact(spec, 0.0)


# ------------------------------------------------------------------------------------------ precision and optimizers
def test_bf16_matmul_workspace() -> None:
    """bf16 weights (``dtype=torch.bfloat16``): every model's peak was +8-24% over (+50,304 B here, with sacplan's
    tracker on the real tensors equal to the prediction: bytes no op output holds). This host's CPU has no native
    bf16 GEMM: ``mm`` / ``addmm`` run through fp32 copies of their operands and result (25,600 B beside an 8 KiB
    bf16 output of a 64 x 64 product), and a bf16 ``mean`` keeps an fp32 copy of its input. Fixed in
    sacplan/collector/workspace.py (bf16 / fp16 matrix products and reductions measured on the host)."""
    for optimizer in ("none", "sgd", "adamw"):
        assert_exact(ModelSpec(layers=(Layer("linear"), Layer("mlp")), dim=64, seq=32, precision="bf16",
                               optimizer=optimizer), 0.0)


def test_autocast_weight_cast_held_by_the_cache() -> None:
    """CPU bf16 autocast: the planned peak was +2.7% over (+8,448 B) with ``inp`` (saving nothing) and
    ``body.0.fc`` checkpointed. Autocast's weight cache holds each parameter's bf16 copy until the forward's
    autocast context exits; the collector counted the copies that no op saves (the input stage's weight: its input
    needs no gradient; every bias) as the module's activations, which checkpointing would discard. Fixed in
    sacplan/collector (sacplan.collector.autocast): a copy only the cache holds is not an activation."""
    spec = ModelSpec(layers=(Layer("linear"), Layer("mlp")), dim=64, seq=32, precision="autocast")
    assert_exact(spec, 0.0)
    assert_exact(dataclasses.replace(spec, optimizer="sgd"), 0.5)


def test_autocast_tied_weight_recomputation_keeps_the_op_numbers() -> None:
    """CPU bf16 autocast, the input projection tied to the ``kwargs`` layer's ``Linear``, that layer's region
    selective: the planned step raised "aten._to_copy.default invocation index 1 encountered during backward but
    not found in storage". The forward found the tied weight's bf16 copy in autocast's cache (no ``_to_copy`` in
    the region); the recomputation runs under a fresh autocast context and cast it, and torch numbers the
    recomputation's ops per overload, so every later ``_to_copy`` got the saved tensor of another (an error here;
    where shapes agree, silently another tensor). Fixed in sacplan/apply/autocast.py: the recomputation's cache is
    primed with the casts the forward found cached."""
    spec = ModelSpec(layers=(Layer("norm", option=1, heads=4, kv_heads=2),
                             Layer("kwargs", act="gelu", inplace=True, option=1, heads=4, kv_heads=4)),
                     dim=64, batch=3, seq=64, tie=True, seed=30226, loss="mse_loss", precision="autocast")
    assert_exact(spec, 0.0)


def test_autocast_saved_weight_cast_held_until_the_forward_ends() -> None:
    """CPU bf16 autocast, no body, the head checkpointed: the planned peak was +5.45% over (+7,170 B), at the loss.
    The head saves its weight's bf16 copy (8 KiB; its input needs a gradient); checkpointing discards that copy for
    the backward, but autocast's cache holds it until the forward's autocast context exits, after the loss. The
    timeline freed a call's discard at the call's forward end, at forward and backward events alike, and the loss
    (run by the user's ``train_step``) was not even a forward event: its stretch ran on into the backward. Fixed:
    the collector records per call the saved casts the cache holds (``ModuleStats.cache_held``) and ends a forward
    stretch at the backward's first op (sacplan/collector/tracker.py); forward events keep them (``fw_freed = A·r
    − kept − cache_held``), backward ones do not (sacplan/evaluate.py ``event_peaks``, sacplan/solver/problem.py
    ``fw_over``)."""
    assert_exact(ModelSpec(dim=64, seq=32, precision="autocast"), 0.0)


@pytest.mark.slow  # ~15 s: Inductor compiles two blocks with and without the plan
def test_compiled_bf16_blocks_matmul_workspace() -> None:
    """Found by the compiled fuzz test (test_fuzz.py, first run): two bf16 MLP blocks compiled with Inductor, the
    compiled prediction 15.9% under the measured peak (210.75 KiB against 250.50 KiB, where the eager prediction
    was exact). Inductor's generated code calls the ``out=`` forms of the matrix products
    (``extern_kernels.mm(a, b, out=buf)``), whose host workspace (bf16 through fp32 copies, see
    test_bf16_matmul_workspace) was not measured: only ``mm.default`` and its kin were. Fixed in
    sacplan/collector/workspace.py (the ``out=`` forms, and the measurement no longer subtracts an ``out=``
    buffer allocated before the call)."""
    spec = ModelSpec(layers=(Layer("list", children=(Layer("mlp"), Layer("mlp"))),), dim=64, seq=32, precision="bf16")
    msg = failures(spec, [check_compiled(spec, 0.0)])
    assert not msg, msg


@pytest.mark.slow  # ~20 s: Inductor compiles two blocks with and without the plan
def test_compiled_blocks_inside_a_selective_region() -> None:
    """Found by ``benchmarks/fuzz.py --seeds 0:24 --full --compiled`` (seed 13): two BatchNorm1d blocks in a ``list``
    container, compiled one by one; the plan checkpoints the container (``body``, saving the two
    ``num_batches_tracked`` increments). The compiled regions could not be traced on fakes for the planned
    prediction (validate warns and falls back to the eager step as a bound), and the bound is 6.99% under the
    measured peak: the planned compiled step measured 908.05 KiB, the unplanned one 907.55 KiB, so the selective
    region around compiled code discarded nothing, where the eager prediction discards 63 KiB. Not an upper bound:
    either the prediction models a region enclosing compiled blocks as discarding nothing, or such plans are
    refused under compile (sacplan/compiled_saves.py, sacplan/compiled_partition.py).

    Fixed: the trace could not be made because its backward (run at the region's first call, to compile the
    backward graph) unpacked through the enclosing checkpoint's saved-tensor hooks, which recomputed the whole
    container on fakes; the trace now keeps its saves itself (sacplan/compiled_partition.py) and the planned step
    is predicted exactly (908.05 KiB). The enclosing checkpoint does discard the compiled blocks' saves: the
    planned step peaks in its recomputation, where the compiled forward writes a scratch buffer eager does not.
    The fallback bound now counts a module enclosing compiled regions as discarding nothing of them
    (sacplan/compiled_saves.py; tests/apply/test_compiled_prediction.py)."""
    spec = ModelSpec(layers=(Layer("list", children=(Layer("norm", act="silu", option=2, heads=4, kv_heads=4),) * 2),),
                     dim=128, batch=4, seq=32, seed=9283, loss="mse_loss", optimizer="adamw")
    check = check_compiled(spec, 0.26)
    assert not check.failures, failures(spec, [check])
    planned = next(line for line in check.report.splitlines() if line.strip().startswith("peak, with plan"))
    assert planned.split()[-1] == "+0.00%", check.report  # traced on fakes (exact), not the fallback bound


# ------------------------------------------------------------------------------------------ open (autocast)
@pytest.mark.slow  # ~10 s
@pytest.mark.xfail(strict=True, reason="open: under CPU bf16 autocast the allocator sees ~32 KiB more per "
                   "checkpointed region than the tracker (the same plans in bf16 and fp32 are exact)")
def test_autocast_recomputation_allocates_more_than_tracked() -> None:
    """``benchmarks/fuzz.py --seeds 0:250 --full`` seed 249 at fraction 0.27: the planned peak is +2.63% under the
    measured one (+2.65% before the forward-phase cached-cast term). sacplan's tracker on the real tensors agrees
    with the prediction; only the CPU allocator sees the extra bytes, per checkpointed region, and only under
    autocast: likely the recomputation under a fresh autocast context (sacplan/apply/autocast.py primes its cache)."""
    spec = ModelSpec(layers=(
        Layer("custom", act="gelu", dropout=0.25, heads=4, kv_heads=4),
        Layer("list", children=(Layer("kwargs", act="silu", inplace=True, heads=4),)),
        Layer("residual", children=(Layer("kwargs", act="silu", option=1, dropout=0.25, heads=4, kv_heads=2),
                                    Layer("conv1d", act="gelu", heads=2, kv_heads=2))),
        Layer("norm", inplace=True, option=1, dropout=0.25, heads=2),
        Layer("inplace", act="gelu", option=2, heads=2)),
        dim=128, batch=3, seq=64, vocab=128, kwargs_inputs=True, seed=62257, precision="autocast", optimizer="sgd")
    assert_exact(spec, 0.27)


@pytest.mark.xfail(strict=True, reason="open: under CPU bf16 autocast a checkpointed kwargs layer is over-predicted "
                   "at its backward event (the safe direction, beyond the fuzzer's 1%)")
def test_autocast_kwargs_layer_over_predicted_at_its_backward() -> None:
    """Found while shrinking the autocast campaign: main gave +4.70% (under), the forward-phase cached-cast term
    -4.13% (over), the excess at ``body``'s backward event, which that term does not set."""
    assert_exact(ModelSpec(layers=(Layer("kwargs"),), dim=64, seq=32, precision="autocast"), 0.0)
