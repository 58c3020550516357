"""Data parallel over the mesh's "dp" axis, applied after TP and recompute (torchtitan's order).

ZeRO-0 is DDP (after TP, with the DTensor parameters localised by ``localize_tp_for_ddp``);
ZeRO-1 is the same DDP, with the optimizer state sharded by ``ZeroRedundancyOptimizer`` over the
same dp group (``runtime.train.make_optimizer_for``: full gradients all-reduced, each rank updates
its shard of the parameters and broadcasts them after the step); ZeRO 2/3 is FSDP2
``fully_shard`` on every layer and then the root, ``reshard_after_forward`` True for ZeRO-3 and
False for ZeRO-2; with HSDP (``parallel.dp_replicate`` > 1) on a 2-D (replicate, shard) mesh of
the same ranks, so that FSDP2 shards inside each group and all-reduces across the replicas.
Inside pipeline stages the same wrappers apply: ``PipelineStage`` runs a DDP
stage's micro-batches under ``no_sync`` and syncs on the last backward.

Mixed precision (bf16/fp16 plans), as the cost model counts it (16-bit weights, gradients and
activations for the forward and backward, fp32 master weights and optimizer state): FSDP2's
``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)``, as torchtitan does: the fp32
parameters are cast when gathered, so every activation is 16-bit, and gradients are reduced in
fp32. With dp == 1 the model is wrapped by FSDP2 over that one rank for this alone (nothing is
sharded). DDP (ZeRO-0/1 with dp > 1) runs the forward under ``torch.autocast`` instead, which keeps
the residual stream and norms in fp32 (activations about 1.4x the plan's on examples/gpt.py; the
run report says so).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.plan import Plan
from runtime.expert_parallel import ExpertParallel
from runtime.types import LayerSplit

log = logging.getLogger(__name__)


def _separately_shardable(model: nn.Module, layers: tuple[LayerSplit, ...]) -> list[str]:
    """Layers that own all their parameters (a tied weight stays with the root's FSDP group)."""
    owners: dict[int, set[str]] = {}
    for layer in layers:
        for p in model.get_submodule(layer.name).parameters():
            owners.setdefault(id(p), set()).add(layer.name)
    shared = {n for names in owners.values() if len(names) > 1 for n in names}
    return [
        l.name for l in layers
        if l.name not in shared and any(True for _ in model.get_submodule(l.name).parameters())
        and model.get_submodule(l.name) is not model
    ]


def _within(context: Callable[[], Any], forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return forward(*args, **kwargs)

    return run


def localize_tp_for_ddp(model: nn.Module) -> int:
    """DDP over tensor parallel: every DTensor parameter (a TP shard) becomes a plain Parameter
    holding the local shard (``_st_info``: its DTensorSpec), which DDP buckets and all-reduces over
    dp; the forward of the module owning it runs with ``DTensor.from_local`` of it in its place and
    puts the Parameter back when it returns or raises (the gradient flows through ``from_local``,
    whose backward also turns a partial gradient of a replicated parameter into the whole one). The
    number of parameters localised.

    Unlike ``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform`` (hooks on the root that
    leave the first forward's DTensors behind as plain attributes), the parameters stay registered,
    so ``parameters()`` after a forward still lists them (PipelineStage's ``scale_grads`` and the
    checkpoint's state dict rely on it); a layer recomputed in backward (torch.utils.checkpoint)
    swaps its DTensors in again, through the wrapped forward of the modules inside it or, for the
    checkpointed layer itself, through ``_forward_context`` (runtime.recompute enters it). A TP shard
    must be used inside its owning module's forward (TP shards Linear and Embedding weights)."""
    localized: dict[int, nn.Parameter] = {}
    for module in model.modules():
        mine: dict[str, nn.Parameter] = {}
        for leaf, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                local = localized.get(id(p))
                if local is None:
                    local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                    local._st_info = p._spec  # type: ignore[attr-defined]
                    localized[id(p)] = local
                module._parameters[leaf] = local
                mine[leaf] = local
        if not mine:
            continue

        @contextlib.contextmanager
        def views(mod: nn.Module = module, mine: dict[str, nn.Parameter] = mine) -> Iterator[None]:
            for leaf, local in mine.items():
                spec = local._st_info  # type: ignore[attr-defined]
                mod._parameters[leaf] = DTensor.from_local(  # type: ignore[assignment]
                    local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride,
                )
            try:
                yield
            finally:  # also when a recompute stops early (it raises through the forward)
                for leaf, local in mine.items():
                    mod._parameters[leaf] = local

        module.forward = _within(views, module.forward)  # type: ignore[method-assign]
        module._forward_context = views  # type: ignore[assignment]
    return len(localized)


SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""A plan's 16-bit compute dtype: an FP8 plan is bf16 mixed precision whose Linear matmuls run in
FP8 (runtime.float8), as the cost model counts it."""


def mixed_precision(plan: Plan) -> MixedPrecisionPolicy | None:
    dtype = SIXTEEN_BIT.get(plan.training.precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype is not None else None


def uses_fsdp(plan: Plan) -> bool:
    """Whether `apply_dp` wraps with FSDP2: ZeRO-2/3 over dp x cp > 1 ranks, or a 16-bit plan
    with one (FSDP2 over one rank carries the mixed precision). FSDP2 can wrap a model still on
    the meta device; DDP needs real tensors."""
    p = plan.parallel
    ranks = p.dp * p.cp
    return (ranks > 1 and p.zero >= 2) or (ranks == 1 and mixed_precision(plan) is not None)


def autocast_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype of ``torch.autocast`` around the forward: only for a 16-bit plan under DDP (FSDP2
    casts the parameters itself)."""
    return None if uses_fsdp(plan) else SIXTEEN_BIT.get(plan.training.precision)


def apply_dp(
    model: nn.Module, plan: Plan, layers: tuple[LayerSplit, ...], dp_mesh: DeviceMesh, device: torch.device,
    ignore: list[str] | tuple[str, ...] = (), pipeline: bool = False, experts: ExpertParallel | None = None,
) -> nn.Module:
    """Wrap the (TP-sharded, checkpointed) model for data parallelism over `dp_mesh`.

    Returns the module to call: the DDP wrapper for ZeRO-0/1, the model itself (now an FSDPModule)
    otherwise. With dp == 1 nothing is wrapped, except a 16-bit plan's FSDP2 over that one rank
    (``uses_fsdp``). `ignore`: names of parameters the forward never
    uses (a pipeline stage's parameters outside its layers), left out of DDP's buckets; `pipeline`:
    the module is a ``PipelineStage``'s (DDP without bucket rebuild, below). `experts`: expert
    parallelism's split (runtime.expert_parallel): this rank's experts are left out of DDP (their
    gradients are synchronised over their replicas by ``ExpertParallel.sync_grads``) or, under
    FSDP2, sharded over their replicas first, their gradients divided by dp."""
    zero = plan.parallel.zero
    if dp_mesh.size() == 1 and not uses_fsdp(plan):
        return model
    if not uses_fsdp(plan):
        localize_tp_for_ddp(model)
        ignore = [*ignore, *(experts.names if experts is not None else ())]
        if ignore:
            DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
        ids = [device.index] if device.type == "cuda" else None
        log.info("data parallel: DDP over %d ranks (ZeRO-%d)", dp_mesh.size(), zero)
        # In a pipeline stage, find_unused_parameters=True: with it DDP never rebuilds its buckets,
        # and the rebuild fails there (PipelineStage runs the micro-batches' backwards under no_sync
        # and the reducer counts the gradients of all of them: "rebuilt parameter indices size is not
        # same as original model parameters size", 36 vs 18 with two micro-batches; static_graph=True
        # runs but gives wrong gradients). Buckets stay in reverse parameter order. With context
        # parallelism each rank holds its own rows of the sequence buffers (RoPE tables): DDP must
        # not broadcast rank 0's over them before each forward.
        return DDP(model, process_group=dp_mesh.get_group(), device_ids=ids, find_unused_parameters=pipeline,
                   broadcast_buffers=plan.parallel.cp == 1)
    # One rank (mixed precision only): free the 16-bit copies after forward, as ZeRO-3 does.
    reshard = zero == 3 or dp_mesh.size() == 1
    mp = mixed_precision(plan) or MixedPrecisionPolicy()
    shard_mesh = hsdp_mesh(device.type, plan) if plan.parallel.dp_replicate > 1 else dp_mesh
    if experts is not None:
        shard_experts(experts, reshard, mp)
    for name in _separately_shardable(model, layers):
        fully_shard(model.get_submodule(name), mesh=shard_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard, mp_policy=mp)
    how = f"HSDP {plan.parallel.dp_replicate} replicas x {shard_mesh.shape[-1]} shards" if shard_mesh.ndim == 2 else f"over {dp_mesh.size()} rank(s)"
    log.info("data parallel: FSDP2 (ZeRO-%d) %s, parameters %s in compute", zero, how, plan.training.precision)
    return model


def shard_experts(experts: ExpertParallel, reshard: bool, mp: MixedPrecisionPolicy) -> None:
    """ZeRO-2/3 with expert parallelism: each module holding this rank's experts is its own FSDP2
    unit on the expert-replica mesh (the dp x cp x tp / ep ranks holding the same experts), before the layers
    (which then leave its parameters to it), as torchtitan shards experts. Its reduce-scatter sums
    over the replicas and divides by dp x cp: each replica's gradient is already the sum over its EP
    group's ranks (runtime.expert_parallel). With one replica there is nothing to reduce: FSDP2
    divides by the factor alone; with more, the sum is forced (gloo has no pre-multiplied sum) and
    divided after. The unit's inputs are not cast (a stacked module's routing weights stay as the
    router made them, as without expert parallelism, where the experts are inside their layer's unit)."""
    mp = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, cast_forward_inputs=False)
    for unit in experts.units:
        fully_shard(unit, mesh=experts.replica_mesh, reshard_after_forward=reshard, mp_policy=mp)
        unit.set_gradient_divide_factor(float(experts.grad_ranks))
        if experts.replicas > 1:
            unit.set_force_sum_reduction_for_comms(True)
    experts.fsdp = True


@functools.lru_cache(maxsize=None)
def _hsdp_mesh(device_type: str, pp: int, replicate: int, shard: int, tp: int) -> DeviceMesh:
    # rank = ((pp * replicate + r) * shard + s) * tp + t: the order tp, cp, dp, pp with a shard
    # group's s = (its dp index) * cp + cp index
    mesh = init_device_mesh(device_type, (pp, replicate, shard, tp), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    return mesh["dp_replicate", "dp_shard"]


def hsdp_mesh(device_type: str, plan: Plan) -> DeviceMesh:
    """HSDP's 2-D (replicate, shard) mesh: the ranks of this rank's "dp" axis, row-major (dp index
    = replica x shards + shard), as FSDP2 takes it for hybrid sharding (made once per process:
    every rank creates its groups together)."""
    p = plan.parallel
    return _hsdp_mesh(device_type, p.pp, p.dp_replicate, p.dp // p.dp_replicate * p.cp, p.tp)


def data_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The ranks that hold the same weights and average their gradients: the "dp" axis, or with
    context parallelism the dp x cp ranks flattened (as torchtitan's dp_shard_cp mesh)."""
    if plan.parallel.cp == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def set_grad_sync(wrapped: nn.Module, sync: bool) -> Any:
    """A context for one micro-batch: DDP all-reduces on the last one only (no_sync before);
    FSDP2 (ZeRO-2/3) reduce-scatters every micro-batch, so that gradients accumulate sharded,
    as torchtitan and DeepSpeed run it and as the cost model counts it
    (planner.cost.stage_costs: mb_comm_param_s)."""
    import contextlib

    if isinstance(wrapped, DDP):
        return contextlib.nullcontext() if sync else wrapped.no_sync()
    return contextlib.nullcontext()


def full_parameters(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: all ranks call it), by its original name.

    `params`: ``dict(model.named_parameters())`` (with DDP over TP, the local shards: ``_st_info``)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        t: Any = p
        info = getattr(p, "_st_info", None)
        if info is not None:  # a TP shard localised for DDP
            from torch.distributed.tensor.parallel._data_parallel_utils import _unflatten_tensor

            t = _unflatten_tensor(p.detach(), info)
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name] = t.detach().to("cpu", copy=True)
    return out
