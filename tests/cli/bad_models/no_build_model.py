"""Bad model file: defines sample_batch() but no build_model()."""

import torch


def make_model():  # the wrong name
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
