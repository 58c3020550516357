"""The training loop a worker runs: data slicing, micro-batches, optimizer, measurements.

Data: each step draws one global batch with ``sample_batch(global_batch)`` after
``torch.manual_seed(DATA_SEED + step)``; data-parallel rank d takes rows
``[d * B/dp, (d+1) * B/dp)`` and splits them into ``num_microbatches`` micro-batches of
``micro_batch`` rows; the ranks of a tensor-parallel group take the same rows, and those of a
context-parallel group their own chunks of each row's sequence (runtime.context_parallel). Each
micro-batch's loss is scaled by ``1/num_microbatches`` so the accumulated gradient is the local
batch's mean, and data parallelism averages over dp (x cp): the gradient of the global batch's
mean loss, as one process computing it on the whole batch (the parity tests check it).
"""

from __future__ import annotations

import logging
import resource
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from planner.model_file import ModelHandle, call_model
from planner.plan import Plan
from runtime.data_parallel import set_grad_sync
from runtime.phases import BACKWARD_SCOPE, FORWARD_SCOPE, OPTIMIZER_SCOPE, phase_times, profiled, scope

if TYPE_CHECKING:
    from runtime.context_parallel import ContextParallel
    from runtime.expert_parallel import ExpertParallel

log = logging.getLogger(__name__)
MODEL_SEED = 1234
"""torch.manual_seed before build_model() on every rank: identical initial weights everywhere."""
DATA_SEED = 5678
LEARNING_RATE = {"sgd": 0.05, "adamw": 3e-4}
PROFILE_MIN_STEPS = 3
"""A run of at least this many steps profiles its last (runtime.phases), which the median step
time leaves out (the first is the warm-up): one step is left to time at 3."""


@dataclass(frozen=True)
class RankResult:
    """What one rank measured (written as JSON per rank)."""

    rank: int
    losses: tuple[float, ...]
    """Per step, the global batch's mean loss (averaged over dp)."""
    step_times_s: tuple[float, ...]
    peak_memory_bytes: int
    """CUDA: what the caching allocator held at most (max_memory_reserved, what trainers report);
    CPU: the process's peak RSS."""
    optimizer_times_s: tuple[float, ...] = ()
    """Per step, the optimizer step's seconds (the rest of the step is forward, backward and their
    communication)."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """The last step, profiled: seconds per phase (runtime.phases.PHASES); {} when the run has too
    few steps to spare one (PROFILE_MIN_STEPS)."""
    profiled_step_s: float = 0.0
    """That step's time under the profiler, the phases' sum (the step is left out of the median)."""
    peak_allocated_bytes: int = 0
    """CUDA: the tensors' peak (max_memory_allocated); 0 on CPU."""


def make_optimizer(
    plan: Plan, model: nn.Module, dp_group: dist.ProcessGroup | None = None, experts: "ExpertParallel | None" = None,
) -> "torch.optim.Optimizer | Optimizers":
    """The plan's optimizer over `model`'s parameters (`experts`: expert parallelism's split of it)."""
    return make_optimizer_for(plan, list(model.parameters()), dp_group,
                              experts.parameters() if experts is not None else (),
                              experts.replica_mesh.get_group() if experts is not None else None)


