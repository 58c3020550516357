"""Build on the meta device and materialise only this rank's part (models too large for the
default path, where every rank builds the whole model on the CPU from one seed).

``use_meta`` decides (forced by ``PLAN_RUNTIME_META=1``, disabled by ``=0``; otherwise when
parameters x 4 bytes x processes on this host exceed half of ``MemAvailable``; every rank takes
the same decision). The worker then cuts the meta model to its pipeline stage and applies TP,
recompute and FSDP2 to it on meta, as torchtitan does, and ``materialize_sharded`` allocates only
this rank's shards (``to_empty``) and fills them from an untouched meta build, one layer at a time:

1. the unit's tensors are made real; every module of it with ``reset_parameters()`` calls it,
   after ``torch.manual_seed`` from a hash of its name;
2. the model's own ``init_weights()``, when the root has one (examples/gpt.py, examples/llama.py:
   it also recomputes the non-persistent buffers), runs seeded from a hash of the unit's name: on
   the other units' tensors, still meta, it does nothing, so a hook that walks every layer works;
3. this rank's shard of each tensor is cut locally (``distribute_tensor(..., src_data_rank=None)``
   to the parameter's own mesh and placements) and copied in; the unit goes back to meta.

Seeds come from names only, so every data-parallel and tensor-parallel rank derives the same full
values without communication, whatever the plan. The values differ from a single-process build.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import BadInput

log = logging.getLogger(__name__)
ENV = "PLAN_RUNTIME_META"
WARNING = (
    "built on the meta device: only this rank's layers (its shards, under FSDP) were materialised; initialisation differs "
    "from a single-process build"
)


@dataclass
class BuildInfo:
    """How this rank built its model (written into rank<r>.json)."""

    path: str = "cpu"  # "cpu": the whole model from the seed; "meta": meta, then to_empty
    materialized_parameters: int = 0  # parameter elements allocated on this rank (meta path: its TP/FSDP shards)
    materialized_names: tuple[str, ...] = ()
    init_sha256: str = ""  # of the full values of the parameters and buffers this rank holds (a shard of), before training
    largest_unit_elements: int = 0  # meta path: the most elements held whole at once (one layer) while initialising
    params_sha256_step1: str = ""  # of every parameter gathered whole after step 1 (meta path)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def use_meta(meta_model: nn.Module, device: torch.device) -> bool:
    """Whether to take the meta path; the same answer on every rank (a MAX all-reduce)."""
    forced = os.environ.get(ENV)
    if forced in ("0", "1"):
        want = forced == "1"
    else:
        n = sum(p.numel() for p in meta_model.parameters())
        procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        avail = _mem_available()
        want = avail is not None and n * 4 * procs > 0.5 * avail
        if want:
            log.info("meta path: %d parameters x 4 B x %d processes > half of MemAvailable (%d B)", n, procs, avail)
    if dist.is_initialized() and forced not in ("0", "1"):
        flag = torch.tensor([int(want)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        want = bool(flag.item())
    return want


def name_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"plan-runtime:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _is_meta(m: nn.Module) -> bool:
    return any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent, _, leaf = fqn.rpartition(".")
    return (root.get_submodule(parent) if parent else root), leaf


def _set_tensor(root: nn.Module, fqn: str, value: torch.Tensor) -> None:
    """Put `value` in place of the parameter or buffer `fqn` of `root` (keeping its kind)."""
    module, leaf = _owner(root, fqn)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = value


def units_of(names: Iterable[str], layers: Iterable[str]) -> dict[str, list[str]]:
    """Parameter/buffer names grouped by the layer that holds them ("" for the rest: the root's)."""
    layers = sorted(layers, key=len, reverse=True)  # the innermost layer first
    out: dict[str, list[str]] = {}
    for fqn in names:
        unit = next((l for l in layers if fqn.startswith(l + ".")), "")
        out.setdefault(unit, []).append(fqn)
    return out


@torch.no_grad()
def materialize_sharded(module: nn.Module, pristine: nn.Module, device: torch.device, layers: Iterable[str]) -> BuildInfo:
    """Give `module` real tensors on `device` after it was parallelised on the meta device.

    `module` was built under ``torch.device("meta")`` and then cut to its pipeline stage, split by
    tensor parallelism and sharded by FSDP2, all on meta: ``to_empty`` allocates only this rank's
    shards. The values come from `pristine`, an untouched meta build of the whole model, one layer
    at a time (`layers`: the profile's layer names; what lies outside every layer is one more
    unit): that unit's tensors are made real, initialised (``reset_parameters()`` of each of its
    modules seeded from the module's name, then the root's ``init_weights()`` seeded from the
    unit's name: on the other, still meta, tensors it does nothing), and this rank's shard of
    each (``distribute_tensor`` to the parameter's own mesh and placements, computed locally) is
    copied in; then the unit goes back to meta. So a rank holds its shards plus one whole layer at
    most, and every rank, whatever the plan, derives the same full values from the names alone."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    module.to_empty(device=device)
    targets: dict[str, torch.Tensor] = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    init = getattr(pristine, "init_weights", None)
    modules = dict(pristine.named_modules())
    param_names = {n for n, _ in pristine.named_parameters()}

    def tensor(fqn: str) -> torch.Tensor:
        return pristine.get_parameter(fqn) if fqn in param_names else pristine.get_buffer(fqn)

    covered: set[str] = set()
    h = hashlib.sha256()
    largest = 0
    for unit, fqns in units_of(targets, layers).items():
        for fqn in fqns:
            _set_tensor(pristine, fqn, torch.empty_like(tensor(fqn), device=device))
        owners = dict.fromkeys(fqn.rpartition(".")[0] for fqn in fqns)
        for name in owners:
            reset = getattr(modules[name], "reset_parameters", None)
            if callable(reset) and not _is_meta(modules[name]):
                torch.manual_seed(name_seed(name))
                reset()
                covered.update(f"{name}.{leaf}" if name else leaf for leaf in modules[name]._parameters)
        if callable(init):
            torch.manual_seed(name_seed("init_weights:" + unit))
            init()
        else:
            missing = [f for f in fqns if f not in covered and f in param_names]
            bufs = [f for f in fqns if f.rpartition(".")[2] in getattr(modules[f.rpartition(".")[0]], "_non_persistent_buffers_set", ())]
            if missing or bufs:
                raise BadInput(
                    f"cannot build this model on the meta device: no init_weights() on the model, and "
                    f"{'parameters ' + ', '.join(missing[:3]) if missing else 'non-persistent buffers'} "
                    f"have no reset_parameters() to initialise them"
                )
        size = 0
        for fqn in fqns:
            full = tensor(fqn)
            size += full.numel()
            h.update(fqn.encode())
            h.update(full.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
            target = targets[fqn]
            if isinstance(target, DTensor):
                local = distribute_tensor(full.detach().to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(full.detach())
            _set_tensor(pristine, fqn, torch.empty_like(full, device="meta"))
        largest = max(largest, size)
    return BuildInfo(
        path="meta",
        materialized_parameters=sum((q.to_local() if isinstance(q, DTensor) else q).numel() for q in module.parameters()),
        materialized_names=tuple(n for n, _ in module.named_parameters()),
        init_sha256=h.hexdigest(),
        largest_unit_elements=largest,
    )


def params_sha256(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()
