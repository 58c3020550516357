"""A small MLP classifier: the simplest model file.

Sizes: 784 inputs (a flattened 28x28 image) -> 512 -> 512 -> 10 classes, GELU between the Linear
layers; about 0.67 M parameters. Inputs are float tensors of shape (B, 784), targets integer class
ids of shape (B,), so the default loss (cross-entropy) applies.

    plan profile examples/mlp.py --batch-size 64
"""

import torch
from torch import nn

IN_FEATURES = 784
HIDDEN = 512
NUM_CLASSES = 10


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, NUM_CLASSES),
    )


def sample_batch(batch_size: int):
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch_size, IN_FEATURES, generator=g)
    targets = torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)
    return inputs, targets
