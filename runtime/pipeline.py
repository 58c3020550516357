"""Pipeline-parallel execution (pp > 1) with ``torch.distributed.pipelining``.

The model is split at the plan's stage boundaries: pipeline rank r holds ``stages[r].chunks``
(one chunk, or ``virtual_stages`` chunks when interleaved); chunk v of rank r is pipeline stage
``v * pp + r``, and the stages in index order hold the layers in the model's order.

Each stage is its own module: the full model, built on every rank from the same seed (identical
weights to a single-process run), with the layers of every other stage replaced by parameterless
stubs. So parameter and layer names stay the original ones, and TP, recompute and DP apply to the
stage exactly as to a whole model.

- Stage 0 runs the model's own forward (embeddings and whatever glue precedes the first split) and
  stops where the first layer of the next stage is called, returning that layer's input.
- Every later stage runs its layers in order, each on the previous one's output. This needs the
  model's forward to be a plain sequence of its layers from the first split point on (each layer's
  input is the previous layer's output and the model's output is
  the last layer's: the profiler's finding, each layer's ``plain_cut`` in the plan); a model that
  is not is split by the tracer instead (below). The planner puts
  the first cut of a plan with tensor parallelism where the layers run in sequence
  (ModelProfile.plain_from), and plan run refuses before launch a plan that would need the tracer
  with TP (``traced_reason``).
- A weight tied across stages (a token embedding in stage 0, the LM head in the last) is one copy
  per stage module; after each step the copies' gradients are summed over the pipeline ranks that
  hold them (``tied_copies``, ``sum_tied_grads``), so the copies stay equal, as one process's.

Traced split: a model whose forward is not such a sequence (Hugging Face blocks take a mask and
position arguments; glue between layers) is split with ``torch.distributed.pipelining.pipeline()``
before the first layer of every later stage (planner/profile/split.py): each stage is a traced
GraphModule that keeps the original parameter names and layer submodules, and the tracer sends
whatever crosses a boundary. Built on every rank from the same seed; a weight tied across stages
(lm_head and the token embedding) is one copy per stage, their gradients summed over the pipeline
ranks that hold them after each step. Recompute and DP apply to the traced stage; TP and the
meta-device build are refused with one line. When the tracer fails, one line names the module.

Schedules: GPipe, 1F1B, interleaved 1F1B, each with ``num_microbatches`` micro-batches of this dp
rank's rows; the loss is the model file's loss on each micro-batch and the schedule scales the
gradients by 1/num_microbatches (``scale_grads``). Data parallelism within a stage is applied by
``runtime.parallelize.parallelize`` as without pipelining: ZeRO-0/1 is DDP (ZeRO-1 adds
``ZeroRedundancyOptimizer``), which PipelineStage runs under ``no_sync`` except for the last
backward, where its buckets are all-reduced as the gradients become ready (built with
``find_unused_parameters=True``, which keeps DDP from rebuilding its buckets: the rebuild fails
under a schedule's no_sync micro-batches); ZeRO 2/3 is FSDP2, whose gradient sync PipelineStage
turns on for the last micro-batch only.
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

from planner.cost.pipeline import interleaved_rounds
from planner.errors import BadInput
from planner.model_file import ModelHandle
from planner.plan import Plan
from planner.profile.trace import called_alone, forward_signature
from runtime.context_parallel import ContextParallel
from runtime.data_parallel import data_mesh, full_parameters
from runtime.expert_parallel import META_REFUSAL as META_EP_REFUSAL, expert_parallel_of
from runtime.meta_init import BuildInfo, materialize_sharded, use_meta
from runtime.phases import BACKWARD_SCOPE, FORWARD_SCOPE, scope
from runtime.pipeline_traced import pipeline_group, sum_tied_grads, traced_stages
from runtime.types import LayerSplit
from runtime.parallelize import parallelize
from runtime.recompute import recompute_of
from runtime.train import (
    MODEL_SEED, RankResult, global_batch, make_optimizer_for, run_steps, slice_rows, to_device, with_step1_hash,
)

log = logging.getLogger(__name__)
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class _StopForward(Exception):
    def __init__(self, value: Any):
        super().__init__("stage boundary")
        self.value = value


class _Boundary(nn.Module):
    """Stands in for a layer of another stage: stops the forward and hands back its input."""

    def __init__(self, name: str, layer: nn.Module):
        super().__init__()
        self.layer_name = name
        self.signature = forward_signature(layer)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the layer it stands in for, called with its tensor and its forward's defaults (the
        # profiler's test for a plain hand-over), takes the tensor alone in the next stage
        raise _StopForward(args[0] if called_alone(self.signature, args, kwargs) else (args, kwargs))


def stage_layers(plan: Plan) -> list[tuple[int, tuple[str, ...]]]:
    """(pipeline rank, layer names) per pipeline stage, in stage-index order (v * pp + r)."""
    p = plan.parallel
    if len(plan.stages) != p.pp:
        raise BadInput(f"this plan has pp={p.pp} but {len(plan.stages)} stage(s): re-plan")
    v = p.virtual_stages if p.schedule == "interleaved" else 1
    out = []
    for chunk in range(v):
        for r, stage in enumerate(plan.stages):
            if len(stage.chunks) != v:
                raise BadInput(f"stage {r} has {len(stage.chunks)} chunk(s), the schedule needs {v}: re-plan")
            out.append((r, tuple(stage.chunks[chunk])))
    return out


def check_pipeline(plan: Plan, layers: tuple[LayerSplit, ...]) -> None:
    """What can be refused before launch: the schedule and the stages' layers (contiguous, in order)."""
    p = plan.parallel
    if p.schedule not in SCHEDULES:
        raise BadInput(f"pipeline schedule {p.schedule!r} is not supported (gpipe, 1f1b, interleaved)")
    if p.schedule == "1f1b" and p.num_microbatches < p.pp:
        # torch's Schedule1F1B refuses fewer micro-batches than stages; GPipe runs them the same way
        raise BadInput(f"1F1B needs at least pp = {p.pp} micro-batches, the plan has {p.num_microbatches}: "
                       "re-plan (or with --schedule gpipe, which runs so few the same way)")
    rounds = interleaved_rounds(p.num_microbatches, p.pp)
    if p.schedule == "interleaved" and p.num_microbatches % rounds:
        raise BadInput(f"interleaved 1F1B runs the micro-batches in {rounds} equal rounds of at least pp = {p.pp}; "
                       f"the plan has {p.num_microbatches}: re-plan")
    stages = stage_layers(plan)
    order = [name for _, names in stages for name in names]
    if order != [l.name for l in layers]:
        raise BadInput("the plan's pipeline stages do not hold the model's layers in order: re-plan")
    if any(not names for _, names in stages):
        raise BadInput("a pipeline stage of this plan holds no layer: re-plan")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[leaf] = new


