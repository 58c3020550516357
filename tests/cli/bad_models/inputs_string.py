"""Bad model file: the inputs are raw text, not tensors."""

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return "the quick brown fox", torch.randint(0, 2, (batch_size,))