def optimizer_class(name: str, device_type: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch.optim class and options the runtime steps `name` ("adamw" | "sgd") with on
    `device_type`. On CUDA the fused implementation (one kernel over all tensors, each read and
    written once: the traffic the cost model prices, Training.optimizer_traffic_per_param, as
    torchtitan's default "fused" and Megatron-LM's fused Adam run it); torch's default there, the
    foreach one, made a separate pass per arithmetic op, 3.3x the fused traffic's time on an H200
    (41 ms against 12.5 ms for 1.92 B parameters; bench/measured/h200_fp8_eager_2026-12-04.txt)."""
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    options: dict[str, Any] = {"lr": LEARNING_RATE[name]}
    if device_type == "cuda":
        options["fused"] = True
    return cls, options


def _optimizer(plan: Plan, params: list[nn.Parameter], group: dist.ProcessGroup | None, what: str) -> torch.optim.Optimizer:
    device_type = params[0].device.type if params else "cpu"
    cls, options = optimizer_class(plan.training.optimizer, device_type)
    if plan.parallel.zero == 1 and group is not None and dist.get_world_size(group) > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        log.info("optimizer: ZeroRedundancyOptimizer(%s) over %d %s", cls.__name__, dist.get_world_size(group), what)
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group, **options)
    return cls(params, **options)


def make_optimizer_for(
    plan: Plan, params: list[nn.Parameter], dp_group: dist.ProcessGroup | None = None,
    experts: list[nn.Parameter] | tuple[nn.Parameter, ...] = (), expert_group: dist.ProcessGroup | None = None,
) -> "torch.optim.Optimizer | Optimizers":
    """The plan's optimizer over `params`. ZeRO-1 with a dp group (dp > 1): wrapped in
    ``ZeroRedundancyOptimizer`` over that group, so each rank holds and updates the optimizer state
    of its shard of the parameters and broadcasts the updated ones after the step.

    With expert parallelism, `experts` (of `params`: this rank's experts, different on every rank
    of an EP group) get an optimizer of their own, sharded under ZeRO-1 over `expert_group` (the
    ranks holding the same experts), never over dp (a ZeroRedundancyOptimizer broadcasts each
    parameter from the rank that updated it); both are stepped as one (``Optimizers``)."""
    mine = {id(q) for q in experts}
    dense = _optimizer(plan, [q for q in params if id(q) not in mine], dp_group, "dp ranks")
    if not mine:
        return dense
    return Optimizers(dense, _optimizer(plan, [q for q in params if id(q) in mine], expert_group, "expert replicas"))


class Optimizers:
    """Several optimizers stepped as one: the dense parameters' and the experts' (a
    ZeroRedundancyOptimizer holds one process group for all its parameters, and the two are
    sharded over different ranks)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeroRedundancyOptimizer's local one (its shard of
    the parameters), the optimizer itself otherwise."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of every tensor in a batch (a Tensor, a tuple/list or a dict)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: slice_rows(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_rows(v, start, stop) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def global_batch(handle: ModelHandle, plan: Plan, step: int) -> tuple[Any, Any]:
    """The step's global batch: the same on every rank, and in the single-process reference."""
    torch.manual_seed(DATA_SEED + step)
    return handle.sample_batch(plan.training.global_batch)


def microbatches(handle: ModelHandle, plan: Plan, step: int, dp_index: int) -> list[tuple[Any, Any]]:
    """This dp rank's micro-batches of the step's global batch."""
    p = plan.parallel
    local = p.micro_batch * p.num_microbatches
    assert local * p.dp == plan.training.global_batch, (
        f"micro_batch({p.micro_batch}) * num_microbatches({p.num_microbatches}) * dp({p.dp}) "
        f"!= global batch({plan.training.global_batch})"
    )
    inputs, targets = global_batch(handle, plan, step)
    out = []
    for m in range(p.num_microbatches):
        start = dp_index * local + m * p.micro_batch
        out.append((slice_rows(inputs, start, start + p.micro_batch), slice_rows(targets, start, start + p.micro_batch)))
    return out


def peak_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(what the process held at most, its tensors' peak): on CUDA the caching allocator's reserved
    and allocated peaks, on CPU the peak RSS (and 0: no allocator statistics)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device)), int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, 0  # Linux: KiB


def run_steps(
    steps: int,
    start_step: int,
    device: torch.device,
    rank: int,
    optimizer: torch.optim.Optimizer,
    load: Callable[[int], Any],
    forward_backward: Callable[[Any], torch.Tensor],
    loss_groups: tuple[tuple[dist.ProcessGroup | None, int], ...],
    after_step: Callable[[int], None] | None = None,
    parallel: Any = None,
) -> RankResult:
    """The training step every run uses, plain or pipelined: for steps `start_step`..`steps - 1`,
    this rank's data `load(step)` (not timed), then zero the gradients, `forward_backward(data)`
    (this rank's micro-batches, forward and backward; its share of the step's loss), the optimizer
    step, then the loss summed over each of
    `loss_groups` and divided by its count (the pipeline ranks, whose last stage alone holds the
    loss; the data-parallel ranks, averaged). Per step: that loss and the wall time; the peak memory.
    `after_step(n)` runs after the n-th step (n counted from 1: a checkpoint hook). With at least
    PROFILE_MIN_STEPS steps the last runs under the profiler, which splits it into the phases of
    runtime.phases (`parallel`: the plan's degrees, which tell its communication apart)."""
    losses: list[float] = []
    phases: dict[str, float] = {}
    profiled_s = 0.0
    profile_step = steps - 1 if steps - start_step >= PROFILE_MIN_STEPS else None
    times: list[float] = []
    opt_times: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(start_step, steps):
        data = load(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with profiled(device, step == profile_step) as events:
            optimizer.zero_grad(set_to_none=True)
            total = forward_backward(data).detach().float().reshape(())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            before = time.perf_counter()
            with scope(OPTIMIZER_SCOPE):
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            opt_times.append(time.perf_counter() - before)
        if step == profile_step:  # the step's time inside the profiler (not its start and stop)
            phases = phase_times(events(), parallel, cuda=device.type == "cuda")
            profiled_s = sum(phases.values())
        for group, count in loss_groups:
            if group is not None:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
                total /= count
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(total))
        if after_step is not None:
            after_step(step + 1)
    held, allocated = peak_memory_bytes(device)
    return RankResult(rank, tuple(losses), tuple(times), held, tuple(opt_times), phases, profiled_s, allocated)


