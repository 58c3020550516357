"""Bad model file: build_model() raises."""

import torch

WIDTH = 7


def build_model():
    if WIDTH % 2:
        raise ValueError(f"width must be even, got {WIDTH}")
    return torch.nn.Linear(WIDTH, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randint(0, 2, (batch_size,))