def traced_reason(plan: Plan) -> str | None:
    """Why this plan's stages need the pipelining tracer, or None when the forward from the plan's
    first cut on is a plain sequence of its layers (the profiler's finding, which the plan carries:
    each layer's ``plain_cut``). BadInput when they need it and the tracer failed on this model.
    run_pipeline decides with it, and plan run's preflight refuses before launch what the traced
    path cannot run (tensor parallelism)."""
    first = stage_layers(plan)[0][1][-1]
    layer = next(l for l in plan.model.layers if l.name == first)
    if layer.plain_cut:
        return None
    why = f"the forward after {first} is not a plain sequence of layers (glue between them, or a layer taking more than the previous one's output)"
    if plan.model.pipeline_split != "traced":
        raise BadInput(
            f"the plan's first pipeline cut, after {first}, needs the pipelining tracer ({why}), which cannot split "
            f"this model ({plan.model.pipeline_split_note or 'not tried'}): re-plan"
        )
    return why


def build_stage_module(
    full: nn.Module, all_names: list[str], names: tuple[str, ...], first: bool, input_names: list[str] | None = None,
) -> nn.Module:
    """A copy of `full` keeping only `names`; its forward runs that stage and returns what it hands
    over contiguous (torch's stages allocate their receives with the strides of the first forward's
    outputs, and send and receive refuse a strided tensor: a layer's output can be a transposed
    view, or an addition that follows one). `input_names`: the first stage takes the model's
    keyword inputs positionally, in this order (the multi-stage schedules hand keyword arguments to
    every stage of the first rank)."""
    model = copy.deepcopy(full)
    keep = set(names)
    for name in all_names:
        if name not in keep:
            _replace(model, name, _Boundary(name, model.get_submodule(name)))
    if first:
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if input_names is not None:
                args, kwargs = (), {**dict(zip(input_names, args)), **kwargs}
            try:
                return _contiguous(original(*args, **kwargs))
            except _StopForward as stop:
                return _contiguous(stop.value)
    else:
        layers = [model.get_submodule(n) for n in names]

        def forward(x: torch.Tensor) -> Any:  # type: ignore[misc]
            for layer in layers:
                x = layer(x)
            return _contiguous(x)

    model.forward = forward  # type: ignore[method-assign]
    return model


