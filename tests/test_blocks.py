"""The one repeated-block rule (sacplan.blocks), shared by sweep, alternatives and the default FSDP units."""

from __future__ import annotations

import torch
from torch import nn

from sacplan.alternatives import find_blocks
from sacplan.blocks import repeated_blocks
from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.distributed import each_block_units
from sacplan.budget_sweep import repeated_blocks as sweep_blocks
from sacplan.tree import ModuleTree


class Attn(nn.Module):  # four Linear leaves: more same-type children than there are blocks
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) * self.k(x) + self.v(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attn(), nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x + self.attn(x))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _tree(model: nn.Module) -> ModuleTree:
    return ModuleTree(collect(lambda: model, (torch.randn(4, 16),), device=CPU, optimizer=False))


def test_blocks_are_non_leaf_children_and_every_user_agrees() -> None:
    tree = _tree(nn.Sequential(nn.Linear(16, 16), Block(), Block(), nn.Linear(16, 16)))
    # attn's four Linears outnumber the two blocks, but leaves are never blocks (the FSDP units used to be them)
    assert repeated_blocks(tree.stats) == ("1", "2")
    assert sweep_blocks(tree) == ("1", "2")
    assert find_blocks(tree) == ["1", "2"]
    assert each_block_units(tree.stats) == ["", "1", "2"]


def test_blocks_pool_across_parents_of_one_type_and_ties_go_to_the_outer_set() -> None:
    # root: two Stages; each Stage's ModuleList holds two Blocks, pooled across the Stages (parents of one type
    # at one depth): four Blocks outnumber two Stages
    tree = _tree(nn.Sequential(Stage(), Stage()))
    assert repeated_blocks(tree.stats) == ("0.blocks.0", "0.blocks.1", "1.blocks.0", "1.blocks.1")
    # two sets of two Blocks under parents of different types, and the Blocks' own Attn / MLP repeating as
    # often: ties go to the outer set
    one = _tree(nn.Sequential(Stage(), Block(), Block()))
    assert repeated_blocks(one.stats) == ("1", "2")
    # three Sequential wrappers vs two Blocks: the count decides before the container rule
    wrapped = _tree(nn.Sequential(nn.Sequential(Block()), nn.Sequential(Block()), nn.Sequential(nn.Linear(16, 16))))
    assert repeated_blocks(wrapped.stats) == ("0", "1", "2")


def test_no_repeated_block() -> None:
    assert repeated_blocks(_tree(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))).stats) == ()
    assert each_block_units(_tree(nn.Sequential(Block(), nn.Linear(16, 16))).stats) == [""]
