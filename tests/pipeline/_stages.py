"""Tiny pipeline stages for the pipeline tests, the benchmark and the example: module-level, so spawned ranks can
unpickle them. Stage ``i`` of ``n``: ``blocks`` pre-norm MLP blocks on (batch, seq, DIM) activations."""

from __future__ import annotations

import functools

import torch
from torch import nn

DIM, HIDDEN, SEQ = 32, 128, 16


class Block(nn.Module):
    """Pre-norm MLP block with a residual: (B, S, DIM) -> (B, S, DIM)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Stage(nn.Module):
    """``blocks`` blocks; the last stage also projects to DIM logits."""

    def __init__(self, blocks: int, last: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.head = nn.Linear(DIM, DIM) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(x)
        return self.head(x) if self.head is not None else x


def make_stage(i: int, n: int, blocks: int = 2) -> Stage:
    return Stage(blocks, last=i == n - 1)


def stage_fns(n: int, blocks: int = 2) -> list:
    return [functools.partial(make_stage, i, n, blocks) for i in range(n)]


def batch(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, SEQ, DIM, generator=torch.Generator().manual_seed(seed))
