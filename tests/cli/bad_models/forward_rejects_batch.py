"""Bad model file: the batch has 100 features but the model expects 784."""

import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def sample_batch(batch_size):
    return torch.randn(batch_size, 100), torch.randint(0, 10, (batch_size,))
