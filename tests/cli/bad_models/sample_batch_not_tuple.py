"""Bad model file: sample_batch() returns the inputs alone, without targets."""

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4)
