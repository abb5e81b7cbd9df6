"""sacplan: plan selective activation checkpointing for a memory budget, before you spend a GPU-hour.

Flow (one direction): ``collect`` (fake training step → :class:`ModelStats`) → :class:`ModuleTree` →
``solve`` / ``sac_milp`` (MILP) → :class:`Plan` → ``apply_plan`` / ``Plan.save`` / ``validate``.

In one call: ``plan = sacplan.fit_to_budget(model, inputs, budget="60GiB", device="h100")`` (collect, solve,
apply); ``print(sacplan.show_plan(model))`` shows the model with its checkpointed modules marked.
"""

import importlib
import sys
import types

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
from sacplan.units import Bytes, parse_budget

__version__ = "0.1.0"


def _lazy_function(module: str, name: str) -> property:
    """A property returning ``module.name``, imported on first use; its setter absorbs the import system's
    ``setattr(sacplan, <submodule name>, <submodule>)`` (see :class:`_Package`)."""

    def get(self):
        return getattr(importlib.import_module(module), name)

    def absorb(self, value) -> None:
        pass

    return property(get, absorb)


class _Package(types.ModuleType):
    """``sacplan.collect``, ``.solve``, ``.validate`` and ``.sweep`` are the functions, loaded lazily (keeps
    ``import sacplan`` light: no PuLP until needed).

    They share their names with subpackages, and importing a submodule sets the parent's attribute to the
    module (the first ``sacplan.collect(...)`` imported ``sacplan.collect``, and the second call found a module).
    Properties on the package's class take precedence over its ``__dict__``, and their setters absorb what
    the import system sets. The submodules stay importable with ``from sacplan.collect import ...`` and
    ``importlib.import_module``; ``import sacplan.collect.tracker as t`` does not work (it walks attributes).
    """

    collect = _lazy_function("sacplan.collect", "collect")
    solve = _lazy_function("sacplan.solve", "solve")
    validate = _lazy_function("sacplan.validate", "validate")
    sweep = _lazy_function("sacplan.sweep", "sweep")


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):  # lazy: keep `import sacplan` light (no torch/PuLP until needed: `sacplan --help` is fast)
    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    if name in ("devices", "stats", "tree"):  # `import sacplan; sacplan.devices.DeviceSpec(...)` as before
        return importlib.import_module(f"sacplan.{name}")
    raise AttributeError(f"module 'sacplan' has no attribute {name!r}")


# torch-importing modules are lazy too: `sacplan` (the CLI) starts in milliseconds, so a Ctrl-C during the
# heavy imports lands inside the CLI's handler (one line, exit 130) instead of a traceback.
_LAZY = {
    "sacplan.devices": ("DeviceSpec", "get_device", "list_devices"),
    "sacplan.stats": ("MemoryEvent", "MemSnapshot", "ModelStats", "ModuleStats", "OpStat", "TradeOff"),
    "sacplan.tree": ("ModuleTree",),
    "sacplan.solve": ("sac_milp", "min_feasible_budget", "baseline_peak", "certify", "recompute_lower_bound"),
    "sacplan.plan": ("Plan", "ModuleDecision", "load_plan"),
    "sacplan.apply": ("apply_plan", "remove_plan"),
    "sacplan.enable": ("fit_to_budget", "show_plan"),
}


__all__ = [
    "BudgetError", "Bytes", "CollectionError", "ConfigError", "DeviceSpec", "InfeasibleBudgetError", "MemSnapshot",
    "MemoryEvent", "ModelStats", "ModuleStats", "ModuleTree", "OpStat", "PlanError", "PlanMismatchError",
    "SacplanError", "SolverError", "TradeOff", "UnknownDeviceError", "UnsupportedModelError", "__version__",
    "apply_plan", "baseline_peak", "certify", "collect", "fit_to_budget", "get_device", "list_devices", "load_plan", "min_feasible_budget",
    "parse_budget", "recompute_lower_bound", "remove_plan", "sac_milp", "show_plan", "solve", "sweep", "validate",
]
