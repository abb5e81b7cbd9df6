"""Shared fixtures for apply/validate tests: small real models, their CPU stats and plans."""

from __future__ import annotations

import pytest
import torch

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.models import get_model
from sacplan.models.llama import Llama
from sacplan.tree import ModuleTree


def llama_factory(dropout: float = 0.0, n_layers: int = 4):
    cfg = get_model("llama-tiny").config.with_(dropout=dropout, n_layers=n_layers)
    return lambda: Llama(cfg)


@pytest.fixture(scope="module")
def llama_setup():
    """(model_fn, inputs_fn, loss_fn, tree) for a 4-layer llama-tiny with dropout, stats for the CPU host."""
    preset = get_model("llama-tiny")
    model_fn = llama_factory(dropout=0.1)
    inputs_fn = lambda: preset.example_inputs(4, 128)  # noqa: E731
    torch.manual_seed(0)
    stats = collect(model_fn, inputs_fn(), device=CPU, loss_fn=preset.loss_fn)
    return model_fn, inputs_fn, preset.loss_fn, ModuleTree(stats)


@pytest.fixture(scope="module")
def cnn_setup():
    preset = get_model("cnn-tiny")
    model_fn = lambda: preset.build()  # noqa: E731
    inputs_fn = lambda: preset.example_inputs(8)  # noqa: E731
    torch.manual_seed(0)
    stats = collect(model_fn, inputs_fn(), device=CPU, loss_fn=preset.loss_fn)
    return model_fn, inputs_fn, preset.loss_fn, ModuleTree(stats)
