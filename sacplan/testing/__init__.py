"""Helpers for sacplan's own tests and benchmarks: synthetic model statistics, built without running a model.

:mod:`sacplan.testing.synthetic` simulates a step on a tree of module specs; :mod:`sacplan.testing.llama_tree`
builds a Llama-7B-shaped one. :mod:`sacplan.testing.torchvision_cpu` lets torchvision (and what imports it)
import beside a CPU torch wheel.
"""
