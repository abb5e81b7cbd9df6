"""What :func:`sacplan.validation.validate` reports: one real step's :class:`Measurement` and the side-by-side
:class:`ValidationReport` (bytes, ms, FLOPs) with its printed summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from sacplan.units import fmt_bytes

__all__ = ["Measurement", "ValidationReport"]


@dataclass(frozen=True)
class Measurement:
    """One real training step.

    Attributes:
        peak_bytes: peak bytes during the step (see ``method``).
        tracker_peak_bytes: sacplan's tracker on the real tensors (CPU cross-check; ``None`` on CUDA).
        step_ms: median wall (CPU) or CUDA-event (GPU) time of the timed steps after warm-up, ms (without
            the profiler that measures the peak).
        flops: FLOPs of one forward+backward (``FlopCounterMode`` with sacplan's extra formulas); ``None`` for a
            compiled step (a dispatch mode would make it run eagerly).
        method: how ``peak_bytes`` was measured.
    """

    peak_bytes: int
    tracker_peak_bytes: int | None
    step_ms: float
    flops: int | None
    method: str


@dataclass(frozen=True)
class ValidationReport:
    """Side-by-side numbers of :func:`validate` (bytes, ms, FLOPs)."""

    host: str
    method: str
    baseline: Measurement
    planned: Measurement
    predicted_baseline_peak_bytes: int
    predicted_peak_bytes: int
    predicted_recompute_flops: int
    predicted_recompute_ms: float
    plan_predicted_peak_bytes: int | None
    grads_bitwise_equal: bool
    max_grad_abs_diff: float
    grads_match: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    plan_device_name: str = ""
    timed_steps: int = 1
    compiled: str = ""
    grads_compared: bool = True
    predicted_baseline_step_ms: float | None = None
    kernel_noise: float = 0.0
    #: host ms the plan's selective regions add (:mod:`sacplan.sacmode`), part of :attr:`predicted_step_ms`
    predicted_dispatch_ms: float = 0.0

    @property
    def predicted_step_ms(self) -> float | None:
        """Estimated step time with the plan: the no-plan estimate plus the plan's recompute ms and its selective
        regions' dispatch (``None`` on CPU, whose wall time is not compared with an estimate)."""
        if self.predicted_baseline_step_ms is None:
            return None
        return self.predicted_baseline_step_ms + self.predicted_recompute_ms + self.predicted_dispatch_ms

    @property
    def measured_recompute_flops(self) -> int | None:
        """Planned minus baseline FLOPs (``None`` for compiled steps, whose FLOPs are not counted)."""
        if self.planned.flops is None or self.baseline.flops is None:
            return None
        return self.planned.flops - self.baseline.flops

    @property
    def peak_error(self) -> float:
        """(measured − predicted) / measured for the planned step."""
        return (self.planned.peak_bytes - self.predicted_peak_bytes) / max(1, self.planned.peak_bytes)

    @property
    def baseline_peak_error(self) -> float:
        return (self.baseline.peak_bytes - self.predicted_baseline_peak_bytes) / max(1, self.baseline.peak_bytes)

    def summary(self) -> str:
        timed = f" (median of {self.timed_steps} after warm-up)" if self.timed_steps > 1 else ""
        rows = [
            ("", f"predicted for this host ({self.host})", "measured", "error"),
            ("peak, no plan", fmt_bytes(self.predicted_baseline_peak_bytes), fmt_bytes(self.baseline.peak_bytes), f"{self.baseline_peak_error:+.2%}"),
            ("peak, with plan", fmt_bytes(self.predicted_peak_bytes), fmt_bytes(self.planned.peak_bytes), f"{self.peak_error:+.2%}"),
            self._flops_row(),
            self._step_row(f"step ms, no plan{timed}", self.predicted_baseline_step_ms, self.baseline.step_ms),
            self._step_row(f"step ms, with plan{timed}", self.predicted_step_ms, self.planned.step_ms),
        ]
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"validation on {self.host} ({self.method})" + (f", compiled: {self.compiled}" if self.compiled else "")]
        lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
        noise = f" (the same step run twice without the plan differs by {self.kernel_noise:.3g}: nondeterministic kernels)" if self.kernel_noise else ""
        lines.append(
            "gradients: " + ("bitwise equal" if self.grads_bitwise_equal else f"max |diff| {self.max_grad_abs_diff:.3g}{noise}")
            + ("" if self.grads_match else "  (MISMATCH)" if self.grads_compared else
               "  (not compared: the step draws random numbers, and compiled graphs with and without the plan draw "
               "different ones)")
        )
        if self.baseline.tracker_peak_bytes is not None:
            lines.append(
                f"tracker on real tensors: no plan {fmt_bytes(self.baseline.tracker_peak_bytes)}, "
                f"with plan {fmt_bytes(self.planned.tracker_peak_bytes or 0)}"
            )
        if self.plan_predicted_peak_bytes is not None:
            same = self.plan_predicted_peak_bytes == self.predicted_peak_bytes and not self.compiled
            lines.append(
                f"the plan's own prediction, for its target {self.plan_device_name or '(unknown)'}: peak "
                f"{fmt_bytes(self.plan_predicted_peak_bytes)} " + ("(the same as re-predicted above for this host)"
                if same else "(re-predicted above for this host and step, whose sizes, kernels or dtype may differ, "
                "so it can be measured here)")
            )
        lines += list(self.notes)
        return "\n".join(lines)

    @staticmethod
    def _step_row(label: str, pred: float | None, meas: float) -> tuple[str, str, str, str]:
        if pred is None:
            return (label, "", f"{meas:.2f}", "")
        return (label, f"{pred:.2f}", f"{meas:.2f}", f"{(meas - pred) / max(meas, 1e-9):+.2%}")

    def _flops_row(self) -> tuple[str, str, str, str]:
        pred, meas = self.predicted_recompute_flops, self.measured_recompute_flops
        if meas is None:
            return ("recomputed GFLOP", f"{pred / 1e9:.4f}", "not counted", "(compiled)")
        return ("recomputed GFLOP", f"{pred / 1e9:.4f}", f"{meas / 1e9:.4f}", "exact" if pred == meas else f"{meas - pred:+d}")
