"""One way to parallelise a module, whether it is the whole model or one pipeline stage: FP8
Linears where the plan trains in FP8, expert parallelism, tensor parallelism, then recompute, then
data parallelism (torchtitan's
``parallelize_llama`` order: EP splits the experts, TP shards the Linears, checkpointing wraps the
sharded layers, FSDP2 or DDP wraps the result).

The worker (no pipeline), the sequential pipeline stages and the traced pipeline stages all call
``parallelize``; only what each hands it differs (the module, its layers, its recompute choices).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.plan import Plan
from runtime.data_parallel import apply_dp, data_mesh, uses_fsdp
from runtime.expert_parallel import apply_expert_parallel
from runtime.float8 import apply_float8
from runtime.recompute import apply_recompute_layers
from runtime.tensor_parallel import apply_tp
from runtime.types import LayerSplit


def parallelize(
    module: nn.Module,
    plan: Plan,
    layers: tuple[LayerSplit, ...],
    mesh: DeviceMesh,
    device: torch.device,
    recompute: dict[str, str],
    *,
    pipeline: bool = False,
    ignore: list[str] | tuple[str, ...] = (),
    materialize: Callable[[], None] | None = None,
) -> nn.Module:
    """Apply the plan to `module` (holding `layers`) on `mesh` (dims "dp" and "tp", and "cp" with
    context parallelism: data parallelism then spans dp x cp); the module to call (the DDP wrapper,
    or `module` itself). With expert parallelism, `module` carries its ExpertParallel
    (``runtime.expert_parallel.expert_parallel_of``).

    `recompute`: layer name -> full | selective | alternate (runtime.recompute.recompute_of).
    `pipeline`, `ignore`: as ``apply_dp`` (a PipelineStage's module; parameters its forward never
    uses). `materialize`: a module built on the meta device allocates its real tensors here: before
    DDP (which wraps real tensors), after FSDP2 (so only this rank's shards are allocated)."""
    p = plan.parallel
    if plan.training.precision == "fp8":  # torchao's Float8 Linears, before any sharding (runtime.float8)
        apply_float8(module)
    # Expert parallelism first: DP must see this rank's experts only (and the placeholders of the others).
    experts = apply_expert_parallel(module, plan, device.type, mesh["tp"].get_group() if p.tp > 1 else None)
    if p.tp > 1:
        apply_tp(module, layers, mesh["tp"], p.sequence_parallel, p.ep)
    apply_recompute_layers(module, recompute)
    fsdp = uses_fsdp(plan)
    if materialize is not None and not fsdp:
        materialize()
    wrapped = apply_dp(module, plan, layers, data_mesh(mesh, plan), device, ignore=ignore, pipeline=pipeline,
                       experts=experts)
    if materialize is not None and fsdp:
        materialize()
    return wrapped
