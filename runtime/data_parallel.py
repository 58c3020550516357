"""Data parallel over the mesh's "dp" axis, applied after TP and recompute (torchtitan's order).

ZeRO-0 is DDP (after TP, with the DTensor parameters localised by ``_pre_dp_module_transform``);
ZeRO 1/2/3 is FSDP2 ``fully_shard`` on every layer and then the root, ``reshard_after_forward``
True for ZeRO-3 and False for 1/2.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.plan import Plan
from runtime.preflight import LayerSplit

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


def apply_dp(model: nn.Module, plan: Plan, layers: tuple[LayerSplit, ...], dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap the (TP-sharded, checkpointed) model for data parallelism over `dp_mesh`.

    Returns the module to call: the DDP wrapper for ZeRO-0, the model itself (now an FSDPModule)
    otherwise. With dp == 1 nothing is wrapped."""
    zero = plan.parallel.zero
    if dp_mesh.size() == 1:
        return model
    if zero == 0:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

            _pre_dp_module_transform(model)
        ids = [device.index] if device.type == "cuda" else None
        log.info("data parallel: DDP over %d ranks", dp_mesh.size())
        return DDP(model, process_group=dp_mesh.get_group(), device_ids=ids)
    reshard = zero == 3
    for name in _separately_shardable(model, layers):
        fully_shard(model.get_submodule(name), mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    log.info("data parallel: FSDP2 (ZeRO-%d) over %d ranks", zero, dp_mesh.size())
    return model


def set_grad_sync(wrapped: nn.Module, sync: bool) -> Any:
    """A context for one micro-batch: gradient sync only on the last one (DDP no_sync, FSDP2
    set_requires_gradient_sync)."""
    import contextlib

    if isinstance(wrapped, DDP):
        return contextlib.nullcontext() if sync else wrapped.no_sync()
    if isinstance(wrapped, FSDPModule):
        wrapped.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def full_parameters(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: all ranks call it), by its original name.

    `params`: ``dict(model.named_parameters())`` taken right after `apply_dp`, before any forward
    (with DDP over TP, the localising hooks leave the forward's DTensors as plain attributes)."""
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
