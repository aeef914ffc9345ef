"""Small ResNet: many small dense tensors (convs, BatchNorm), the opposite of the embedding workloads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ddlscale.workloads.validation import require_int_at_least
from ddlscale.workloads.workload import Workload

_NOISE_STD = 1.0


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut; a 1x1 projection when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCNN(Workload):
    """Stem, ``num_blocks`` basic blocks (every second one halves resolution, doubles channels), head."""

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 16,
        num_blocks: int = 4,
        image_size: int = 16,
        batch_size: int = 32,
        num_samples: int = 4096,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        data_seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_samples, lr, optimizer, momentum, data_seed)
        self.save_hyperparameters()
        self.num_classes = require_int_at_least("num_classes", num_classes, 2)
        self.width = require_int_at_least("width", width, 1)
        self.num_blocks = require_int_at_least("num_blocks", num_blocks, 1)
        self.image_size = require_int_at_least("image_size", image_size, 1)

        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        blocks = []
        channels = width
        for index in range(num_blocks):
            downsample = index % 2 == 1
            out_channels = channels * 2 if downsample else channels
            blocks.append(BasicBlock(channels, out_channels, stride=2 if downsample else 1))
            channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def make_dataset(self) -> TensorDataset:
        # One fixed random template per class plus heavy noise: learnable but not trivial.
        generator = self.data_generator()
        shape = (3, self.image_size, self.image_size)
        templates = torch.randn(self.num_classes, *shape, generator=generator)
        labels = torch.randint(self.num_classes, (self.num_samples,), generator=generator)
        noise = torch.randn(self.num_samples, *shape, generator=generator) * _NOISE_STD
        return TensorDataset(templates[labels] + noise, labels)

    def forward(self, images: Tensor) -> Tensor:
        features = self.blocks(self.stem(images))
        return self.head(F.adaptive_avg_pool2d(features, 1).flatten(1))

    def loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)
