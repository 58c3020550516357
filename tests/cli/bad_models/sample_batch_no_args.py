"""Bad model file: sample_batch() takes no batch size."""

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch():
    return torch.randn(8, 4), torch.randint(0, 2, (8,))
