"""Expert parallelism (EP): each mixture-of-experts block's experts split over the ep ranks of an
expert-parallel group, every token's rows sent to the ranks holding the experts it chose and the
results sent back, both by all-to-all.

Groups. With ``parallel.ep`` = ep, ep consecutive ranks of a pipeline stage form an EP group (ranks
are ordered tp, cp, dp, pp: the group spans whole tp groups, then whole cp groups, when those
divide ep, part of one when ep divides them; Megatron-Core's MoE parallel folding, torchtitan's EP
borrowing the tp ranks at expert-tensor-parallel degree 1); rank j of a group holds experts
[j E/ep, (j+1) E/ep) of every block (E: that block's number of experts). The dp x cp x tp / ep ranks
at the same position j of their groups hold the same experts: the expert replicas, over which the
experts' gradients are summed (and divided by dp x cp, below). Each cp rank routes the tokens of its
own part of the sequence, as each dp rank routes its own samples: a mixture-of-experts block is
token by token, so the sequence's split (torch's context_parallel, load-balanced) is nothing to it.
``expert_mesh``: the 2-D (ep_replicate, ep) mesh of this rank's stage.

With tensor parallelism (tp > 1) tensor parallelism leaves the mixture-of-experts blocks whole
(runtime.tensor_parallel): every tp rank holds the same replicated router; with sequence
parallelism (required: runtime.preflight) each feeds the block its own sequence shard [batch,
seq/tp, hidden] and routes those tokens through its EP group's all-to-alls, to experts that may
sit on its own tp peers.

Blocks come from ``planner.profile.moe.find_moe`` (the profiler finds the same ones), in two kinds:

- a list (an ``nn.ModuleList`` of identical experts that the user's forward calls one by one on
  its tokens). The routing is the user's code, so the block's forward runs twice: pass 1 records,
  for each expert call, its input rows (``h[tok]``, with their autograd graph back to the block's
  input) and returns zeros; the recorded rows are dispatched, computed by their owners and
  combined back (``exchange``); pass 2 runs the forward again with each expert call answered by
  its computed rows, so the router's gradient comes from pass 2's combine and the rows' gradient
  goes back through the all-to-alls to pass 1's gather. Both passes start from the same RNG state
  (random router noise or dropout draw the same numbers; the state after pass 2 is what one
  forward leaves), and a call whose input differs in shape from its record is an error naming the
  block. During the block's forward the list holds stand-ins for all E experts (``_ExpertCall``);
  outside it, this rank's experts (with their parameters, under their original names) and
  parameter-free ``RemoteExpert`` placeholders for the others.
- stacked (one module whose parameters all have leading size E, called as ``forward(hidden[T,H],
  top_k_index[T,k], top_k_weights[T,k]) -> [T,H]`` with the weighted sum inside: Hugging Face 5.x
  ``MixtralExperts``). Every parameter is sliced to this rank's experts, ``num_experts`` set to
  E/ep, and its forward wrapped: the (token, slot) pairs' rows go to their experts' owners, which
  call the module's original forward (whatever implementation transformers picked) with the local
  expert ids and weights of one; the sender multiplies the returned rows by the routing weights
  (the router's gradient stays local) and adds them into the output.

Gradients. Data parallelism must not average the experts over all dp ranks (each rank holds its
own). An expert's gradient on its owner is the sum of the contributions of every rank of its EP
group (each backpropagating its own local-mean loss), so summing over the expert replicas and
dividing by dp gives the gradient of the global batch's mean loss, as DDP's average does for the
dense weights. ZeRO-0/1 (DDP): the experts are left out of DDP and ``ExpertParallel.sync_grads``
all-reduces them over the replicas once per step, after the last micro-batch; ZeRO-1 gives them
their own ``ZeroRedundancyOptimizer`` over the replicas (``runtime.train.make_optimizer_for``).
ZeRO-2/3 (FSDP2): each module holding experts (a list's local expert, a stacked module) is
``fully_shard``-ed on the replica mesh before the layers (torchtitan's way), with the gradient
divide factor dp x cp (``runtime.data_parallel.apply_dp``). So an expert's weights, gradients and
optimizer state are ZeRO-sharded over its dp x cp x tp / ep replicas as the dense ones are over dp x cp.
With context parallelism each cp rank's loss is the mean over its part of the sequences, which the
dense gradients' average over dp x cp turns into the global batch's mean: the experts' sum over
their replicas is divided by dp x cp alike.

With tp > 1 each tp rank's gradients of a block's replicated parameters (the router's and any
other parameter of the block but the experts, which data parallelism reduces with the dense ones)
cover its own sequence shard only: partial sums, as the sequence-parallel norms' are.
``sync_grads`` sums them over the tp group once a step, after the data-parallel reduction (the sum
and the mean over dp commute); under ZeRO-1/2/3 the tp ranks hold the same shard of each (the
data-parallel mesh shards alike on every tp slice), so the shards are summed as they are. An
expert's gradient needs no such sum: its owner receives the rows of every tp rank of its group,
and the copies on replicas at other tp indices (ep < tp) are summed with the replicas, so the sum
over replicas divided by dp x cp is the global batch's mean.

Recompute: a recomputed layer (full, or selective / alternate: their policies keep matmul outputs,
not the all-to-alls') reruns its forward in backward, so the record, the all-to-alls and the
replay run again there, on every rank of the group in the same order (the backward of one block
cannot start before the next block's is done: the residual stream's gradient waits for it), and
the RNG restored by the checkpoint makes the rerun route the same.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planner.errors import BadInput
from planner.plan import Plan
from planner.profile.moe import MoEBlock, find_moe
from runtime.phases import EP_SCOPE, scope

log = logging.getLogger(__name__)

NO_MOE = "has no mixture-of-experts block (a router and a list of identical experts, or stacked expert weights)"
META_REFUSAL = (
    "expert parallelism does not run on the meta-device build yet (PLAN_RUNTIME_META=1, or a model too large "
    "for every rank to build it whole): set PLAN_RUNTIME_META=0 on a machine that holds the model, or re-plan without --ep"
)


# ---------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _expert_mesh(device_type: str, pp: int, replicas: int, ep: int) -> DeviceMesh:
    # rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index = (pp_index * replicas + r) * ep + j:
    # a stage's dp x cp x tp ranks are consecutive, its EP groups ep of them
    return init_device_mesh(device_type, (pp, replicas, ep), mesh_dim_names=("pp", "ep_replicate", "ep"))


def expert_mesh(device_type: str, plan: Plan) -> DeviceMesh:
    """This rank's (ep_replicate, ep) mesh: its EP group ("ep": ep consecutive ranks of its stage)
    and the expert replicas ("ep_replicate": the ranks at the same position of the stage's other
    groups). Made once per process (every rank creates the groups together)."""
    p = plan.parallel
    return _expert_mesh(device_type, p.pp, p.stage_ranks // p.ep, p.ep)["ep_replicate", "ep"]


# ---------------------------------------------------------------------------------------------
# Dispatch and combine: one place for both kinds
# ---------------------------------------------------------------------------------------------


def exchange(
    rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup,
    compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """Send `rows` ([N, H], sorted by expert) to the ranks of `group` holding their experts, compute
    them there and bring the results back: [N, H'] in the order of `rows` (autograd flows through).

    `counts`: rows per expert ([E], int64; the group's rank j holds experts [j E/ep, (j+1) E/ep)).
    `compute(received, per_expert)`: the owner's work on the rows it received, sorted by its local
    expert (`per_expert`: how many for each), returning one output row per input row.

    The counts are exchanged first (one all-to-all of E integers), so every rank knows what it
    sends and receives; rows then go out with one all-to-all (ordered by sender, then local
    expert), are regrouped by local expert for `compute`, put back in received order and return
    with the reverse all-to-all."""
    ep = dist.get_world_size(group)
    num_experts = counts.numel()
    per = num_experts // ep
    received_counts = torch.empty_like(counts)
    with scope(EP_SCOPE):
        dist.all_to_all_single(received_counts, counts, group=group)
    by_sender = received_counts.view(ep, per)  # [sender, local expert]
    send_splits = counts.view(ep, per).sum(1).tolist()
    recv_splits = by_sender.sum(1).tolist()
    # Functional collectives: autograd runs the reverse all-to-all in backward. Waited for at once
    # (the rows are needed next; a result left unwaited stays in torch's registry of pending work).
    with scope(EP_SCOPE):
        received = wait_tensor(all_to_all_single_autograd(rows, recv_splits, send_splits, group))
    local_ids = torch.repeat_interleave(torch.arange(per, device=rows.device).repeat(ep), by_sender.reshape(-1))
    order = torch.argsort(local_ids, stable=True)  # received order -> by local expert, senders in rank order
    outputs = compute(received[order], by_sender.sum(0).tolist())
    back = outputs[torch.argsort(order)]
    with scope(EP_SCOPE):
        return wait_tensor(all_to_all_single_autograd(back, send_splits, recv_splits, group))


# ---------------------------------------------------------------------------------------------
# List blocks: record / replay
# ---------------------------------------------------------------------------------------------


class RemoteExpert(nn.Module):
    """In a list block's ModuleList outside its forward: an expert another EP rank holds (no
    parameters, so data parallelism and the state dict see only this rank's experts)."""

    def __init__(self, block: str, index: int, owner: int):
        super().__init__()
        self.block, self.index, self.owner = block, index, owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.block}: expert {self.index} is held by expert-parallel rank {self.owner}; it runs only "
            f"inside {self.block or 'the model'}'s forward"
        )

    def extra_repr(self) -> str:
        return f"expert {self.index}, held by expert-parallel rank {self.owner}"


