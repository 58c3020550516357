"""Bad model file: build_model is a model instance, not a function that builds one."""

import torch

build_model = torch.nn.Linear(4, 2).state_dict()


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
