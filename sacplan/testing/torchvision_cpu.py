"""Import torchvision (and what imports it: transformers' Trainer, Lightning, timm) beside a CPU torch wheel.

PyPI's torchvision wheel installed ``--no-deps`` beside the CPU torch wheel carries compiled ops built for
another torch build, which do not load there: ``import torchvision`` then fails with ``operator
torchvision::nms does not exist``, because importing it registers fake kernels for three of its ops. Its
models are plain Python and need none of them, so :func:`declare_torchvision_schemas` declares exactly those
three schemas (never implemented; nothing calls them) when they are missing. Call it before the import, and
keep the returned objects alive (a dropped ``torch.library.Library`` removes its definitions).
"""

from __future__ import annotations

import torch

__all__ = ["TORCHVISION_SCHEMAS", "declare_torchvision_schemas"]

#: The ops whose fake kernels ``import torchvision`` registers (0.28), by name: their schemas.
TORCHVISION_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": (
        "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
        "int sampling_ratio, bool aligned) -> Tensor"
    ),
}


def _defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


def declare_torchvision_schemas() -> list[torch.library.Library]:
    """Declare the schemas of :data:`TORCHVISION_SCHEMAS` that are missing (none when torchvision's own
    compiled ops loaded, or when already declared); returns the libraries to keep alive."""
    libs = []
    for name, schema in TORCHVISION_SCHEMAS.items():
        if _defined(name):
            continue
        lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define(schema)
        libs.append(lib)
    return libs
