"""sacplan: plan selective activation checkpointing for a memory budget, before you spend a GPU-hour.

Flow (one direction): ``collect`` (fake training step → :class:`ModelStats`) → :class:`ModuleTree` →
``solve`` / ``sac_milp`` (MILP) → :class:`Plan` → ``apply_plan`` / ``Plan.save`` / ``validate``.

In one call: ``plan = sacplan.fit_to_budget(model, inputs, budget="60GiB", device="h100")`` (collect, solve,
apply); ``print(sacplan.show_plan(model))`` shows the model with its checkpointed modules marked.

The functions ``sacplan.collect``, ``solve``, ``validate`` and ``sweep`` live in the subpackages and modules
:mod:`sacplan.collector`, :mod:`sacplan.solver`, :mod:`sacplan.validation` and :mod:`sacplan.budget_sweep`
(named apart from the functions, so importing one never shadows a function), loaded on first use to keep
``import sacplan`` light.
"""

import importlib

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
    "sacplan.collector": ("collect",),
    "sacplan.solver": ("solve", "sac_milp", "min_feasible_budget", "baseline_peak", "certify", "recompute_lower_bound",
                       "SolverOptions"),
    "sacplan.validation": ("validate",),
    "sacplan.budget_sweep": ("sweep",),
    "sacplan.plan": ("Plan", "ModuleDecision", "load_plan"),
    "sacplan.apply": ("apply_plan", "remove_plan"),
    "sacplan.enable": ("fit_to_budget", "show_plan"),
    "sacplan.pipeline": ("collect_pipeline", "solve_pipeline", "PipelinePlan", "validate_pipeline"),
}


__all__ = [
    "BudgetError", "Bytes", "CollectionError", "ConfigError", "DeviceSpec", "InfeasibleBudgetError", "MemSnapshot",
    "MemoryEvent", "ModelStats", "ModuleStats", "ModuleTree", "OpStat", "PlanError", "PlanMismatchError",
    "SacplanError", "SolverError", "SolverOptions", "TradeOff", "UnknownDeviceError", "UnsupportedModelError", "__version__",
    "PipelinePlan", "apply_plan", "baseline_peak", "certify", "collect", "collect_pipeline", "fit_to_budget", "get_device", "list_devices", "load_plan", "min_feasible_budget",
    "parse_budget", "recompute_lower_bound", "remove_plan", "sac_milp", "show_plan", "solve", "solve_pipeline", "sweep", "validate",
    "validate_pipeline",
]
