"""sacplan: plan selective activation checkpointing for a memory budget, before you spend a GPU-hour.

Flow (one direction): ``collect`` (fake training step → :class:`ModelStats`) → :class:`ModuleTree` →
``solve`` / ``sac_milp`` (MILP) → :class:`Plan` → ``apply_plan`` / ``Plan.save`` / ``validate``.
"""

from sacplan.devices import DeviceSpec, get_device, list_devices
from sacplan.errors import (
    BudgetError,
    CollectionError,
    ConfigError,
    InfeasibleBudgetError,
    PlanError,
    PlanMismatchError,
    SacplanError,
    SolverError,
    UnknownDeviceError,
    UnsupportedModelError,
)
from sacplan.stats import MemoryEvent, MemSnapshot, ModelStats, ModuleStats, OpStat, TradeOff
from sacplan.tree import ModuleTree
from sacplan.units import parse_budget

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: keep `import sacplan` light (no PuLP/pwlf until needed)
    if name == "collect":
        from sacplan.collect import collect

        return collect
    if name in ("solve", "sac_milp", "min_feasible_budget", "baseline_peak"):
        import sacplan.solve as s

        return getattr(s, name)
    if name in ("Plan", "ModuleDecision", "load_plan"):
        import sacplan.plan as p

        return getattr(p, name)
    if name in ("apply_plan", "remove_plan"):
        import sacplan.apply as a

        return getattr(a, name)
    if name == "validate":
        from sacplan.validate import validate

        return validate
    if name == "sweep":
        from sacplan.sweep import sweep

        return sweep
    raise AttributeError(f"module 'sacplan' has no attribute {name!r}")


__all__ = [
    "BudgetError", "CollectionError", "ConfigError", "DeviceSpec", "InfeasibleBudgetError", "MemSnapshot",
    "MemoryEvent", "ModelStats", "ModuleStats", "ModuleTree", "OpStat", "PlanError", "PlanMismatchError",
    "SacplanError", "SolverError", "TradeOff", "UnknownDeviceError", "UnsupportedModelError", "__version__",
    "apply_plan", "baseline_peak", "collect", "get_device", "list_devices", "load_plan", "min_feasible_budget",
    "parse_budget", "remove_plan", "sac_milp", "solve", "sweep", "validate",
]
