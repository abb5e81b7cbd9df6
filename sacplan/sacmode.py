"""What a checkpointed region under the selective-checkpoint mode costs beyond plain checkpointing (host ms).

``apply_plan`` runs a checkpointed region as plain ``torch.utils.checkpoint`` when nothing in it is saved and
the module holds no buffers; every other region runs under the selective mode
(``create_selective_checkpoint_contexts`` with sacplan's policy), whose Python dispatch handles every op of the
region's forward and of its recomputation. Measured on an H200 machine (``benchmarks/sac_dispatch_cost.py``,
``benchmarks/sac_mode_overhead.py``): 17-23 µs per op and pass, whatever the kernels' size, and a planned
step's extra time beyond its estimated recomputation matches that cost times the selective regions' ops. The
solver charges it (:attr:`~sacplan.devices.DeviceSpec.sac_dispatch_ms`) to every option that runs selective, so a
save list must beat a plain full checkpoint of the same module by more than its dispatch; the plan reports it as
:attr:`~sacplan.plan.ModuleDecision.dispatch_ms`, apart from the recomputation.

The cost is added to the step: a conservative model where the device would otherwise hide part of it behind
long kernels.
"""

from __future__ import annotations

from sacplan.devices import DeviceSpec
from sacplan.opgroups import forced_saves, stop_index
from sacplan.stats import ModuleStats


def runs_selective(stats: ModuleStats, saved_ops: object) -> bool:
    """``apply`` runs the module's region under the selective mode: its decision names saved ops (``saved_ops``:
    a decision's ``(index, name, occurrence)`` entries, or None), or the module's subtree holds buffers (BatchNorm
    statistics, which the policy protects from a second update); otherwise plain ``torch.utils.checkpoint``."""
    return bool(saved_ops) or stats.buffer_bytes > 0


def full_runs_selective(stats: ModuleStats) -> bool:
    """A full checkpoint of the module still runs under the selective mode: it must name the ops every save list
    keeps (ops reading an outside storage that the forward overwrites later,
    :func:`~sacplan.opgroups.forced_saves`, what its decision saves), or it holds buffers."""
    return runs_selective(stats, forced_saves(stats.ops, stats.recompute_stop))


def region_dispatch_ms(stats: ModuleStats, device: DeviceSpec, saved_ops: object) -> float:
    """Host ms the selective mode adds to one call of a region that saves ``saved_ops``: :func:`dispatch_ms`
    where :func:`runs_selective`, else 0."""
    return dispatch_ms(stats, device) if runs_selective(stats, saved_ops) else 0.0


def dispatch_ms(stats: ModuleStats, device: DeviceSpec) -> float:
    """Host ms the selective mode adds to one call of the module: its forward's ops and the ops its recomputation
    re-runs (up to the early stop), each at ``device.sac_dispatch_ms``."""
    ops = stats.ops
    stop = stop_index(ops, stats.recompute_stop)
    return float(device.sac_dispatch_ms or 0.0) * (len(ops) + sum(1 for op in ops if op.index < stop))
