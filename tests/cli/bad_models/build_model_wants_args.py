"""Bad model file: build_model() needs an argument the planner cannot give."""

import torch


def build_model(width):
    return torch.nn.Linear(width, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