def _contiguous(tree: Any) -> Any:
    return tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, tree)


def tied_copies(
    full: nn.Module, stages: list[tuple[int, tuple[str, ...]]], all_names: list[str], modules: list[nn.Module],
    my_stages: list[int], mesh: DeviceMesh,
) -> list[tuple[list[nn.Parameter], dist.ProcessGroup | None]]:
    """A weight tied across stages (a token embedding and the LM head) is one copy per stage
    module: for each, this rank's copies and a group of the pipeline ranks holding one (None: all
    on this rank), so that their gradients are summed after each step and the copies stay equal.
    Every rank creates every group, in the same order. A stage holds a parameter under a layer of
    its own, or, for stage 0, one outside every layer."""
    aliases: dict[int, list[str]] = {}
    for n, q in full.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(q), []).append(n)

    def held(s: int, n: str) -> bool:
        layer = next((l for l in all_names if n.startswith(l + ".")), None)
        return layer in stages[s][1] if layer is not None else s == 0

    out: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]] = []
    for names in sorted(ns for ns in aliases.values() if len(ns) > 1):
        holders = {s: next(n for n in names if held(s, n)) for s in range(len(stages)) if any(held(s, n) for n in names)}
        if len(holders) < 2:
            continue  # one module holds every use: autograd already sums them
        pp_ranks = sorted({stages[s][0] for s in holders})
        group = pipeline_group(mesh, pp_ranks) if len(pp_ranks) > 1 else None
        local = [modules[my_stages.index(s)].get_parameter(n) for s, n in holders.items() if s in my_stages]
        if local:
            out.append((local, group))
    return out


def _add_build(build: BuildInfo, made: BuildInfo) -> None:
    """Add one stage's meta-path materialisation to this rank's BuildInfo."""
    build.materialized_parameters += made.materialized_parameters
    build.materialized_names += made.materialized_names
    build.init_sha256 = made.init_sha256 if not build.init_sha256 else build.init_sha256 + "," + made.init_sha256
    build.largest_unit_elements = max(build.largest_unit_elements, made.largest_unit_elements)


@dataclass
class PipelineRun:
    result: RankResult
    params: dict[str, torch.Tensor] | None
    build: BuildInfo


def _scoped(stage: Any) -> Any:
    """`stage` (a PipelineStage) with its forward and backward of a micro-batch in the profiler's
    phase scopes (runtime.phases): the schedule's own scopes around them then hold only its waits
    for the neighbouring stages."""
    for method, name in (("forward_one_chunk", FORWARD_SCOPE), ("backward_one_chunk", BACKWARD_SCOPE)):
        inner = getattr(stage, method)

        def run(*args: Any, _inner: Callable[..., Any] = inner, _name: str = name, **kwargs: Any) -> Any:
            with scope(_name):
                return _inner(*args, **kwargs)

        setattr(stage, method, run)
    return stage


