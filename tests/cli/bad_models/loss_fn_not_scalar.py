"""Bad model file: loss_fn() returns one loss per sample instead of a scalar."""

import torch
import torch.nn.functional as F


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))


def loss_fn(outputs, targets):
    return F.cross_entropy(outputs, targets, reduction="none")
