"""Bad model file: imports a package that is not installed."""

import torch
import not_a_real_pkg  # noqa: F401


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