def run_pipeline(
    handle: ModelHandle,
    plan: Plan,
    layers: tuple[LayerSplit, ...],
    mesh: DeviceMesh,
    pp_index: int,
    dp_index: int,
    steps: int,
    device: torch.device,
    rank: int,
    autocast_dtype: torch.dtype | None,
    save_params: bool,
    checkpoint: Callable[[nn.Module, torch.optim.Optimizer], tuple[int, Callable[[int], None] | None]] | None = None,
) -> PipelineRun:
    """`checkpoint(view, optimizer)` -> (first step, after-step hook): `view` holds the parameters
    this rank's stages use, under their original names (runtime.checkpoint.StateView)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    p = plan.parallel
    stages = stage_layers(plan)
    all_names = [l.name for l in layers]
    by_name = {l.name: l for l in layers}
    sample = slice_rows(global_batch(handle, plan, 0)[0], 0, p.micro_batch)
    not_sequential = traced_reason(plan)

    meta_full = handle.build_model("meta")
    on_meta = use_meta(meta_full, device)
    if on_meta and p.ep > 1:
        raise BadInput(META_EP_REFUSAL)
    if on_meta:  # too large to build whole on every rank (or PLAN_RUNTIME_META=1): stubs, TP and FSDP
        full = meta_full.to(dtype=torch.float32)  # on meta, then only this rank's shards (meta_init)
    else:
        del meta_full
        torch.manual_seed(MODEL_SEED)  # identical initial weights on every rank and in one process
        full = handle.build_model().to(device=device, dtype=torch.float32)
    build = BuildInfo(path="meta" if on_meta else "cpu")
    pp_group = mesh["pp"].get_group()
    mine = [(s, names) for s, (r, names) in enumerate(stages) if r == pp_index]
    recompute = recompute_of(plan.stages[pp_index])
    modules, wrapped_stages, params, owned = [], [], {}, {}
    loss_fn: Callable[[Any, Any], torch.Tensor] = handle.loss
    copies: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]] = []
    input_names: list[str] | None = None
    if not_sequential is not None:
        if on_meta:
            raise BadInput(
                f"{handle.name}: the meta-device build (PLAN_RUNTIME_META=1, or a model too large for every "
                f"rank to build whole) is not supported with a pipeline split by the tracer (needed because "
                f"{not_sequential}); set PLAN_RUNTIME_META=0 or re-plan without --pp"
            )
        traced = traced_stages(
            handle, plan, full, stages, mine, to_device(sample, device), device, mesh, recompute, not_sequential, layers,
        )
        modules, wrapped_stages, params, owned, tied, loss_fn, input_names = traced
        copies = [([owned[name]], group) for name, group in tied]
        if rank == 0:
            log.info("pipeline: split by the pipelining tracer (the forward is not a plain sequence: %s)", not_sequential)
        build.materialized_parameters = sum(q.numel() for q in owned.values())
    if not_sequential is None and isinstance(sample, dict):
        input_names = list(sample)  # keyword inputs go to stage 0 positionally, as on the traced path
    for s, names in (mine if not_sequential is None else []):
        module = build_stage_module(full, all_names, names, first=(s == 0), input_names=input_names)
        mine_layers = tuple(by_name[n] for n in names)
        # ZeRO-0/1: DDP (PipelineStage runs its micro-batches under no_sync and reduces on the last
        # backward), parameters outside this stage's layers (unused) left out; ZeRO 2/3: FSDP2.
        unused = [n for n, _ in module.named_parameters() if s != 0 and not any(n.startswith(l + ".") for l in names)]
        wrapped = parallelize(
            module, plan, mine_layers, mesh, device, {n: recompute[n] for n in names if n in recompute},
            pipeline=True, ignore=unused,
            materialize=(lambda module=module: _add_build(build, materialize_sharded(module, full, device, all_names)))
            if on_meta else None,
        )
        if not on_meta:
            build.materialized_parameters += sum(q.numel() for q in module.parameters())
        params.update(dict(module.named_parameters()))
        # The parameters this stage uses: all of stage 0's (the stubs have none), only its layers'
        # elsewhere (a later stage's forward runs just its layers).
        owned.update({
            n: q for n, q in module.named_parameters()
            if s == 0 or any(n.startswith(layer + ".") for layer in names)
        })
        modules.append(module)
        wrapped_stages.append(_scoped(PipelineStage(wrapped, s, len(stages), device, group=pp_group)))
    if not_sequential is None:
        copies = tied_copies(full, stages, all_names, modules, [s for s, _ in mine], mesh)
    del full
    if p.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(wrapped_stages, n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if p.schedule == "gpipe" else Schedule1F1B
        schedule = cls(wrapped_stages[0], n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    has_first = any(s == 0 for s, _ in mine)
    has_last = any(s == len(stages) - 1 for s, _ in mine)

    cp = ContextParallel.setup(modules, plan, mesh) if p.cp > 1 else None
    data = data_mesh(mesh, plan)  # the dp (x cp) ranks that average gradients and the loss
    dp_group = data.get_group() if data.size() > 1 else None
    # Only the parameters the stages use (the others never get a gradient): what a checkpoint holds.
    # With expert parallelism, each stage module's experts (runtime.expert_parallel).
    experts = [e for e in map(expert_parallel_of, modules) if e is not None]
    expert_params = [q for e in experts for q in e.parameters()]
    optimizer = make_optimizer_for(plan, list(owned.values()), dp_group, expert_params,
                                   experts[0].replica_mesh.get_group() if experts else None)
    start_step, after_step = 0, None
    if checkpoint is not None:
        from runtime.checkpoint import StateView

        start_step, after_step = checkpoint(StateView(owned), optimizer)
    local = p.micro_batch * p.num_microbatches

    def load(step: int) -> tuple[Any, Any]:
        inputs, targets = global_batch(handle, plan, step)
        return (to_device(slice_rows(inputs, dp_index * local, (dp_index + 1) * local), device),
                to_device(slice_rows(targets, dp_index * local, (dp_index + 1) * local), device))

    def forward_backward(data: tuple[Any, Any]) -> torch.Tensor:
        with cp.sharded(*data) if cp else nullcontext(data) as (inputs, targets):  # every stage's attention: a ring
            return _step(inputs, targets)

    def _step(inputs: Any, targets: Any) -> torch.Tensor:
        micro: list[torch.Tensor] = []
        args: tuple = ()
        kwargs: dict[str, Any] = {}
        if has_first:
            if isinstance(inputs, dict) and input_names is not None:
                args = tuple(inputs[n] for n in input_names)  # stage 0 takes them positionally
            elif isinstance(inputs, dict):
                kwargs = dict(inputs)
            elif isinstance(inputs, (tuple, list)):
                args = tuple(inputs)
            else:
                args = (inputs,)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            schedule.step(*args, target=targets if has_last else None, losses=micro if has_last else None, **kwargs)
        sum_tied_grads(copies)
        for e in experts:
            e.sync_grads()
        if has_last:  # the last stage's mean micro-batch loss; the other stages add nothing
            return torch.stack([m.detach().float() for m in micro]).mean()
        return torch.zeros((), device=device)

    # the loss: from the last stage to every pipeline rank, then averaged over dp
    groups = ((pp_group, 1), *(((dp_group, data.size()),) if dp_group is not None else ()))
    result = run_steps(steps, start_step, device, rank, optimizer, load, forward_backward, groups,
                       with_step1_hash(after_step, build, owned, start_step), p)
    gathered = None
    if save_params:
        mine_full = full_parameters(params)
        for e in experts:  # the other EP ranks' experts (list names, stacked slices)
            mine_full = e.gather(mine_full)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine_full)
        gathered = {}
        for d in everyone:
            for k, v in d.items():
                gathered.setdefault(k, v)
    return PipelineRun(result, gathered, build)
