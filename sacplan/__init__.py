"""sacplan: plan selective activation checkpointing for a memory budget, before you spend a GPU-hour.

Flow (one direction): ``collect`` (fake training step → :class:`ModelStats`) → :class:`ModuleTree` →
``solve`` / ``sac_milp`` (MILP) → :class:`Plan` → ``apply_plan`` / ``Plan.save`` / ``validate``.
"""

import importlib
import sys
import types

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


class _Package(types.ModuleType):
    """``sacplan.collect``, ``.solve``, ``.validate`` and ``.sweep`` are the functions, loaded lazily (keeps
    ``import sacplan`` light: no PuLP until needed).

    They share their names with subpackages, and importing a submodule sets the parent's attribute to the
    module (the first ``sacplan.collect(...)`` imported ``sacplan.collect``, and the second call found a module).
    Properties on the package's class take precedence over its ``__dict__``, and their setters absorb what
    the import system sets. The submodules stay importable with ``from sacplan.collect import ...`` and
    ``importlib.import_module``; ``import sacplan.collect.tracker as t`` does not work (it walks attributes).
    """

    @property
    def collect(self):  # type: ignore[override]
        from sacplan.collect import collect

        return collect

    @collect.setter
    def collect(self, value) -> None:
        pass

    @property
    def solve(self):
        from sacplan.solve import solve

        return solve

    @solve.setter
    def solve(self, value) -> None:
        pass

    @property
    def validate(self):
        from sacplan.validate import validate

        return validate

    @validate.setter
    def validate(self, value) -> None:
        pass

    @property
    def sweep(self):
        from sacplan.sweep import sweep

        return sweep

    @sweep.setter
    def sweep(self, value) -> None:
        pass


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):  # lazy: keep `import sacplan` light (no PuLP/pwlf until needed)
    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'sacplan' has no attribute {name!r}")


_LAZY = {
    "sacplan.solve": ("sac_milp", "min_feasible_budget", "baseline_peak"),
    "sacplan.plan": ("Plan", "ModuleDecision", "load_plan"),
    "sacplan.apply": ("apply_plan", "remove_plan"),
}


__all__ = [
    "BudgetError", "CollectionError", "ConfigError", "DeviceSpec", "InfeasibleBudgetError", "MemSnapshot",
    "MemoryEvent", "ModelStats", "ModuleStats", "ModuleTree", "OpStat", "PlanError", "PlanMismatchError",
    "SacplanError", "SolverError", "TradeOff", "UnknownDeviceError", "UnsupportedModelError", "__version__",
    "apply_plan", "baseline_peak", "collect", "get_device", "list_devices", "load_plan", "min_feasible_budget",
    "parse_budget", "remove_plan", "sac_milp", "solve", "sweep", "validate",
]
