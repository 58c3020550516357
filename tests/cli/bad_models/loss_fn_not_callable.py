"""Bad model file: loss_fn names a loss instead of being one."""

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))


loss_fn = "cross_entropy"
