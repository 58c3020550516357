"""Bad model file: raises at import time (top-level code)."""

import os

import torch

if "MY_CLUSTER_CONFIG" not in os.environ or True:
    raise RuntimeError("MY_CLUSTER_CONFIG is not set")


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
