"""The op keys a plan names are the keys the selective-checkpoint policy meets in the real forward.

A plan saves ops by ``(family, occurrence)`` within one call of a module (sacplan.opnames); the policy numbers the
ops it sees in the real step the same way. The two agree only if the collected (fake) step runs the ops the real
one runs. A fake output laid out differently from the real kernel's changes the ops downstream: BatchNorm1d over
a transposed sequence returns a contiguous tensor on CPU (the meta kernel kept the input's strides), so the
following ``Linear`` sees a non-contiguous input and runs ``clone`` + ``mm`` where the fake step ran ``view`` +
``addmm``; a plan saving ``addmm`` #1 then saved nothing and its ``mm`` ran again on recomputation (found by the
differential fuzzer: tests/fuzz/test_regressions.py ``*_recomputes_a_saved_matmul``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from sacplan.apply import make_policy
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.opnames import family, is_random_op, op_keys


class Body(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.bn, self.down = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(torch.relu(self.up(x)).transpose(1, 2)).transpose(1, 2)
        return self.down(h)


class Net(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.body = Body(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _policy_keys(model: Net, x: torch.Tensor) -> list[tuple[str, int]]:
    """(family, occurrence) of every op the SAC policy is asked about in ``model.body``'s forward."""
    seen: list[str] = []
    base = make_policy(set(), False)

    def policy(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(family(str(func), is_random_op(func)))
        return base(ctx, func, *args, **kwargs)

    checkpoint(model.body, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy))
    counts: dict[str, int] = {}
    keys = []
    for fam in seen:
        keys.append((fam, counts.get(fam, 0)))
        counts[fam] = counts.get(fam, 0) + 1
    return keys


def test_policy_meets_the_collected_keys_after_a_transposed_batch_norm() -> None:
    x = torch.randn(3, 16, 32)
    stats = collect(Net(), (x,), device=CPU, loss_fn=lambda out: out.sum(), optimizer=False)
    collected = op_keys(stats.module("body").ops)
    assert _policy_keys(Net(), x) == collected
    assert ("aten.mm.default", 0) in collected  # the second Linear on the non-contiguous BatchNorm output
