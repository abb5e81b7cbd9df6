"""Plan.summary: the one table the CLI and Python print, with units that fit each number."""

from __future__ import annotations

from sacplan.plan import ModuleDecision, Plan
from sacplan.units import GiB, KiB, MiB


def _plan(decisions: tuple[ModuleDecision, ...], **kw) -> Plan:
    base = dict(
        decisions=decisions, budget_bytes=100 * GiB, predicted_peak_bytes=90 * GiB, baseline_peak_bytes=110 * GiB,
        recompute_ms=sum(d.recompute_ms for d in decisions), baseline_step_ms=250.0, status="optimal",
        objective_ms=0.0, bound_ms=0.0, gap=0.0, solver="highs", build_s=0.1, solve_s=0.2, world_size=1,
        device_name="H100-SXM", model_name="m", fingerprint="",
    )
    base.update(kw)
    return Plan(**base)


def test_units_follow_each_number():
    plan = _plan((
        ModuleDecision(fqn="layers.0", discard_bytes=3 * GiB, recompute_ms=12.5, calls=2),
        ModuleDecision(fqn="layers.0.norm", discard_ratio=0.5, discard_bytes=2 * KiB, recompute_ms=0.0004, saved_ops=()),
    ))
    text = plan.summary(extra=["batch 3, seq 8192"])
    lines = text.splitlines()
    assert lines[0] == "SAC plan: m on H100-SXM, world size 1"
    assert lines[1] == "  batch 3, seq 8192"
    assert "  budget               100.00 GiB" in lines  # not 102400.000 MiB
    assert "  predicted peak       90.00 GiB  (20.00 GiB below the no-AC peak)" in lines
    assert not {"0.000", "0.00", "0.000%"} & set(text.split())  # a small module reads as KiB and 0.0004 ms, not zeros
    row = next(ln for ln in lines if ln.lstrip().startswith("layers.0.norm"))
    assert row.split() == ["layers.0.norm", "1", "50.0%", "2.00", "KiB", "0.0004", "ms", "save", "0", "op(s)"]
    row = next(ln for ln in lines if ln.lstrip().startswith("layers.0 "))
    assert row.split() == ["layers.0", "2", "100.0%", "6.00", "GiB", "12.5", "ms", "full"]
    assert lines[-2].split() == ["total", "(2", "modules)", "6.00", "GiB", "12.5", "ms"]
    # "freed" sums what modules drop; the header's figure is what the peak loses: the note says which is which
    assert lines[-1].startswith("  freed: what a module drops after its forward") and "peak falls by 20.00 GiB" in lines[-1]
    assert str(plan) == plan.summary()


def test_small_models_and_empty_plans():
    plan = _plan((), budget_bytes=int(1.75 * MiB), predicted_peak_bytes=MiB, baseline_peak_bytes=MiB, solver="",
                 status="not needed", baseline_step_ms=1.42)
    text = plan.summary()
    assert "  budget               1.75 MiB" in text.splitlines()
    assert "step                 1.42 ms  (1.42 ms + 0 ms recompute, 0.0% overhead)" in text
    assert text.splitlines()[-1] == "  no module is checkpointed: the model fits the budget as is"
