"""Bad model file: build_model() returns a state dict instead of a Module."""

import torch


def build_model():
    return torch.nn.Linear(4, 2).state_dict()


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