class _ExpertCall(nn.Module):
    """Expert `index` of a list block during the block's expert-parallel forward."""

    def __init__(self, index: int, calls: "_Calls"):
        super().__init__()
        self.index = index
        self._calls = calls

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise BadInput(
                f"{self._calls.block}: expert parallelism calls each expert on one tensor of rows; "
                f"expert {self.index} was called with {len(args)} positional and {len(kwargs)} keyword argument(s)"
            )
        return self._calls.call(self.index, args[0])


class _Calls:
    """A list block's expert calls in one forward: recorded in pass 1, answered in pass 2, keyed by
    (expert, n-th call of that expert)."""

    def __init__(self, block: str, hidden: int):
        self.block, self.hidden = block, hidden
        self.mode: str | None = None
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.seen: defaultdict[int, int] = defaultdict(int)

    def call(self, index: int, x: torch.Tensor) -> torch.Tensor:
        key = (index, self.seen[index])
        self.seen[index] += 1
        if x.shape[-1] != self.hidden:
            raise BadInput(f"{self.block}: expert {index} got rows of {x.shape[-1]} features, not the hidden size {self.hidden}")
        if self.mode == "record":
            self.inputs[key] = x
            return torch.zeros_like(x)
        if self.mode != "replay":
            raise RuntimeError(f"{self.block}: an expert was called outside the block's expert-parallel forward")
        recorded = self.inputs.get(key)
        if recorded is None or recorded.shape != x.shape:
            was = "no call" if recorded is None else f"{tuple(recorded.shape)}"
            raise BadInput(
                f"{self.block}: the routing differs between two runs of the same forward (expert {index}, call "
                f"{key[1] + 1}: {tuple(x.shape)} rows now, {was} the first time); expert parallelism runs the "
                "block's forward twice, so its routing must not depend on anything but its input and the RNG"
            )
        return self.outputs[key]

    def start(self, mode: str) -> None:
        self.mode = mode
        self.seen.clear()

    def recorded(self, like: torch.Tensor, num_experts: int) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
        """(keys in expert order, their rows concatenated [N, H], rows per expert [E])."""
        keys = sorted(self.inputs)
        rows = [self.inputs[k].reshape(-1, self.hidden) for k in keys]
        counts = torch.zeros(num_experts, dtype=torch.int64)
        for (index, _), r in zip(keys, rows):
            counts[index] += r.shape[0]
        flat = torch.cat(rows) if rows else like.new_zeros((0, self.hidden))
        return keys, flat, counts.to(like.device)

    def answer(self, keys: list[tuple[int, int]], outputs: torch.Tensor) -> None:
        start = 0
        for key in keys:
            x = self.inputs[key]
            n = x.numel() // self.hidden
            self.outputs[key] = outputs[start:start + n].reshape(x.shape)
            start += n

    def clear(self) -> None:
        self.mode = None
        self.inputs, self.outputs = {}, {}
        self.seen.clear()


