"""Bad model file: sample_batch() raises."""

import torch


def build_model():
    return torch.nn.Linear(4, 2)


def sample_batch(batch_size):
    data = {"train": torch.randn(100, 4)}
    return data["validation"][:batch_size], torch.randint(0, 2, (batch_size,))
