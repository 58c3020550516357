"""Bad model file: defines build_model() but no sample_batch()."""

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def get_batch(batch_size):  # the wrong name
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