@contextlib.contextmanager
def _holding(experts: nn.ModuleList, modules: list[nn.Module]) -> Iterator[None]:
    """`experts` holds `modules` inside the block (and what it held again after, also on error)."""
    before = dict(experts._modules)
    experts._modules.update((str(i), m) for i, m in enumerate(modules))
    try:
        yield
    finally:
        experts._modules.update(before)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _tensor_versions(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    return [(t, t._version) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


class _ListBlock:
    """The expert-parallel forward of a list block (record, exchange, replay)."""

    def __init__(self, name: str, module: nn.Module, experts: nn.ModuleList, local: list[nn.Module], first: int,
                 hidden: int, group: dist.ProcessGroup):
        self.name, self.experts, self.local, self.first, self.group = name, experts, local, first, group
        self.original = module.forward
        self.calls = _Calls(name or "the model", hidden)
        self.stand_ins: list[nn.Module] = [_ExpertCall(i, self.calls) for i in range(len(experts))]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        like = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        if like is None:
            raise BadInput(f"{self.calls.block}: expert parallelism needs the block's hidden states as a tensor argument")
        rng = _rng_state(like.device)
        versions = _tensor_versions(args, kwargs)
        try:
            self.calls.start("record")
            with _holding(self.experts, self.stand_ins):
                self.original(*args, **kwargs)  # pass 1: the rows each expert gets; its output is dropped
            if any(t._version != v for t, v in versions):
                raise BadInput(
                    f"{self.calls.block}: its forward changes its input in place, and expert parallelism runs it twice: "
                    "make it work on a copy"
                )
            keys, rows, counts = self.calls.recorded(like, len(self.experts))
            self.calls.answer(keys, exchange(rows, counts, self.group, self._compute))
            _set_rng_state(like.device, rng)
            self.calls.start("replay")
            with _holding(self.experts, self.stand_ins):
                out = self.original(*args, **kwargs)  # pass 2: the experts' real outputs, combined by the user's code
            missing = set(self.calls.inputs) - {(i, n) for i, c in self.calls.seen.items() for n in range(c)}
            if missing:
                index, call = min(missing)
                raise BadInput(
                    f"{self.calls.block}: the routing differs between two runs of the same forward (expert {index}, "
                    f"call {call + 1} was made the first time only); expert parallelism runs the block's forward "
                    "twice, so its routing must not depend on anything but its input and the RNG"
                )
            return out
        finally:
            self.calls.clear()

    def _compute(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """This rank's experts on the rows they received (each called, also on no rows, so that every
        local expert has a gradient and FSDP2 reduces the same units on every replica)."""
        outs = []
        for j, (expert, x) in enumerate(zip(self.local, rows.split(per_expert))):
            y = expert(x)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise BadInput(f"{self.calls.block}: expert {self.first + j} maps {tuple(x.shape)} to {got}; expert "
                               "parallelism needs experts that map the hidden size to itself")
            outs.append(y)
        return torch.cat(outs)


# ---------------------------------------------------------------------------------------------
# Stacked blocks
# ---------------------------------------------------------------------------------------------


class _StackedBlock:
    """The expert-parallel forward of a stacked experts module (its parameters sliced to this rank)."""

    def __init__(self, name: str, module: nn.Module, num_experts: int, group: dist.ProcessGroup):
        self.name, self.module, self.num_experts, self.group = name, module, num_experts, group
        self.original = module.forward  # the implementation transformers picked (eager, grouped_mm, ...)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # the (token, slot) pairs by expert
        token = order // k
        counts = torch.bincount(chosen, minlength=self.num_experts)
        weight_dtype = top_k_weights.dtype

        def compute(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
            ids = torch.repeat_interleave(torch.arange(len(per_expert), device=rows.device),
                                          torch.tensor(per_expert, device=rows.device))
            out = self.original(rows, ids[:, None], torch.ones(rows.shape[0], 1, dtype=weight_dtype, device=rows.device))
            if rows.shape[0] == 0:  # no rows: still a (zero) gradient for every expert weight, as on the replicas
                out = out + sum(p.sum() for p in self.module.parameters()) * 0
            return out

        rows = exchange(hidden_states[token], counts, self.group, compute)
        weighted = rows * top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, token, weighted.to(out.dtype))


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------


def _hidden_size(model: nn.Module, block: MoEBlock) -> int:
    return int(model.get_submodule(block.router).weight.shape[1])


def _maps_hidden_to_itself(expert: nn.Module, hidden: int) -> tuple[int, ...] | None:
    """The output shape of `expert` on [2, hidden] rows when it is not [2, hidden] (run on meta
    tensors: nothing computed), else None; None too when the expert does not run on meta."""
    state = {n: torch.empty_like(t, device="meta") for n, t in (*expert.named_parameters(), *expert.named_buffers())}
    try:
        y = torch.func.functional_call(expert, state, (torch.empty(2, hidden, device="meta"),))
    except Exception:  # noqa: BLE001 - checked again on the real rows (_ListBlock._compute)
        return None
    return None if isinstance(y, torch.Tensor) and tuple(y.shape) == (2, hidden) else tuple(getattr(y, "shape", ()))


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The experts EP rank `ep_rank` of `ep` holds: a contiguous 1/ep of them."""
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def split_list_block(model: nn.Module, block: MoEBlock, ep: int, ep_rank: int) -> list[nn.Module]:
    """Keep this rank's experts in the block's ModuleList and put RemoteExpert placeholders in the
    others' places; this rank's experts, in order."""
    experts = model.get_submodule(block.experts)
    mine = local_experts(block.num_experts, ep, ep_rank)
    hidden = _hidden_size(model, block)
    bad = _maps_hidden_to_itself(experts[mine[0]], hidden)
    if bad is not None:
        raise BadInput(f"{block.experts}: each expert maps [n, {hidden}] rows to {list(bad)}; expert parallelism "
                       "needs experts that map the hidden size to itself")
    per = len(mine)
    for i in range(block.num_experts):
        if i not in mine:
            experts[i] = RemoteExpert(block.name, i, i // per)
    return [experts[i] for i in mine]


def split_stacked_block(model: nn.Module, block: MoEBlock, ep: int, ep_rank: int) -> nn.Module:
    """Slice every parameter of the stacked experts module to this rank's experts (leading dim) and
    set its ``num_experts``; the module."""
    module = model.get_submodule(block.experts)
    mine = local_experts(block.num_experts, ep, ep_rank)
    for name, p in list(module.named_parameters()):
        module._parameters[name] = nn.Parameter(p.detach()[mine.start:mine.stop].clone(), requires_grad=p.requires_grad)
    if hasattr(module, "num_experts"):
        module.num_experts = len(mine)
    return module


def split_block(model: nn.Module, block: MoEBlock, ep: int, ep_rank: int,
                group: dist.ProcessGroup) -> tuple[list[nn.Module], list[str]]:
    """Give `block` of `model` expert-parallel forward on `group` (rank `ep_rank` of `ep`); the
    modules holding this rank's experts and the names of their parameters in `model`."""
    owner = model.get_submodule(block.name)
    if block.stacked:
        experts = split_stacked_block(model, block, ep, ep_rank)
        experts.forward = _StackedBlock(block.name, experts, block.num_experts, group).forward  # type: ignore[method-assign]
        return [experts], [f"{block.experts}.{n}" for n, _ in experts.named_parameters()]
    local = split_list_block(model, block, ep, ep_rank)
    first = local_experts(block.num_experts, ep, ep_rank).start
    ep_block = _ListBlock(block.name, owner, model.get_submodule(block.experts), local, first,
                          _hidden_size(model, block), group)
    owner.forward = ep_block.forward  # type: ignore[method-assign]
    names = [f"{block.experts}.{first + j}.{n}" for j, expert in enumerate(local) for n, _ in expert.named_parameters()]
    return local, names


@dataclass(eq=False)
class ExpertParallel:
    """What expert parallelism did to one module (the model, or one pipeline stage)."""

    module: nn.Module
    mesh: DeviceMesh
    """(ep_replicate, ep): see ``expert_mesh``."""
    grad_ranks: int
    """dp x cp: the ranks whose losses the gradients average (an expert's sum over its replicas is
    divided by it)."""
    blocks: tuple[MoEBlock, ...]
    units: tuple[nn.Module, ...]
    """The modules holding this rank's experts: a list block's local experts, a stacked module (ZeRO-2/3
    shards each on the replica mesh)."""
    names: tuple[str, ...]
    """This rank's expert parameters, by their names in `module`."""
    stacked: dict[str, int] = field(default_factory=dict)
    """Stacked parameters (sliced on dim 0) -> the whole model's leading size."""
    fsdp: bool = False
    """Set by ``apply_dp`` when FSDP2 reduces the experts' gradients (ZeRO-2/3)."""
    replicated: tuple[str, ...] = ()
    """The blocks' other parameters (the router's), by their names in `module`: replicated on
    every rank, reduced over dp x cp with the dense ones."""
    tp_group: dist.ProcessGroup | None = None
    """With tensor parallelism: this rank's tp group, over which the gradients of the blocks'
    replicated parameters are partial sums (module docstring); None with tp 1."""

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh["ep"].get_group()

    @property
    def replica_mesh(self) -> DeviceMesh:
        return self.mesh["ep_replicate"]

    @property
    def replicas(self) -> int:
        return self.mesh["ep_replicate"].size()

    def parameters(self) -> list[nn.Parameter]:
        """This rank's expert parameters as they are now (FSDP2 replaces them by sharded ones)."""
        return [self.module.get_parameter(n) for n in self.names]

    def sync_grads(self) -> None:
        """Once per step, after the last micro-batch: under ZeRO-0/1 the experts' gradients summed
        over the replicas and divided by dp x cp (FSDP2 does that under ZeRO-2/3); with tensor
        parallelism then the blocks' replicated gradients (the router's) summed over tp (module
        docstring)."""
        if not self.fsdp and self.names:
            params = self.parameters()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            if self.replicas > 1:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.replica_mesh.get_group())
            flat /= self.grad_ranks
            for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        if self.tp_group is not None:
            self._sum_over_tp()

    def _sum_over_tp(self) -> None:
        """The blocks' replicated gradients (the router's) summed over the tp group, in one
        all-reduce; sharded ones (FSDP2's DTensors) as their local shards."""
        from torch.distributed.tensor import DTensor

        local: list[torch.Tensor] = []
        for name in self.replicated:
            p = self.module.get_parameter(name)
            if p.grad is None:  # a parameter no token reached on this rank: a zero partial sum
                p.grad = torch.zeros_like(p)
            local.append(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad)
        if not local:
            return
        flat = torch._utils._flatten_dense_tensors(local)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.tp_group)
        for t, g in zip(local, torch._utils._unflatten_dense_tensors(flat, local)):
            t.copy_(g)

    def gather(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`full` (name -> parameter gathered whole over data parallelism) with every expert of the
        model: the other EP ranks' list experts added, stacked parameters concatenated in rank order.
        A collective over the EP group."""
        if not self.blocks:
            return full
        mine = {n: full[n] for n in self.names}
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        out = dict(full)
        for n in self.stacked:
            out[n] = torch.cat([d[n] for d in everyone])
        for d in everyone:
            out.update({n: t for n, t in d.items() if n not in self.stacked})
        return out


_LIVE: "weakref.WeakSet[ExpertParallel]" = weakref.WeakSet()
"""Every ExpertParallel of this process still alive (``stacked_shards`` finds parameters in them)."""


@dataclass(frozen=True)
class StackedShard:
    """Where this rank's part of a stacked expert parameter (or of its optimizer state of the same
    shape) sits in the whole model's ``[E, ...]`` tensor, as DTensor placements: ``Shard(0)`` over
    the EP group; under FSDP2 (ZeRO-2/3), whose ``Shard(0)`` over the replicas splits this rank's
    ``[E/ep, ...]`` slice again, ``(_StridedShard(0, split_factor=ep), Shard(0))`` over the
    (ep_replicate, ep) mesh: the replica's rows inside the EP rank's slice."""

    mesh: DeviceMesh
    placements: tuple[Any, ...]
    shape: torch.Size
    """The whole model's [E, ...]."""
    held_shape: torch.Size
    """The parameter's shape as its state dict shows it: the local [E/ep, ...], or the global shape
    of FSDP2's DTensor (also [E/ep, ...])."""


def stacked_shards(module: nn.Module) -> dict[str, StackedShard]:
    """The stacked expert parameters among `module`'s (the model, or a pipeline rank's view of its
    stages' parameters), by their names in `module`: how each is one shard of the whole model's. The
    parameters are found by identity in the live ExpertParallels (FSDP2 replaces them: the current
    ones count)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    found: dict[int, tuple[ExpertParallel, int]] = {}
    for ep in list(_LIVE):
        for name, num_experts in ep.stacked.items():
            found[id(ep.module.get_parameter(name))] = (ep, num_experts)
    out: dict[str, StackedShard] = {}
    for name, p in module.named_parameters():
        hit = found.get(id(p))
        if hit is None:
            continue
        ep, num_experts = hit
        ep_size, ep_rank = ep.mesh["ep"].size(), ep.mesh["ep"].get_local_rank()
        per = num_experts // ep_size
        whole = torch.Size((num_experts, *p.shape[1:]))
        if isinstance(p, DTensor):  # FSDP2: Shard(0) of this rank's [E/ep, ...] over the replicas
            assert tuple(p.placements) == (Shard(0),) and tuple(p.shape) == (per, *p.shape[1:]), (
                f"{name}: FSDP2 holds it as {p.placements} of {tuple(p.shape)}, not Shard(0) of {per} experts")
            local_shape, inner = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            mesh, placements = ep.mesh, (_StridedShard(0, split_factor=ep_size), Shard(0))
        else:
            local_shape, inner = tuple(p.shape), (0,) * p.dim()
            mesh, placements = ep.mesh["ep"], (Shard(0),)
        got_shape, got_offset = compute_local_shape_and_global_offset(whole, mesh, placements)
        want_offset = (ep_rank * per + inner[0], *inner[1:])
        assert tuple(got_shape) == tuple(local_shape) and tuple(got_offset) == want_offset, (
            f"{name}: rows {tuple(local_shape)} at {want_offset} of {tuple(whole)}, but {placements} place "
            f"{tuple(got_shape)} at {tuple(got_offset)}")
        out[name] = StackedShard(mesh, placements, whole, torch.Size(p.shape))
    return out


def expert_parallel_of(module: nn.Module) -> ExpertParallel | None:
    """The ExpertParallel ``apply_expert_parallel`` attached to `module`, if any."""
    return module.__dict__.get("_expert_parallel")


def _patterns(names: list[str]) -> str:
    return ", ".join(dict.fromkeys(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", n) or "(root)" for n in names))


def apply_expert_parallel(module: nn.Module, plan: Plan, device_type: str,
                          tp_group: dist.ProcessGroup | None = None) -> ExpertParallel | None:
    """Split the experts of every MoE block of `module` over this rank's EP group (plan.parallel.ep
    > 1); the ExpertParallel (also attached to `module`: ``expert_parallel_of``), None without EP.
    Every rank calls it (the groups are made here), also on a pipeline stage without MoE blocks.
    `tp_group`: this rank's tensor-parallel group with tp > 1 (over which the router's gradients are
    summed: ExpertParallel.tp_group)."""
    p = plan.parallel
    if p.ep == 1:
        return None
    mesh = expert_mesh(device_type, plan)
    ep_rank = mesh["ep"].get_local_rank()
    group = mesh["ep"].get_group()
    blocks = tuple(find_moe(module))
    units: list[nn.Module] = []
    names: list[str] = []
    stacked: dict[str, int] = {}
    replicated: list[str] = []
    for block in blocks:
        if block.num_experts % p.ep:
            raise BadInput(f"{block.name}: {block.num_experts} experts do not split over parallel.ep {p.ep} ranks")
        held, held_names = split_block(module, block, p.ep, ep_rank, group)
        units.extend(held)
        names.extend(held_names)
        if block.stacked:
            stacked.update((n, block.num_experts) for n in held_names)
        prefix = f"{block.name}." if block.name else ""
        replicated += [prefix + n for n, _ in module.get_submodule(block.name).named_parameters()
                       if prefix + n not in held_names]
    ep = ExpertParallel(module, mesh, p.dp * p.cp, blocks, tuple(units), tuple(names), stacked,
                        replicated=tuple(replicated), tp_group=tp_group)
    module.__dict__["_expert_parallel"] = ep
    _LIVE.add(ep)
    if dist.get_rank() == 0:
        sizes = sorted({b.num_experts for b in blocks})
        experts = " or ".join(str(e) for e in sizes) or "0"
        each = " or ".join(str(e // p.ep) for e in sizes) or "0"
        log.info("expert parallel: %d block%s, %s experts over %d ranks (%s each), dispatch by all-to-all; %s; "
                 "expert gradients summed over %d replica(s), divided by dp x cp %d%s",
                 len(blocks), "" if len(blocks) == 1 else "s", experts, p.ep, each, _patterns([b.experts for b in blocks]) or "none here",
                 mesh["ep_replicate"].size(), p.dp * p.cp,
                 f"; not split by tp {p.tp}: each tp rank routes its sequence shard, the router's gradients summed over tp"
                 if p.tp > 1 else "")
    return ep
