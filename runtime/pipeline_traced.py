"""Pipeline stages split by ``torch.distributed.pipelining.pipeline()`` (the tracer), for a model
whose forward is not a plain sequence of its layers (runtime/pipeline.py's docstring, "Traced split").

Each stage is a traced GraphModule that keeps the original parameter names and layer submodules,
and the tracer sends whatever crosses a boundary (planner/profile/split.py). A weight tied across
stages (lm_head and the token embedding) is one copy per stage; their gradients are summed over the
pipeline ranks that hold them after each step (``sum_tied_grads``), so the copies stay identical.
"""

from __future__ import annotations

import itertools

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import BadInput
from planner.model_file import ModelHandle, call_model
from planner.plan import Plan
from runtime.types import LayerSplit
from runtime.parallelize import parallelize


def _used_parameter_names(stage: nn.Module) -> set[str]:
    """Qualified names of the parameters a traced stage's graphs read (``get_attr``): a stage
    module can hold others it never uses (a tied weight's other owner). A submodule without a
    graph that a graph calls (run as it is) uses all its parameters."""
    used: set[str] = set()
    for prefix, mod in stage.named_modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            target = f"{prefix}.{node.target}" if prefix else str(node.target)
            if node.op == "get_attr":
                used.add(target)
            elif node.op == "call_module":
                called = stage.get_submodule(target)
                if not isinstance(getattr(called, "graph", None), torch.fx.Graph):
                    used.update(f"{target}.{n}" for n, _ in called.named_parameters())
    return used


