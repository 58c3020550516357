"""Bad model file: the forward returns a dict without "logits", and there is no loss_fn."""

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return {"scores": self.fc(x)}


def build_model():
    return Net()


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
