"""Regions planned without RNG state: proof, on every call, that they draw no random numbers.

A plan checkpoints a region with ``preserve_rng_state=False`` when the collected step drew no random numbers in it
(no state stashed at the forward, no ``fork_rng`` copy while recomputing: :func:`sacplan.devices.checkpoint_state_bytes`).
Should a call draw some after all — dropout switched on since, a module first called in eval mode and later in
training mode, a data-dependent branch — its recomputation would replay other numbers and the gradients would be
silently wrong. Two checks make that impossible; both raise :func:`rng_mismatch`'s error:

* under the selective policy, the random op itself (:func:`sacplan.apply.policy.make_policy`, ``no_rng_state``);
* around a plain checkpoint (a fully checkpointed region without buffers runs without the policy's dispatch mode):
  the generators a ``preserve_rng_state=True`` checkpoint would stash — the CPU generator and the default generator
  of every accelerator among the region's tensor inputs (``torch.utils.checkpoint.get_device_states``) — read before
  and after the forward (:func:`generator_states`); a change means the forward drew from one of them.

Reading the states costs ~7 us per call on a CPU (benchmarks/rng_check_cost.py). Each read makes a 5,056-byte host
tensor, freed at once (the states are compared as bytes): no device memory, and nothing sacplan's step recorders
register (the CPU state is read through ``torch.default_generator``, not the ``torch.get_rng_state`` that
:func:`sacplan.pipeline.measure_rank` registers); the CPU allocator's profiler events (validation on a CPU host) see
it for that instant.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.checkpoint import get_device_states

from sacplan.errors import PlanMismatchError

__all__ = ["generator_states", "rng_mismatch"]


def rng_mismatch(region: str, what: str) -> PlanMismatchError:
    """The error for a region planned without RNG state that drew random numbers (``what``: the op, or the
    generator that advanced)."""
    return PlanMismatchError(
        f"checkpointed module {region!r} draws random numbers ({what}) where the step the plan was made from drew "
        "none (was the model collected in eval mode, or with dropout 0?); without the RNG state its recomputation "
        "would replay other numbers. Re-plan from a step that runs as this one does."
    )


def generator_states(tensors: Sequence[Any]) -> tuple[bytes, ...]:
    """The states, as bytes, of the CPU generator and of the default generator of each accelerator device among
    ``tensors`` (the generators ``torch.utils.checkpoint`` stashes with ``preserve_rng_state=True``). Devices whose
    runtime is not initialised (fake tensors of a device this host lacks) drew nothing and are left out."""
    states = [torch.default_generator.get_state()]
    accelerators = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")]
    if accelerators and _initialised(accelerators[0].device.type):
        states.extend(get_device_states(*accelerators)[1])
    return tuple(s.numpy().tobytes() for s in states)


def _initialised(device_type: str) -> bool:
    module = getattr(torch, device_type, None)
    is_init = getattr(module, "is_initialized", None)
    return bool(is_init()) if callable(is_init) else module is not None
