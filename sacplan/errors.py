"""Typed errors raised by sacplan.

Every error says what went wrong *and* what to do about it. All derive from :class:`SacplanError`, so
``except sacplan.errors.SacplanError`` catches anything this package raises on purpose.
"""

from __future__ import annotations


class SacplanError(Exception):
    """Base class of every error sacplan raises on purpose."""


class ConfigError(SacplanError, ValueError):
    """An argument has a wrong value or type (unknown device, unparsable budget, bad world size...)."""


class UnknownDeviceError(ConfigError, KeyError):
    """A device name did not match any known :class:`~sacplan.devices.DeviceSpec`."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class BudgetError(ConfigError):
    """A memory budget could not be parsed or is not positive."""


class BudgetWarning(UserWarning):
    """A budget was accepted but looks wrong (e.g. above the target device's memory)."""


class InfeasibleBudgetError(SacplanError):
    """No checkpointing plan fits the budget.

    Attributes:
        budget_bytes: the budget asked for, in bytes.
        min_feasible_bytes: the smallest budget (bytes) for which a plan exists under the same model; a
            :class:`~sacplan.units.Bytes`, so ``solve(tree, err.min_feasible_bytes)`` reads it as bytes.
    """

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, detail: str = "") -> None:
        from sacplan.units import Bytes  # units imports this module

        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = Bytes(min_feasible_bytes)
        gib = 2**30
        msg = (
            f"memory budget {budget_bytes / gib:.3f} GiB ({budget_bytes} bytes) is infeasible: the smallest "
            f"feasible budget is {min_feasible_bytes / gib:.3f} GiB ({min_feasible_bytes} bytes). "
            "Raise the budget to at least that, or shrink the batch/sequence, shard with a larger world size, "
            "or allow more checkpoint units."
        )
        if detail:
            msg += " " + detail
        super().__init__(msg)


class SolverError(SacplanError):
    """The MILP back-end failed or is not installed."""


class UnsupportedModelError(SacplanError):
    """The model (or one of its modules) cannot be collected or checkpointed; the message names it."""


class CollectionError(SacplanError):
    """Running the fake training step failed; the message names the module and the reason."""


class PlanError(SacplanError):
    """A plan file is damaged, of an unknown schema version, or has an invalid field."""


class PlanMismatchError(PlanError):
    """A plan does not belong to this model (fingerprint, module or op mismatch)."""


class ValidationError(SacplanError):
    """A validation run could not be carried out (e.g. no way to measure memory on this host)."""