def train(
    handle: ModelHandle,
    plan: Plan,
    wrapped: nn.Module,
    model: nn.Module,
    dp_index: int,
    dp_group: dist.ProcessGroup | None,
    steps: int,
    device: torch.device,
    rank: int,
    autocast_dtype: torch.dtype | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    after_step: Callable[[int], None] | None = None,
    cp: "ContextParallel | None" = None,
    experts: "ExpertParallel | None" = None,
) -> RankResult:
    """A run without a pipeline: each step, this dp rank's micro-batches through `wrapped`, the
    gradients synchronised on the last (``run_steps``). With context parallelism (`cp`) each
    micro-batch runs on this rank's share of its sequences, and `dp_group` is the dp x cp ranks.
    With expert parallelism (`experts`) the experts' gradients are synchronised after the last."""
    if optimizer is None:
        optimizer = make_optimizer(plan, model)
    num_mb = plan.parallel.num_microbatches

    def load(step: int) -> list[tuple[Any, Any]]:
        return [(to_device(i, device), to_device(t, device)) for i, t in microbatches(handle, plan, step, dp_index)]

    def forward_backward(batches: list[tuple[Any, Any]]) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for m, batch in enumerate(batches):
            sharded = cp.sharded(*batch) if cp else nullcontext(batch)
            with set_grad_sync(wrapped, m == num_mb - 1), sharded as (inputs, targets):
                with scope(FORWARD_SCOPE), torch.autocast(device.type, dtype=autocast_dtype,
                                                          enabled=autocast_dtype is not None):
                    loss = handle.loss(call_model(wrapped, inputs), targets) / num_mb
                with scope(BACKWARD_SCOPE):
                    loss.backward()
            total += loss.detach()
        if experts is not None:
            experts.sync_grads()
        return total

    groups = ((dp_group, dist.get_world_size(dp_group)),) if dp_group is not None else ()
    return run_steps(steps, start_step, device, rank, optimizer, load, forward_backward, groups, after_step,
                     plan.parallel)


def with_step1_hash(
    after_step: Callable[[int], None] | None, build: Any, params: dict[str, nn.Parameter], start_step: int,
) -> Callable[[int], None] | None:
    """On the meta path (`build`: runtime.meta_init.BuildInfo), also hash every parameter gathered
    whole after step 1 (a collective on every rank): data-parallel replicas must agree."""
    if build.path != "meta" or start_step > 0:
        return after_step
    from runtime.data_parallel import full_parameters
    from runtime.meta_init import params_sha256

    def hook(n: int) -> None:
        if n == 1:
            build.params_sha256_step1 = params_sha256(full_parameters(params))
        if after_step is not None:
            after_step(n)

    return hook


def timed_steps(count: int, profiled: bool = False) -> range:
    """The steps (indices of `count`) whose median is the run's step time: the later half of those
    after the first (a process's first steps warm up: on a CPU the allocator's thresholds grow for
    two or three steps, which then run 10-40% faster, as training's thousands do), without the
    last when it was `profiled`; the only step when there is one."""
    end = count - 1 if profiled and count > 2 else count
    first = 1 if end > 1 else 0
    return range(first + (end - first) // 2, end)


def median_step_time(times: tuple[float, ...], profiled: bool = False) -> float:
    """The median of `times` over timed_steps."""
    return statistics.median(times[i] for i in timed_steps(len(times), profiled))