def _output_spec(full: nn.Module, sample: Any) -> Any:
    """The pytree structure of the model's output (the last traced stage returns its leaves)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten, tree_map

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            out = call_model(full, tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, sample))
    except Exception:  # noqa: BLE001 - a forward fake tensors refuse: run it for real
        with torch.no_grad():
            out = call_model(full, sample)
    return tree_flatten(out)[1]


def traced_stages(
    handle: ModelHandle, plan: Plan, full: nn.Module, stages: list[tuple[int, tuple[str, ...]]],
    mine: list[tuple[int, tuple[str, ...]]], sample: Any, device: torch.device, mesh: DeviceMesh,
    recompute: dict[str, str], not_sequential: str, layers: tuple[LayerSplit, ...] = (),
) -> tuple[list[nn.Module], list[Any], dict[str, nn.Parameter], dict[str, nn.Parameter],
           list[tuple[str, dist.ProcessGroup]], Callable[[Any, Any], torch.Tensor], list[str]]:
    """This rank's stages split by ``torch.distributed.pipelining.pipeline()`` (the tracer) before
    the first layer of each later stage. `recompute`: recomputed layer name -> policy. Returns (stage modules, PipelineStages, parameters by
    original name, the parameters the stages use, tied-weight groups, the loss function, the names
    of the first stage's inputs in order: keyword inputs are passed to it positionally, since the
    multi-stage schedules hand the keyword arguments to every stage of the first rank).

    A parameter used by several stages (tied weights: GPT-2's lm_head and token embedding) is
    copied into each by the tracer; the copies start identical (built from one seed), their
    gradients are summed over the pipeline ranks holding them after each schedule step
    (`sum_tied_grads`), so they stay identical and equal one process's."""
    from torch.distributed.pipelining._IR import _modify_graph_op_device
    from torch.distributed.pipelining.stage import _PipelineStage
    from torch.utils._pytree import tree_unflatten

    from planner.profile.split import SplitFailed, trace_split, without_inference_cache

    p = plan.parallel
    if p.tp > 1:
        raise BadInput(
            f"{handle.name}: tensor parallelism on pipeline stages split by the tracer is not supported yet "
            f"(the split is traced because {not_sequential}): re-plan with --tp 1"
        )
    canonical: dict[str, str] = {}  # every name of a parameter -> its first name (tied weights)
    first_name: dict[int, str] = {}
    for n, q in full.named_parameters(remove_duplicate=False):
        canonical[n] = first_name.setdefault(id(q), n)
    without_inference_cache(full)  # as trace_split runs it: the outputs' structure without the cache
    spec = _output_spec(full, sample)
    try:
        pipe = trace_split(full, sample, [names[0] for _, names in stages[1:]])
    except SplitFailed as exc:
        raise BadInput(
            f"cannot split {handle.name} into pipeline stages: its forward is not a plain sequence of its "
            f"layers ({not_sequential}) and {exc}"
        ) from exc
    info = pipe.info()
    used = {s: {n for n in _used_parameter_names(pipe.get_stage_module(s))} for s in range(len(stages))}
    stage_params = {
        s: {n: q for n, q in pipe.get_stage_module(s).named_parameters() if n in used[s]} for s in range(len(stages))
    }
    # Tied weights: the same original parameter in several stages. On one rank, the copies are made
    # one parameter again (autograd sums the uses); across ranks, one group per set of holders.
    holders: dict[str, set[int]] = {}
    for s, named in stage_params.items():
        for n in named:
            holders.setdefault(canonical.get(n, n), set()).add(s)
    tied: list[tuple[str, dist.ProcessGroup]] = []
    for name in sorted(n for n, ss in holders.items() if len(ss) > 1):
        pp_ranks = sorted({s % p.pp for s in holders[name]})
        if len(pp_ranks) < 2:
            continue
        group = pipeline_group(mesh, pp_ranks)
        if mesh["pp"].get_local_rank() in pp_ranks:
            tied.append((name, group))
    modules, wrapped_stages, params, owned = [], [], {}, {}
    local: dict[str, nn.Parameter] = {}
    for s, names in mine:
        module = pipe.get_stage_module(s)
        for n, q in list(stage_params[s].items()):
            key = canonical.get(n, n)
            if key in local and local[key] is not q:  # a tied copy on this rank: tie it again
                parent_name, _, leaf = n.rpartition(".")
                parent = module.get_submodule(parent_name) if parent_name else module
                setattr(parent, leaf, local[key])
            else:
                local[key] = q
        todo = [n for n in names if n in recompute]
        for n in todo:
            try:
                module.get_submodule(n)
            except AttributeError as exc:
                raise BadInput(f"{handle.name}: cannot recompute {n}: the traced pipeline stage has no such module") from exc
        if isinstance(module, torch.fx.GraphModule):
            _modify_graph_op_device(module, device)  # devices the trace burned into the graph
        unused = [n for n, _ in module.named_parameters() if n not in used[s]]
        stage_layers_ = tuple(l for l in layers if l.name in names)
        wrapped = parallelize(module, plan, stage_layers_, mesh, device, {n: recompute[n] for n in todo},
                              pipeline=True, ignore=unused)
        if wrapped is not module:  # DDP: the traced PipelineStage reads the stage's graph from it
            wrapped.graph = module.graph
        # After apply_dp: FSDP2 replaces the parameters by sharded ones.
        params.update({canonical.get(n, n): q for n, q in module.named_parameters() if n in used[s]})
        for n, q in module.named_parameters():
            if n in used[s]:
                owned.setdefault(canonical.get(n, n), q)
        modules.append(module)
        wrapped_stages.append(_PipelineStage(wrapped, s, info, device, mesh["pp"].get_group()))

    def loss_fn(output: Any, target: Any) -> torch.Tensor:
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        return handle.loss(tree_unflatten(leaves, spec) if len(leaves) == spec.num_leaves else output, target)

    input_names = [str(n.target) for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    return modules, wrapped_stages, params, owned, tied, loss_fn, input_names


def pipeline_group(mesh: DeviceMesh, pp_ranks: list[int]) -> dist.ProcessGroup:
    """The group of these pipeline ranks at this rank's other coordinates (dp, cp, tp: the mesh's
    dims after "pp"). Every rank creates every such group, in the same order, as new_group requires."""
    ranks = mesh.mesh  # (pp, ...) -> global rank
    names = mesh.mesh_dim_names[1:]
    here = tuple(mesh[n].get_local_rank() for n in names)
    mine = None
    for rest in itertools.product(*(range(n) for n in ranks.shape[1:])):
        group = dist.new_group([int(ranks[(r, *rest)]) for r in pp_ranks])
        if rest == here:
            mine = group
    return mine


def sum_tied_grads(copies: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]]) -> None:
    """Sum the gradients of each tied weight's copies (this rank's, then over the group of pipeline
    ranks holding one; None: all on this rank) and give every copy the sum."""
    from torch.distributed.tensor import DTensor

    for params, group in copies:
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        total = torch.stack(local).sum(0)
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        for q, g in zip(params, grads):
            if q.grad is None:
                q.grad = g
            (q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad).copy_(total)

