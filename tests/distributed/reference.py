"""What a distributed run is checked against: one process training on the whole global batch
(same seed, same data), and the comparison every parity test makes; the plans of a set of
configurations, and their runs, one launch per world size."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from planner.model_file import load_model_file
from planner.plan import Plan
from planner.planning import PlanRequest, make_plan, profile_for
from planner.search.space import Fixed
from runtime.launch import LaunchResult, launch
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


def make_plans(model: Path, configs: dict[str, tuple[int, Fixed]], workdir: Path, global_batch: int,
               gpus_per_node: int | None = None) -> dict[str, Path]:
    """name -> plan file, for each (world size, fixed choices) of `configs` on `model` (CPU, fp32,
    SGD; one profile for all; 2 GPUs a "node" for HSDP, `gpus_per_node` for every plan when given)."""
    handle = load_model_file(model)
    profile = profile_for(handle, PlanRequest(gpus=2, gpu="cpu", global_batch=global_batch, optimizer="sgd", precision="fp32"))
    out = {}
    for name, (world, fixed) in configs.items():
        request = PlanRequest(gpus=world, gpu="cpu", global_batch=global_batch, fixed=fixed, optimizer="sgd",
                              precision="fp32", gpus_per_node=gpus_per_node or (2 if fixed.hsdp else None))
        out[name] = workdir / f"{name}.json"
        out[name].write_text(make_plan(handle, request, profile).to_json())
    return out


def run_by_world(plans: dict[str, Path], configs: dict[str, tuple[int, Fixed]], workdir: Path, steps: int,
                 check: Callable[[LaunchResult, list[str]], None] | None = None) -> dict[str, tuple[object, Path]]:
    """name -> (RunReport, params.pt): one launch per world size runs its plans in turn (a launch
    costs seconds); `check(result, names)` looks at each launch."""
    out = {}
    for world in sorted({w for w, _ in configs.values()}):
        names = [n for n, (w, _) in configs.items() if w == world]
        result = launch([plans[n] for n in names], world, steps=steps, save_params=True, timeout_s=300,
                        run_dir=workdir / f"w{world}")
        if check is not None:
            check(result, names)
        out.update({n: (result.reports[i], result.run_dir / f"plan{i}" / "params.pt") for i, n in enumerate(names)})
    return out
