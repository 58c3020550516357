"""ResNet-50 for ImageNet written by hand (torchvision is not needed): 224x224 RGB, 1000 classes.

``resnet.py``'s network (imported from the file next to this one) with torchvision's ``resnet50``
layout (He et al. 2016, Table 1): 3, 4, 6 and 3 ``Bottleneck`` blocks (1x1, 3x3, 1x1
convolutions with 4x expansion, the stride on the 3x3 as in torchvision v1.5). About 25.6 M
parameters and 4.1 GMACs per image.

    plan examples/resnet50.py --gpus 8
"""

from __future__ import annotations

import torch
from torch import nn

from resnet import ResNet, conv3x3, image_batch, shortcut

IMAGE_SIZE = 224
NUM_CLASSES = 1000


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def build_model() -> nn.Module:
    return ResNet(num_classes=NUM_CLASSES, blocks=(3, 4, 6, 3), block=Bottleneck)


def sample_batch(batch_size: int):
    return image_batch(batch_size, IMAGE_SIZE, NUM_CLASSES)
