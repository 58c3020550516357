"""ResNet-50 for ImageNet written by hand (torchvision is not needed): 224x224 RGB, 1000 classes.

Layout as torchvision's ``resnet50`` (He et al. 2016, Table 1): ``conv1`` (7x7, stride 2) -> ``bn1``
-> ``relu`` -> ``maxpool`` -> ``layer1`` .. ``layer4`` (3, 4, 6 and 3 ``Bottleneck`` blocks: 1x1,
3x3, 1x1 convolutions with 4x expansion, stride on the 3x3 as in torchvision v1.5) -> ``avgpool``
-> ``fc``. About 25.6 M parameters and 4.1 GMACs per image.

    plan examples/resnet50.py --gpus 8
"""

from __future__ import annotations

import torch
from torch import nn

from resnet import conv3x3

IMAGE_SIZE = 224
NUM_CLASSES = 1000
WIDTHS = (64, 128, 256, 512)
BLOCKS_PER_STAGE = (3, 4, 6, 3)
EXPANSION = 4


class Bottleneck(nn.Module):
    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * EXPANSION
        self.conv1 = nn.Conv2d(in_ch, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, WIDTHS[0], kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(WIDTHS[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_ch = WIDTHS[0]
        for i, (width, n) in enumerate(zip(WIDTHS, BLOCKS_PER_STAGE)):
            stride = 1 if i == 0 else 2
            stage = [Bottleneck(in_ch, width, stride)] + [Bottleneck(width * EXPANSION, width) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
            in_ch = width * EXPANSION
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
    return ResNet50()


def sample_batch(batch_size: int):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)
    return images, labels
