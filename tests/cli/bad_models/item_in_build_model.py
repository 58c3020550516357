"""Bad model file: build_model() reads a tensor value (.item()), which fails on the meta device."""

import torch


def build_model():
    model = torch.nn.Linear(4, 2)
    scale = model.weight.abs().max().item()
    with torch.no_grad():
        model.weight.div_(scale)
    return model


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
