"""Bad model file: sample_batch() returns (inputs, mask, targets), three items."""

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.ones(batch_size, 4), torch.randint(0, 2, (batch_size,))
