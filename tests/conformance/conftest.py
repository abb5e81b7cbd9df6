"""Conformance set-up: torchvision's model code without its compiled ops.

PyPI torchvision is installed ``--no-deps`` beside the CPU torch wheel, and its compiled ops do not load
there; its models are pure Python, but importing it registers fake kernels for a few of its ops, which needs
their schemas. :mod:`sacplan.testing.torchvision_cpu` declares exactly those (never implemented: no test calls
them) before anything imports torchvision (timm does too).
"""

from __future__ import annotations

from sacplan.testing.torchvision_cpu import declare_torchvision_schemas

_LIBS = declare_torchvision_schemas()  # kept alive: a dropped Library object removes its definitions
