"""runtime.train.optimizer_class: the optimizer the runtime steps, as the cost model prices it."""

from __future__ import annotations


def test_the_runtime_steps_a_fused_optimizer_on_cuda_as_the_cost_model_prices_it():
    """On CUDA the optimizer is torch's fused implementation (one pass over each tensor, the traffic
    Training.optimizer_traffic_per_param prices; the default foreach one took 3.3x that time on an
    H200); elsewhere torch's default. `plan calibrate` times the same."""
    import torch

    from runtime.train import optimizer_class

    for name, cls in (("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
        got_cls, cuda = optimizer_class(name, "cuda")
        assert got_cls is cls and cuda.get("fused") is True and cuda["lr"] > 0
        assert "fused" not in optimizer_class(name, "cpu")[1]
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    cls, options = optimizer_class("adamw", "cpu")
    cls([p], **options).step()
    assert float(p.detach().abs().sum()) > 0  # the options build a working optimizer
