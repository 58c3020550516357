"""What a distributed run is checked against: one process training on the whole global batch
(same seed, same data), and the comparison every parity test makes."""

from __future__ import annotations

from pathlib import Path

import torch

from planner.model_file import load_model_file
from planner.plan import Plan
from runtime.train import LEARNING_RATE, MODEL_SEED, global_batch

RTOL_LOSS = 1e-5
ATOL_PARAM = 1e-5


def single_process(plan_path: Path, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and final parameters of one process, SGD, on the plan's model and data."""
    plan = Plan.load(plan_path)
    handle = load_model_file(plan.model.path)
    torch.manual_seed(MODEL_SEED)
    model = handle.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE["sgd"])
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(handle, plan, step)
        optimizer.zero_grad()
        loss = handle.loss(handle.forward(model, inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # every name of a tied parameter (a run may save it under either or both), one tensor for all
    clones: dict[int, torch.Tensor] = {}
    return losses, {n: clones.setdefault(id(p), p.detach().clone()) for n, p in model.named_parameters(remove_duplicate=False)}


def assert_matches(name: str, losses: tuple[float, ...], params_path: Path,
                   reference: tuple[list[float], dict[str, torch.Tensor]], first_step: int = 0) -> None:
    """Every step's loss within RTOL_LOSS (relative), every final parameter within ATOL_PARAM.
    `first_step`: a resumed run's losses start there."""
    ref_losses, ref_params = reference
    assert len(losses) == len(ref_losses) - first_step, f"{name}: {len(losses)} losses, not steps {first_step + 1}-{len(ref_losses)}"
    for step, (got, want) in enumerate(zip(losses, ref_losses[first_step:]), first_step):
        assert abs(got - want) <= RTOL_LOSS * abs(want), f"{name}: step {step} loss {got} != {want}"
    params = torch.load(params_path, weights_only=True)
    extra = set(params) - set(ref_params)
    assert not extra, f"{name}: parameters the model does not have: {extra}"
    # tied names share one tensor in the reference: each tensor must be saved under one name at least
    by_tensor: dict[int, list[str]] = {}
    for pname, t in ref_params.items():
        by_tensor.setdefault(id(t), []).append(pname)
    missing = [names[0] for names in by_tensor.values() if not any(n in params for n in names)]
    assert not missing, f"{name}: parameters not saved: {missing}"
    for pname, want in ref_params.items():
        if pname not in params:  # another name of a tied parameter was saved
            continue
        got = params[pname]
        assert got.shape == want.shape, f"{name}: {pname} shape {tuple(got.shape)} != {tuple(want.shape)}"
        diff = (got - want).abs().max().item()
        assert diff <= ATOL_PARAM, f"{name}: {pname} differs by {diff:.2e}"
