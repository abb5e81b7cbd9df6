"""Conformance set-up: torchvision's model code without its compiled ops.

PyPI torchvision is installed ``--no-deps`` beside the CPU torch wheel, and its compiled ops do not load
there; its models are pure Python, but importing it registers fake kernels for ``torchvision::nms`` / ``qnms``
(0.28) and ``torchvision::roi_align``, which needs their schemas. Declare exactly those (never implemented:
no test calls them) before anything imports torchvision (timm does too).
"""

from __future__ import annotations

import torch

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": (
        "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
        "int sampling_ratio, bool aligned) -> Tensor"
    ),
}


def _declare_torchvision_schemas() -> list[torch.library.Library]:
    libs = []
    for name, schema in _SCHEMAS.items():
        if torch._C._dispatch_has_kernel(f"torchvision::{name}") or _defined(name):
            continue  # torchvision's own compiled ops loaded (a matching build)
        lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define(schema)
        libs.append(lib)
    return libs


def _defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


_LIBS = _declare_torchvision_schemas()  # kept alive: a dropped Library object removes its definitions
