"""Bad model file: a training script that calls sys.exit() at import."""

import sys

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))


sys.exit(3)
