"""A ResNet-18-style CNN written by hand (torchvision is not needed), for 64x64 RGB images.

Layout as in torchvision's ``resnet18``: ``conv1`` (7x7, stride 2) -> ``bn1`` -> ``relu`` ->
``maxpool`` -> ``layer1`` .. ``layer4`` (each an ``nn.Sequential`` of two ``BasicBlock``s; the first
block of layers 2-4 halves the resolution and has a 1x1-conv ``downsample``) -> ``avgpool`` -> ``fc``.
Widths 64, 128, 256, 512; as in torchvision, ReLUs are in-place and each block reuses one ReLU
module twice.

Sizes: inputs (B, 3, 64, 64) float (feature maps 32 -> 16 -> 16 -> 8 -> 4 -> 2), 100 classes,
about 11.2 M parameters. Targets are integer class ids (B,), so the default cross-entropy applies.

    plan profile examples/resnet.py --batch-size 32
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE_SIZE = 64
NUM_CLASSES = 100
WIDTHS = (64, 128, 256, 512)
BLOCKS_PER_STAGE = (2, 2, 2, 2)


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module | None:
    """The residual branch's projection where the block changes shape (None: identity)."""
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    expansion = 1  # output channels per unit of width

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(in_ch, out_ch, stride)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, widths=WIDTHS, blocks=BLOCKS_PER_STAGE, block=BasicBlock):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_ch = widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks)):
            stride = 1 if i == 0 else 2
            out_ch = width * block.expansion
            stage = [block(in_ch, width, stride)] + [block(out_ch, width) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
            in_ch = out_ch
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model() -> nn.Module:
    return ResNet()


def image_batch(batch_size: int, image_size: int, num_classes: int):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g)
    return images, labels


def sample_batch(batch_size: int):
    return image_batch(batch_size, IMAGE_SIZE, NUM_CLASSES)
