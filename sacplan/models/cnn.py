"""A small ResNet-style image classifier.

Shapes: ``B`` batch, ``C`` channels of a stage, ``R`` image size (square), ``K`` classes.

    images (B, 3, R, R)
      stem: conv3x3 -> BatchNorm -> ReLU                  (B, C0, R, R)
      layers: ``n_blocks`` ResidualBlocks per stage; each stage after the first halves R and
              widens to its channel count                 (B, C_last, R / 2**(stages-1), same)
      pool: global average                                (B, C_last, 1, 1) -> flatten (B, C_last)
      dropout, fc                                         (B, K)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sacplan.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """Shape of a :class:`SmallCNN`.

    Attributes:
        channels: width of each stage; stage ``i > 0`` halves the resolution with a stride-2 block.
        n_blocks: residual blocks per stage.
        num_classes: classifier outputs.
        image_size: side of the square input images (must be divisible by ``2 ** (len(channels) - 1)``).
        dropout: dropout probability before the classifier.
    """

    channels: tuple[int, ...] = (16, 32, 64)
    n_blocks: int = 2
    num_classes: int = 10
    image_size: int = 32
    dropout: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))
        if not self.channels or any(c <= 0 for c in self.channels):
            raise ConfigError(f"CNNConfig.channels must be positive widths, got {self.channels}")
        for name in ("n_blocks", "num_classes", "image_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"CNNConfig.{name} must be positive, got {getattr(self, name)}")
        if self.image_size % 2 ** (len(self.channels) - 1):
            raise ConfigError(
                f"CNNConfig.image_size={self.image_size} must be divisible by 2**{len(self.channels) - 1}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"CNNConfig.dropout must lie in [0, 1), got {self.dropout}")

    def with_(self, **changes: Any) -> CNNConfig:
        """A copy with some fields changed, e.g. ``cfg.with_(n_blocks=1)``."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown CNNConfig field(s) {unknown}; fields are {sorted(names)}")
        return dataclasses.replace(self, **changes)


CNN_PRESETS: dict[str, CNNConfig] = {
    # For tests: 5,266 parameters, a CPU training step in milliseconds.
    "cnn-tiny": CNNConfig(channels=(8, 16), n_blocks=1, num_classes=10, image_size=32),
    # A ResNet-18-like layout on 64x64 images.
    "cnn-small": CNNConfig(channels=(32, 64, 128, 256), n_blocks=2, num_classes=100, image_size=64),
}


class ResidualBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``; the shortcut is a 1x1 conv + BN when the
    shape changes, the identity otherwise."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut: nn.Module
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))  # (B, c_out, R / stride, R / stride)
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class SmallCNN(nn.Module):
    """Images ``(B, 3, R, R)`` -> logits ``(B, K)``."""

    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        self.config = config
        c0 = config.channels[0]
        self.stem = nn.Sequential(nn.Conv2d(3, c0, 3, padding=1, bias=False), nn.BatchNorm2d(c0), nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        c_in = c0
        for stage, c_out in enumerate(config.channels):
            for i in range(config.n_blocks):
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(ResidualBlock(c_in, c_out, stride))
                c_in = c_out
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(config.dropout)
        self.fc = nn.Linear(c_in, config.num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images)  # (B, C0, R, R)
        x = self.layers(x)  # (B, C_last, R', R')
        x = self.pool(x).flatten(1)  # (B, C_last)
        return self.fc(self.dropout(x))  # (B, K)


def example_images(
    batch: int, image_size: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Tensor:
    """Deterministic images ``(batch, 3, image_size, image_size)`` in [-1, 1], made on ``device`` (meta works)."""
    n = torch.arange(batch * 3 * image_size * image_size, device=device, dtype=torch.float32)
    images = torch.sin(n * 0.7133).view(batch, 3, image_size, image_size)
    return images if dtype is None else images.to(dtype)


def classification_loss(logits: Tensor, images: Tensor) -> Tensor:
    """Cross-entropy of ``logits`` (B, K) against fixed labels ``arange(B) % K`` (made from the batch size)."""
    B, K = logits.shape
    labels = torch.arange(B, device=logits.device) % K
    return F.cross_entropy(logits.float(), labels)
