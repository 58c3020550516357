"""Per-candidate cost tables: what each schedulable unit ("atom") costs on one device.

An atom is a run of layers between two valid pipeline cuts (usually one layer). For a candidate
(tp, pp, dp, micro-batch, ZeRO, schedule) every atom gets, per micro-batch on one device: forward
and backward seconds with its tensor-parallel communication, the extra seconds and the kept
activation bytes of each recompute choice, and the parameters it puts on the device. The ILP and
the evaluator both read these tables, so the plan they choose and the figures they report agree.

Recompute choices (per atom):
- none: keep everything the forward saved;
- selective: keep what matmul-like ops produced and the atom's input, recompute the rest (the
  memory-bound ops: norms, activations, softmax, dropout) in backward: PyTorch's selective
  activation checkpointing with a "save matmuls" policy;
- alternate: as selective, but every second Linear matmul of a layer is recomputed too
  (torchtitan's default `selective op` AC: "save every other matmul"), about half the matmul
  outputs' memory for recomputing those matmuls;
- full: keep only the atom's input, recompute its whole forward (Chen et al. 2016).
Tensor parallel is Megatron-style: a block's column-wise -> row-wise regions are divided by tp;
with sequence parallelism the rest of the block (norms, residuals, dropout) too (Korthikanti et
al. 2022: sbh(34/t + 5as/ht) with it, sbh(10 + 24/t + 5as/ht) without). Its collectives are
costed call by call (`tp_collectives_s`), and DTensor's host work per sharded Linear as `plan
calibrate` measured it.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, fields, replace

from planner.cost import comm
from planner.cost.compute import Work, memory_bound_s, roofline_s, stream_s
from planner.cost.gemm_shapes import TABLES as SHAPE_TABLES, linear_factor
from planner.cost.constants import (
    ACCUMULATE_BYTES,
    ATTENTION_ROW_KEYS,
    ATTENTION_TILE,
    DDP_BUCKET_BYTES,
    LOSS_PARALLEL_EXTRA,
    FRAGMENTATION_CPU,
    FRAGMENTATION_GPU,
    RESERVE_CPU_BYTES,
    OP_OVERHEAD_S,
    RESERVE_GPU_BYTES,
)
from planner.cost.memo import cache_of
from planner.cost.pipeline import inflight_per_stage
from planner.cost.setup import LOW_PRECISIONS, RECOMPUTE, Candidate, Training
from planner.cost.topology import Links, deepep_all_to_all, links
from planner.hardware import Cluster
from planner.profile.types import LayerProfile, ModelProfile

NONE, SELECTIVE, ALTERNATE, FULL = range(4)
KINDS = (NONE, SELECTIVE, ALTERNATE, FULL)
KIND_OF = dict(zip(RECOMPUTE, KINDS))
"""A recompute choice's name (plan, --recompute) -> its index in the cost tables."""


@dataclass(frozen=True)
class AtomCost:
    first: int
    last: int
    fwd_s: float
    bwd_s: float
    tp_comm_s: float
    """Part of fwd_s + bwd_s spent in tensor-parallel collectives."""
    cp_comm_s: float
    """Part of fwd_s + bwd_s spent in context-parallel ring exchanges (exposed past attention)."""
    ep_comm_s: float
    """Part of fwd_s + bwd_s spent in expert-parallel all-to-alls (dispatch and combine)."""
    extra_s: tuple[float, ...]
    """Recompute time added per micro-batch, by choice (none, selective, alternate, full)."""
    act_bytes: tuple[float, ...]
    """Activation bytes kept per micro-batch, by choice."""
    params: float
    """Parameters on the device before ZeRO sharding (after tensor and expert parallelism)."""
    out_bytes: float
    """Bytes a pipeline cut after this atom sends per micro-batch, per device."""
    cut_ok: bool
    expert_params: float = 0.0
    """Of params, experts split by expert parallelism (0 without it): their state is sharded over
    the expert replicas, not the whole dp group (StageCosts.state_bytes)."""
    gathers: int = 1
    """The collectives ZeRO-3 gathers this atom's parameters with, each way (Training.zero3_gathers):
    1 when the trainer gathers a layer at once."""

    def signature(self) -> tuple:
        return (self.fwd_s, self.bwd_s, self.extra_s, self.act_bytes, self.params, self.out_bytes, self.expert_params,
                self.gathers)


class AtomTable(tuple):
    """A tuple of AtomCost (atom_table's answer) that keeps what is derived from it alone: the
    search prices thousands of candidates on a few dozen tables, and its bounds, starting splits
    and stage_costs ask each the same sums. `memo(key, make)`: `make()` once per key."""

    def memo(self, key, make):
        cache = self.__dict__.setdefault("_memo", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    @functools.cached_property
    def param_totals(self) -> tuple[float, float]:
        """(parameters, of them experts) over all atoms."""
        return sum(a.params for a in self), sum(a.expert_params for a in self)

    def times(self, kind: int | None) -> list[float]:
        """Each atom's seconds per micro-batch with recompute `kind` (None: forward + backward only)."""
        return self.memo(("times", kind), lambda: [a.fwd_s + a.bwd_s + (a.extra_s[kind] if kind is not None else 0.0)
                                                    for a in self])


@dataclass(frozen=True)
class StageCosts:
    """Everything the partitioner needs for one candidate."""

    cand: Candidate
    atoms: tuple[AtomCost, ...]
    inflight_stage: tuple[float, ...]
    """Per stage (s on rank s % pp): the micro-batches' activations it holds at peak (what its
    activations, with their recompute choices, cost: evaluate.py and the partitioner)."""
    weight_bytes: int
    grad_bytes: int
    optim_bytes: int
    working_bytes: float
    """Backward working set, the larger of: one atom's activation gradients and, where it may be
    recomputed, its activations made again (two copies of its activations: every atom but the
    last, which is never recomputed); and the loss's (`loss_working_bytes`). Held on every device."""
    zero3_gather_bytes: float
    """ZeRO-3: gathered parameters of the two largest atoms (current + prefetched)."""
    grads_freed: bool
    """The gradients are not held at the activations' peak: torch's trainers free them after each
    step (zero_grad(set_to_none=True)) and, with one micro-batch and no pipeline, backward makes
    each layer's as it frees that layer's activations, so the peak holds the larger of the two,
    not both (a device's memory: max(activations, gradients) beside the weights and optimizer
    state). Where FSDP2 holds them (ZeRO-2/3, or the runtime's single rank) and the trainer is
    not Megatron-LM, whose contiguous gradient buffers persist, as DDP's buckets do (ZeRO-0/1
    over dp > 1). Measured on an H200 (bench/measured/h200_gpu_check_2026-12-04.txt): GPT 1B at
    micro-batch 8 x 1, 39.49 GB allocated at peak, where its tensors with gradients come to
    43.5 GB and without them to 39.4."""
    reserve_fixed_bytes: int
    fragmentation: float
    """The allocator's unused share on top of what tensors need (constants.FRAGMENTATION_*)."""
    limit_bytes: int
    p2p_s: float
    """Pipeline sends per stage per micro-batch: the activation forward, its gradient backward."""
    min_first_atoms: int
    """Atoms the first pipeline stage must hold at least: unless the pipelining tracer splits the
    model, the runtime runs every stage after the first as a plain sequence of layers, so the
    first cut must come where the layers run in sequence (ModelProfile.plain_from, tracer_splits)."""
    mb_comm_atom_s: float
    mb_comm_param_s: float
    """Data-parallel traffic every micro-batch: ZeRO-3 all-gathers each atom's parameters for
    forward and again for backward and reduce-scatters its gradients; ZeRO-2 reduce-scatters
    (sharded gradients cannot accumulate unreduced, as torchtitan and DeepSpeed run it);
    ZeRO-0/1: none; under a pipeline (`pipelined_fsdp`) only ZeRO-3's gather for backward.
    Prefetching overlaps the bytes (params x mb_comm_param_s) with compute, but each
    collective's startup latency (mb_comm_atom_s for each, mb_latency_s: one an atom, or one per
    gather, AtomCost.gathers) stays on the critical path: a layer waits for its gather."""
    grad_sync: comm.Affine
    """Once per step, on the gradient bytes, overlapped with the last micro-batch's backward:
    an all-reduce for ZeRO-0 and ZeRO-1 (DDP, whose gradients stay whole; ZeRO-1 then steps a
    sharded optimizer, as runtime/data_parallel.py runs it); ZeRO-2/3 under a pipeline: the
    weights' all-gather and the gradients' reduce-scatter; none otherwise (per micro-batch)."""
    tail_s: float
    """Gradient sync that cannot overlap the backward: the last bucket (DDP's 25 MB, or all the
    gradients of a rank when they are fewer)."""
    after_step_param_s: float
    """Per parameter, after the optimizer: ZeRO-1/2 all-gather the updated 16-bit weights (ZeRO-2
    under a pipeline: in grad_sync)."""
    after_step_atom_s: float
    """... one collective per atom (layer by layer), each paying its startup latency."""
    optimizer_s_per_param: float
    links: Links
    model_flops_per_step: float
    """Model FLOPs (forward + backward, no recompute) of one step over the whole cluster."""
    expert_state_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """With expert parallelism: (weights, gradients, optimizer state) bytes per expert parameter
    on a device, ZeRO sharding over the expert replicas (Candidate.expert_replicas) in place of
    dp_shard; the expert_* figures below likewise replace their dense counterparts for experts."""
    expert_mb_comm_param_s: float = 0.0
    expert_grad_sync_per_byte_s: float = 0.0
    expert_after_step_param_s: float = 0.0
    """ZeRO-1/2's all-gather after the step, plus the optimizer, per expert parameter."""
    dp_overlap: float | None = None
    """The share of the data-parallel traffic hidden behind compute (Training.dp_overlap); None:
    what its contention leaves (comm.overlap_share of dp_load), read when evaluated
    (bench_published --fit varies OVERLAP_CONTENTION)."""
    dp_load: float = 0.0
    """The data-parallel group's link bandwidth over the GPU's HBM bandwidth (comm.link_load)."""

    @property
    def dp_share(self) -> float:
        """The share of the data-parallel traffic that compute beside it hides (comm.overlap_share)."""
        return comm.overlap_share(self.dp_overlap, self.dp_load)

    @property
    def param_totals(self) -> tuple[float, float]:
        """(parameters, of them experts) over all atoms: what the search's bounds ask of every candidate."""
        return self.atoms.param_totals

    @property
    def num_devices(self) -> int:
        return self.cand.pp

    def device_bytes(self, held):
        """The memory a device takes for `held` bytes of tensors: the allocator's fragmentation on
        top, and the fixed reserve (CUDA context, NCCL). Linear: the ILP calls it with expressions."""
        return (1 + self.fragmentation) * held + self.reserve_fixed_bytes

    @property
    def pipelined_fsdp(self) -> bool:
        """ZeRO-2/3 (FSDP2) under a pipeline schedule: PyTorch's PipelineStage runs every backward
        but the last without gradient sync and without resharding, so a stage's parameters and
        gradients are whole for most of the step, and reduce-scattered once, after the last
        micro-batch (torch.distributed.pipelining.stage, backward_maybe_with_nosync)."""
        return pipelined_fsdp(self.cand)

    def state_bytes_per_param(self) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) bytes per parameter on a device after ZeRO
        sharding over the dp replicas: stage 1 shards the optimizer state, 2 also the gradients,
        3 also the weights. Under a pipeline (`pipelined_fsdp`) ZeRO-2/3 hold the stage's 16-bit
        weights and its gradients whole, the gradients accumulated in FSDP2's reduce dtype (fp32)."""
        return _sharded_state(self.cand, self.cand.dp_shard, self.weight_bytes, self.grad_bytes, self.optim_bytes)

    # -- figures over a device's parameters, `experts` of them split by expert parallelism ------
    # (linear in both: the ILP calls them with its expressions)
    def state_bytes(self, params, experts=0.0) -> tuple:
        """(weights, gradients, optimizer state) bytes on a device holding `params` parameters."""
        dense = self.state_bytes_per_param()
        return tuple(params * d + experts * (e - d) for d, e in zip(dense, self.expert_state_bytes)) if self.cand.ep > 1 \
            else tuple(params * d for d in dense)

    def latency_units(self, atom: AtomCost) -> int:
        """The collectives of `atom` that each pay mb_comm_atom_s every micro-batch: ZeRO-3's
        gathers (AtomCost.gathers), or ZeRO-2's one reduce-scatter."""
        return atom.gathers if self.cand.zero == 3 else 1

    @property
    def latency_key(self) -> tuple:
        """What mb_latency_s depends on beside the atoms (a memo key for what is derived from it)."""
        return self.cand.zero == 3, self.mb_comm_atom_s

    def mb_latency_s(self, atoms) -> float:
        """The startup latency of ZeRO-2/3's collectives every micro-batch over `atoms`."""
        return self.mb_comm_atom_s * sum(self.latency_units(a) for a in atoms) if self.mb_comm_atom_s else 0.0

    def mb_comm_s(self, params, experts=0.0):
        """ZeRO-2/3's data-parallel bytes every micro-batch, in seconds (mb_comm_param_s)."""
        return self.mb_comm_param_s * params + (self.expert_mb_comm_param_s - self.mb_comm_param_s) * experts

    def grad_sync_s(self, params, experts=0.0):
        """The once-per-step gradient sync (grad_sync) of a device's gradients."""
        g = self.grad_bytes
        return self.grad_sync.fixed_s + self.grad_sync.per_byte_s * g * params + (
            self.expert_grad_sync_per_byte_s - self.grad_sync.per_byte_s) * g * experts

    def after_step_s(self, params, experts=0.0):
        """ZeRO-1/2's weight all-gather and the optimizer step, without the per-atom latencies."""
        dense = self.after_step_param_s + self.optimizer_s_per_param
        return dense * params + (self.expert_after_step_param_s - dense) * experts


def _sharded_state(cand: Candidate, ranks: int, w: int, g: int, o: int) -> tuple[float, float, float]:
    """StageCosts.state_bytes_per_param with ZeRO sharding over `ranks`."""
    zero = cand.zero
    if pipelined_fsdp(cand):
        return float(w), float(max(g, ACCUMULATE_BYTES)), o / ranks
    return w / (ranks if zero >= 3 else 1), g / (ranks if zero >= 2 else 1), o / (ranks if zero >= 1 else 1)


def pipelined_fsdp(cand: Candidate) -> bool:
    """ZeRO-2/3 over dp > 1 inside a pipeline (StageCosts.pipelined_fsdp)."""
    return cand.pp > 1 and cand.zero >= 2 and cand.grad_ranks > 1


def _scale(profile: ModelProfile, micro_batch: int, cp: int = 1) -> float:
    """A rank's share of the profiled batch's tokens: its micro-batch, 1/cp of each sequence.
    FLOPs, bytes and saved tensors scale with it, attention's too: with a sequence split in cp
    load-balanced shards (torch's context_parallel for causal attention) each rank's queries
    meet the whole sequence's keys, 1/cp of the attention's work."""
    return micro_batch / (profile.batch_size * cp)


# Bytes per element of the gradients of keys and values a context-parallel ring accumulates and
# passes on in backward: fp32 (torch's context_parallel, _cp_options.convert_to_f32 default).
CP_GRAD_ACCUM_BYTES = 4
# Transformer Engine's ring (attention_kernel "te") in fp32 passes over the whole sequence's queries
# on a rank: its partial outputs corrected into the running one (4 passes) and its query gradients
# summed (2). With cp steps over 1/cp of the queries, a layer pays this once over the whole
# sequence's queries, whatever cp is.
CP_MERGE_PASSES = (4, 2)


def torch_ring_merge_bytes(q: float, kv: float, cp: int, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) memory-bound bytes of torch's context_parallel ring on one rank per
    layer, beside its attention kernels: `q` the elements of the rank's queries, `kv` of the keys
    and values SDPA is given (repeated to the query heads where the model repeats them), in a
    `dtype_bytes` dtype, accumulated in fp32 (_cp_options.convert_to_f32, its default). Counted from
    torch/distributed/tensor/experimental/_attention.py (_templated_ring_attention, its backward,
    _SDPAMerger, _partial_update), one eager kernel per op, on the rank whose later steps cover
    all its queries (load balancing's last rank: the slowest).

    Forward, at each of the cp - 1 steps after the first: the block's output cast to fp32, then
    out - sigmoid(lse - block lse) x (out - block out) as three fp32 ops (12 + 8 + 12 bytes an
    element); at the first cp - 1 steps the keys and values concatenated for the rotater (read and
    written); the first block's cast to fp32 and the result's back. Backward: fp32 zeros for the
    three gradients; at each of cp - 1 steps the keys and values concatenated again; at every step
    the step's key and value gradients added into the fp32 totals (after the first, into the
    first half of each and the whole rebuilt by torch.cat: _partial_update), the totals
    concatenated to pass on, and the query gradient added; at the end both cast back."""
    f, b = 4, dtype_bytes
    cast = f + b if b < f else 0  # .to(float32) of fp32 is the same tensor, no copy
    add = 2 * f + b  # an fp32 total += a gradient in the dtype: read both, write the total
    steps = cp - 1
    fwd = steps * ((cast + 32) * q + 2 * b * kv) + 2 * cast * q
    first = add * (q + kv) + 2 * f * kv  # the first step's sums and the totals' concatenation
    later = (add / 2 + 2 * f) * kv + 2 * f * kv + add * q  # a half-sum rebuilt whole, the concatenation, the queries'
    bwd = f * (q + kv) + steps * 2 * b * kv + first + steps * later + cast * (q + kv)
    return fwd, bwd


def _dtype_bytes(profile: ModelProfile) -> int:
    return 4 if profile.dtype == "fp32" else 2


def tp_collectives_s(layer: LayerProfile, tp: int, sequence_parallel: bool, link: comm.Link, scale: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's TP collectives per micro-batch, one call at a time
    as Megatron-LM and DTensor issue them (each pays its latency). Each row-wise Linear's output is
    all-reduced in forward (reduce-scattered over the sequence with sequence parallelism, and its
    gradient all-gathered in backward). Each column-wise Linear's input gradient is all-reduced in
    backward (runtime/tensor_parallel.py runs ColwiseParallel on each); with sequence parallelism
    each gathered group's input (the attention's, the MLP's: TPRole.gathers; a column-wise Linear
    outside them on its own) is all-gathered in forward and its gradient reduce-scattered, and
    every norm parameter's gradient all-reduced (a partial sum over the sequence shards). Each
    direction moves the profile's all-reduced bytes, shared among its calls."""
    info, role = layer.tp, layer.tp_role
    rows = len(info.rowwise)
    if sequence_parallel and role is not None:  # a gathered group, or a Linear gathering its own input
        groups = len(role.gathers) + sum(1 for c in info.colwise if not any(c.startswith(g + ".") for g in role.gathers))
    else:  # DTensor all-reduces each column-wise Linear's input gradient on its own
        groups = len(info.colwise)
    total = info.allreduce_bytes * scale

    def calls(n: int, collective) -> float:
        return n * collective(tp, link)(total / n) if n else 0.0

    if not sequence_parallel:
        return calls(rows, comm.allreduce), calls(groups, comm.allreduce)
    if role is not None and role.kind == "embedding" and role.shard_at:
        # its whole output all-reduced; the block that cuts it (TPRole.shard_at) gathers its gradient
        return calls(rows, comm.allreduce), calls(rows, comm.allgather)
    norms = 0 if role is None else (role.norm_params or len(role.norms))
    return (calls(rows, comm.reduce_scatter) + calls(groups, comm.allgather),
            calls(rows, comm.allgather) + calls(groups, comm.reduce_scatter) + norms * comm.allreduce(tp, link)(0.0))


def tp_layout_copy_bytes(layer: LayerProfile, scale: float, micro_batch: int) -> float:
    """Bytes read and written per direction (forward or backward) by the copies batch-first
    tensors cost a sequence-parallel layer's collectives (Training.tp_batch_first): each
    reduce-scatter's input, and each all-gather's output where the micro-batch holds more than one
    sequence, copied whole (read and written). The tensors a direction reduce-scatters, like those
    it all-gathers, come to the profile's all-reduced bytes (tp_collectives_s)."""
    total = layer.tp.allreduce_bytes * scale
    return 2 * total * (2 if micro_batch > 1 else 1)


def ring_bytes(layer: LayerProfile, profile: ModelProfile, micro_batch: int, shard: int,
               training: Training) -> tuple[float, float]:
    """A context-parallel ring per micro-batch on one rank: (keys and values of the whole
    sequence for this rank's heads, their fp32 gradients): what forward gathers (and backward
    again), and what backward returns to their owners. Transformer Engine's attention takes
    grouped-query keys and values as they are and its ring moves those (the key/value heads);
    torch's context_parallel moves what SDPA is given (repeated to the query heads where the model
    repeats them)."""
    unique = training.attention_kernel == "te" and layer.attention_kv_unique_bytes
    kv = (layer.attention_kv_unique_bytes if unique else layer.attention_kv_bytes) * _scale(profile, micro_batch) / shard
    return kv, kv * CP_GRAD_ACCUM_BYTES / _dtype_bytes(profile)


def _shard(layer: LayerProfile, tp: int) -> int:
    return tp if layer.tp is not None and tp > 1 and layer.tp.legal(tp) else 1


def _vocab_split(profile: ModelProfile, layer: LayerProfile, tp: int) -> bool:
    """Whether `layer` is the model's head and TP splits it over the vocabulary (column-wise), so
    that the default loss runs as torch's loss_parallel on the logits shards."""
    return (layer.index == len(profile.layers) - 1 and _shard(layer, tp) > 1 and layer.tp is not None
            and not layer.tp.rowwise and layer.kind == "Linear")


def fused_loss(profile: ModelProfile, training: Training, tp: int) -> bool:
    """Whether the trainer runs the model's default loss fused (Training.fused_loss): keeping what
    the eager loss the profile measured keeps (its saved tensors: fp32 log-probabilities or
    softmax), and in backward one gradient of the logits in their dtype where the eager one holds
    two more fp32 copies. Not for a model file's own loss_fn (measured as written), nor for a
    head TP splits over the vocabulary (torch's loss_parallel: `loss_working_bytes`)."""
    return ((training.fused_loss or training.compiled_loss or not training.loss_upcast) and not profile.own_loss
            and profile.output_bytes is not None and not _vocab_split(profile, profile.layers[-1], tp))


def compiled_loss_saving(profile: ModelProfile, training: Training, tp: int) -> float:
    """What a compiled default loss (Training.compiled_loss), or one on the 16-bit logits
    (Training.loss_upcast False), saves for backward less than the eager one the profile measured,
    at the profile's batch: the logits' size in their dtype instead of the fp32 log-probabilities
    (`loss_saved_bytes` less `output_bytes`). 0 where the loss is neither, is the model file's own,
    or runs on vocabulary shards (`fused_loss`)."""
    if not ((training.compiled_loss or not training.loss_upcast) and fused_loss(profile, training, tp)
            and profile.loss_saved_bytes is not None):
        return 0.0
    return max(0.0, profile.loss_saved_bytes - profile.output_bytes)


def loss_working_bytes(profile: ModelProfile, tp: int, micro_batch: int, cp: int = 1, fused: bool = False,
                       copies: int = 1) -> float:
    """The loss's working set in backward (on one rank, per micro-batch): what the profile measured
    (ModelProfile.loss_working_bytes: the gradient of the model's output and the loss's
    temporaries), `copies` of the model's output for a fused loss (`fused_loss`: one; two for an
    eager one on the 16-bit logits, Training.loss_upcast), or, when TP splits the
    head over the vocabulary, the default loss run as torch's loss_parallel (max, shift, exp, sum,
    subtract as separate ops), which holds LOSS_PARALLEL_EXTRA more fp32 copies of the logits
    shard (which the head's activations are: its saved log-probabilities) than the two of
    F.cross_entropy. 0 when the profile has no measurement (stage_costs then counts two copies of
    the last atom's activations)."""
    head = profile.layers[-1]
    scale = _scale(profile, micro_batch, cp)
    if _vocab_split(profile, head, tp):
        return (2 + LOSS_PARALLEL_EXTRA) * head.activation_bytes * scale / tp
    if fused:
        return (profile.output_bytes or 0) * scale * copies
    return (profile.loss_working_bytes or 0) * scale


def _loss_gradients(training: Training) -> int:
    """Gradients of the logits a fused loss holds at once in backward: one (a fused or compiled
    kernel writes it in place), two for F.cross_entropy on the 16-bit logits (Training.loss_upcast)."""
    return 1 if training.fused_loss or training.compiled_loss or training.loss_upcast else 2


FP8_CAST_PASSES = 2.5
"""Memory-bound work of a dynamic FP8 cast, in bf16 bytes of the operand: read twice (amax, then the
scaled cast), written once in 8 bits (torchao's Float8Linear, tensorwise scaling)."""
FP8_CAST_TRANSPOSE_PASSES = 3.0
"""The same with the transposed copy written too (Transformer Engine's cast_transpose)."""
NVFP4_HADAMARD_PASSES = 2.0
"""NVFP4 training's extra pass over each weight-gradient GEMM operand (the forward input's and the
output gradient's transposed copies): a 16 x 16 random Hadamard transform, read and written in 16
bits before the 4-bit cast (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv
2509.25149: random Hadamard transforms on the Wgrad inputs; Transformer Engine's NVFP4BlockScaling)."""

TE_SAVED_INPUT_BYTES = {"fp8": 1.0, "fp4": 0.5 + 1 / 16}
"""Bytes per element of the input copy a Transformer Engine Linear caches for its weight gradient
under FP8 and NVFP4 training: the quantized input, its row-wise data discarded and the column-wise
data kept (transformer_engine/pytorch/module/linear.py, _Linear.forward: "Discard row-wise data
since it is not needed in backward pass", saved_inputmat = the quantized inputmat), in place of
the 16-bit input autograd would keep. FP8: one byte (a tensor's scale or MXFP8's one byte per 32
elements aside); NVFP4: four bits and one E4M3 scale per 16 elements."""


def te_saved_inputs_bytes(layer: LayerProfile, whole: float, precision: str, dtype_bytes: int) -> float:
    """What a layer's Linear inputs that only Linears save (`whole`: their bytes on one rank at this
    micro-batch, of LayerProfile.activation_linear_input_bytes, which is not 0) come to as
    Transformer Engine keeps them: one low-precision copy per Linear that reads each
    (TE_SAVED_INPUT_BYTES)."""
    copies = layer.activation_linear_input_copies / layer.activation_linear_input_bytes
    return whole * copies * TE_SAVED_INPUT_BYTES[precision] / dtype_bytes


def fp8_cast_bytes(layer: LayerProfile, scale: float, shard: int, recipe: str = "torchao", fp4: bool = False,
                   scope: str = "op") -> tuple[float, float]:
    """(forward, backward) memory-bound bytes of a layer's FP8 casts per micro-batch on one rank,
    `scale` the rank's share of the profiled tokens and `shard` tensor parallelism's split.

    torchao casts every Linear matmul operand at each use (FP8_CAST_PASSES x its 16-bit bytes),
    the weights again in every forward and backward: their casts are the same whatever the
    micro-batch, where the activations' scale with it. Transformer Engine ("te") casts each
    forward input once (kept in FP8 for the weight gradient) and each output gradient once with
    its transpose for both backward matmuls; its weights are cast once per step
    (Training.optimizer_traffic_per_param). Backward's activation operands are each output
    gradient twice (input and weight gradients) and each input once, so the output gradients are
    half of what backward reads beyond the forward's inputs. NVFP4 (`fp4`, Transformer Engine's
    only) casts as its FP8 does, and transforms both weight-gradient operands first
    (NVFP4_HADAMARD_PASSES). torchao's casts compiled (`scope`, Training.fp8_cast_scope: "linear",
    or "block" for a compiled model) run once per tensor: forward its inputs and weights (under
    "block" an input several Linears read once: LayerProfile.activation_linear_input_copies less
    activation_linear_input_bytes are the extra reads), backward each output gradient."""
    inputs = layer.fwd_linear_operand_bytes - layer.fwd_linear_weight_bytes
    bwd_acts = layer.bwd_linear_operand_bytes - layer.bwd_linear_weight_bytes
    if recipe == "te":  # its grouped GEMMs too (an expert layer's routed rows), cast alike
        inputs += layer.fwd_grouped_operand_bytes
        bwd_acts += layer.bwd_grouped_operand_bytes
        grads = max(0.0, bwd_acts - inputs) / 2
        rht = NVFP4_HADAMARD_PASSES if fp4 else 0.0
        return (FP8_CAST_PASSES + rht) * inputs * scale / shard, (FP8_CAST_TRANSPOSE_PASSES + rht) * grads * scale / shard
    if scope == "op":
        return tuple(FP8_CAST_PASSES * (acts * scale + weights) / shard
                     for acts, weights in ((inputs, layer.fwd_linear_weight_bytes), (bwd_acts, layer.bwd_linear_weight_bytes)))
    grads = max(0.0, bwd_acts - inputs) / 2
    if scope == "block" and layer.activation_linear_input_copies:
        inputs -= layer.activation_linear_input_copies - (layer.activation_linear_input_bytes or 0)
    return (FP8_CAST_PASSES * (inputs * scale + layer.fwd_linear_weight_bytes) / shard,
            FP8_CAST_PASSES * grads * scale / shard)


def fused(layer: LayerProfile) -> LayerProfile:
    """The layer with its memory-bound traffic as fused kernels run it (LayerProfile.fwd_fused_io_bytes):
    the parts of the forward's (inside TP regions, after the last saved tensor) in its proportion."""
    if not layer.fwd_fused_io_bytes and not layer.bwd_fused_io_bytes:
        return layer  # a profile from before fused traffic was recorded: as eager
    share = layer.fwd_fused_io_bytes / layer.fwd_other_io_bytes if layer.fwd_other_io_bytes else 1.0
    return replace(layer, fwd_other_io_bytes=layer.fwd_fused_io_bytes, bwd_other_io_bytes=layer.bwd_fused_io_bytes,
                   fwd_other_io_tp_bytes=round(layer.fwd_other_io_tp_bytes * share),
                   fwd_tail_other_io_bytes=round(layer.fwd_tail_other_io_bytes * share))


def attention_run_flops(attention: float, causal: float, keys: float | None) -> float:
    """The FLOPs a fused attention kernel runs at its plateau rate for `attention` FLOPs as the
    profile counts them (every query against every key), `causal` of them in causal calls, with
    `keys` keys per call (None: unknown, no per-row work): a call's rows each run their keys and
    ATTENTION_ROW_KEYS more; a causal call's rows half their keys, plus half a diagonal tile."""
    per_key = 1.0 / keys if keys else 0.0
    return ((attention - causal) * (1 + ATTENTION_ROW_KEYS * per_key)
            + causal / 2 * (1 + (ATTENTION_TILE + 2 * ATTENTION_ROW_KEYS) * per_key))


def _attention_share(work: Work, gpu, dtype: str) -> float:
    """The share of a phase's roofline time its fused attention takes."""
    if not work.attention_flops:
        return 0.0
    alone = Work(work.attention_flops, 0.0, 0.0, 0, attention_flops=work.attention_flops)
    return min(1.0, roofline_s(alone, gpu, dtype) / max(roofline_s(work, gpu, dtype), 1e-30))


def _matmuls_at(gpu, share: float):
    """`gpu` with its matmuls (16-bit and FP8) at `share` of their measured ceilings."""
    if share >= 1.0:
        return gpu
    fp8 = gpu.fp8_matmul_efficiency * share if gpu.fp8_matmul_efficiency is not None else None
    return replace(gpu, matmul_efficiency=gpu.matmul_efficiency * share, fp8_matmul_efficiency=fp8)


def _layer_costs(
    layer: LayerProfile,
    input_bytes: float,
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    cand: Candidate,
    lk: Links,
    cpu_factor: float | None,
) -> tuple:
    """(fwd_s, bwd_s, tp_comm_s, cp_comm_s, ep_comm_s, extra_s, act_bytes, params, expert params)
    of one layer, per micro-batch."""
    if cand.ep > 1 and layer.tp is not None and layer.tp.moe:
        # Expert parallelism leaves the mixture-of-experts blocks whole (torchtitan's ETP = 1): their
        # Linears are not split by TP, nor counted in its parameters, collectives and host overhead
        # below; with sequence parallelism (which EP with TP needs) each tp rank runs the block on
        # its 1/tp of the tokens, so the layer's work and activations divide by tp as the rest do.
        whole = tuple((r, n, k, "" if role.startswith("moe:") else role) for r, n, k, role in layer.linears)
        layer = replace(layer, tp=layer.tp.under_ep(), linears=whole)
    if training.fused_kernels:
        layer = fused(layer)
    if (training.loss_bytes_per_logit and layer.index == len(profile.layers) - 1 and not profile.own_loss
            and profile.output_bytes):
        # the trainer's own cross-entropy on the head's logits, in place of the traced loss ops
        logits = profile.output_bytes / _dtype_bytes(profile)
        fwd_b, bwd_b = training.loss_bytes_per_logit
        share = fwd_b * logits / layer.fwd_other_io_bytes if layer.fwd_other_io_bytes else 0.0
        layer = replace(layer, fwd_other_io_bytes=round(fwd_b * logits), bwd_other_io_bytes=round(bwd_b * logits),
                        fwd_other_io_tp_bytes=round(layer.fwd_other_io_tp_bytes * share),
                        fwd_tail_other_io_bytes=round(layer.fwd_tail_other_io_bytes * share))
    scale = _scale(profile, cand.micro_batch, cand.cp)
    shard = _shard(layer, cand.tp)
    gpu = cluster.gpu
    attention = gpu.attention_share(training.attention_kernel, training.sdpa_cudnn)
    if attention != gpu.attention_efficiency:  # the trainer's attention kernels (Transformer Engine's)
        gpu = replace(gpu, attention_efficiency=attention)
    gpu_bwd = gpu
    table = SHAPE_TABLES.get(gpu.matmul_shapes) if gpu.matmul_shapes and cpu_factor is None else None
    if table is not None and (layer.linears or layer.grouped_gemms):
        # its Linears' GEMMs at this micro-batch and TP degree reach a share of the best matmul rate
        # (small and skinny ones less: planner.cost.gemm_shapes), forward and backward; an expert's
        # GEMM runs the rows routed to it, from every rank of its EP group (balanced routing)
        f_fwd, f_bwd = linear_factor(table, layer.linears, scale, shard, layer.grouped_gemms, scale / shard * cand.ep)
        gpu, gpu_bwd = _matmuls_at(gpu, f_fwd), _matmuls_at(gpu, f_bwd)
    # Without sequence parallelism a block's work and tensors outside its column-wise -> row-wise
    # regions (norms, residuals, dropout) are whole on every TP rank: `whole` is that share of the
    # memory-bound traffic (backward in the forward's proportion); `split` below does the bytes.
    split_all = shard == 1 or cand.sequence_parallel or not layer.tp.required
    other = layer.fwd_other_io_bytes
    whole = 0.0 if split_all or not other else (other - layer.fwd_other_io_tp_bytes) / other
    # FP8 or NVFP4 Linears (LayerProfile.fwd_linear_flops), the head's where the trainer converts it
    fp8 = training.precision in LOW_PRECISIONS and (
        training.fp8_head or layer.tp_role is None or layer.tp_role.kind != "head")
    scope = "block" if training.compiled else training.fp8_cast_scope
    cast = fp8_cast_bytes(layer, scale, shard, training.fp8_recipe, training.precision == "fp4", scope) if fp8 else (0.0, 0.0)
    # fused attention at its plateau rate runs the FLOPs of its keys plus each query row's fixed
    # work: causal calls about half what the profile counts (their kernels skip the masked blocks).
    # FlashAttention in Triton's share is FlashAttention-2's over a slowdown read at the lengths of
    # its paper's benchmark, its rows' work in it (constants.ATTENTION_ROW_KEYS): half, no more
    keys = profile.seq_len / cand.cp if profile.seq_len and training.attention_kernel != "triton" else None
    skip = (layer.fwd_attention_flops - attention_run_flops(layer.fwd_attention_flops, layer.fwd_causal_attention_flops, keys),
            layer.bwd_attention_flops - attention_run_flops(layer.bwd_attention_flops, layer.bwd_causal_attention_flops, keys))
    # an unfused attention's batched matmuls (those selective recompute reruns), backward two per one
    batched = layer.fwd_selective_flops, layer.fwd_selective_io_bytes
    # the matmuls FP8 runs in 8 bits: the Linears', and under Transformer Engine the grouped GEMMs'
    grouped = training.fp8_recipe == "te"
    fp8_fwd = layer.fwd_linear_flops + (layer.fwd_grouped_flops if grouped else 0) if fp8 else 0.0
    fp8_bwd = layer.bwd_linear_flops + (layer.bwd_grouped_flops if grouped else 0) if fp8 else 0.0
    fwd_work = Work(layer.fwd_flops - skip[0], layer.fwd_matmul_io_bytes, layer.fwd_other_io_bytes * (1 - whole),
                    layer.fwd_ops, fp8_fwd, layer.fwd_attention_flops - skip[0], *batched)
    bwd_work = Work(layer.bwd_flops - skip[1], layer.bwd_matmul_io_bytes, layer.bwd_other_io_bytes * (1 - whole),
                    layer.bwd_ops, fp8_bwd, layer.bwd_attention_flops - skip[1],
                    *(min(2 * b, total) for b, total in zip(batched, (layer.bwd_flops, layer.bwd_matmul_io_bytes))))
    # Recompute reruns a layer's forward up to the last tensor backward reads (LayerProfile.fwd_tail_*:
    # torch's non-reentrant checkpoint stops there) unless the trainer's checkpoint reruns it whole
    stops = not training.recompute_whole_forward
    # the Linear matmuls the alternate policy recomputes (column- or row-wise: split by TP)
    alt_flops = layer.fwd_alternate_flops - (layer.fwd_tail_alternate_flops if stops else 0)
    alt_work = Work(alt_flops, layer.fwd_alternate_io_bytes - (layer.fwd_tail_alternate_io_bytes if stops else 0), 0.0, 0,
                    alt_flops if fp8 else 0.0).scaled(scale / shard)
    # the matmul-like ops selective recompute reruns (an unfused attention's batched matmuls)
    core_work = Work(*batched, 0.0, 0, batched_flops=batched[0], batched_bytes=batched[1]).scaled(scale / shard)
    fwd_work, bwd_work = fwd_work.scaled(scale / shard), bwd_work.scaled(scale / shard)
    if cand.ep > 1 and layer.expert_params and layer.num_params:
        # each rank's grouped GEMMs read (and backward writes the gradients of) its own experts'
        # weights alone, 1/ep of the layer's, once a micro-batch whatever its size
        weights = layer.expert_params * layer.param_bytes / layer.num_params
        away = weights * (scale / shard - 1 / cand.ep)
        fwd_work = replace(fwd_work, matmul_bytes=max(0.0, fwd_work.matmul_bytes - away))
        bwd_work = replace(bwd_work, matmul_bytes=max(0.0, bwd_work.matmul_bytes - 2 * away))
    fwd_work = replace(fwd_work, other_bytes=fwd_work.other_bytes + layer.fwd_other_io_bytes * whole * scale,
                       stream_bytes=cast[0])
    bwd_work = replace(bwd_work, other_bytes=bwd_work.other_bytes + layer.bwd_other_io_bytes * whole * scale,
                       stream_bytes=cast[1])
    # what full recompute reruns: the share of the forward's roofline before the tail
    rerun = rerun_tp = 1.0
    tail_other = layer.fwd_tail_other_io_bytes * scale / shard if stops else 0.0  # selective's, likewise
    if stops and (layer.fwd_tail_ops or layer.fwd_tail_flops):
        tail_skip = layer.fwd_tail_attention_flops - attention_run_flops(
            layer.fwd_tail_attention_flops, layer.fwd_tail_causal_attention_flops, keys)
        tail = Work(layer.fwd_tail_flops - tail_skip, layer.fwd_tail_matmul_io_bytes, layer.fwd_tail_other_io_bytes,
                    layer.fwd_tail_ops, layer.fwd_tail_linear_flops if fp8 else 0.0,
                    layer.fwd_tail_attention_flops - tail_skip).scaled(scale / shard)
        whole_s = roofline_s(fwd_work, gpu, training.precision)
        rerun = roofline_s(fwd_work.minus(tail), gpu, training.precision) / whole_s if whole_s > 0 else 1.0
        if shard > 1 and layer.tp is not None and layer.tp.rowwise:  # a row-wise Linear's collective follows it
            rerun_tp = 1.0 - min(1.0, layer.fwd_tail_rowwise_linears / len(layer.tp.rowwise))
    if cpu_factor is not None and layer.fwd_s is not None and layer.bwd_s is not None:
        # measured seconds split as the roofline splits them (more than 1/tp without SP)
        even = Work(layer.fwd_flops - skip[0], layer.fwd_matmul_io_bytes, layer.fwd_other_io_bytes, layer.fwd_ops,
                    attention_flops=layer.fwd_attention_flops - skip[0]).scaled(scale / shard)
        roof = roofline_s(fwd_work, gpu, training.precision)
        share = roof / max(roofline_s(even, gpu, training.precision), 1e-30)
        fwd = layer.fwd_s * scale * cpu_factor / shard * share
        bwd = layer.bwd_s * scale * cpu_factor / shard * share
        other_share = memory_bound_s(max(0.0, fwd_work.other_bytes - tail_other), gpu) / roof if roof > 0 else 0.0
        core_share = roofline_s(core_work, gpu, training.precision) / roof if roof > 0 and core_work.flops else 0.0
        sel_extra = fwd * min(1.0, other_share + core_share)
        alt_extra = sel_extra + fwd * min(1.0, roofline_s(alt_work, gpu, training.precision) / roof if roof > 0 else 0.0)
    else:
        fwd = roofline_s(fwd_work, gpu, training.precision)
        bwd = roofline_s(bwd_work, gpu_bwd, training.precision)
        sel_extra = memory_bound_s(max(0.0, fwd_work.other_bytes - tail_other), gpu)
        if core_work.flops:
            sel_extra += roofline_s(core_work, gpu, training.precision)
        alt_extra = sel_extra + roofline_s(alt_work, gpu, training.precision)
    # refit from this cluster's runs (plan calibrate --from-run): measured / predicted per phase
    compute = gpu.factor("compute") * (gpu.factor("tp_compute") if cand.tp > 1 else 1.0)
    fwd, bwd, sel_extra, alt_extra = fwd * compute, bwd * compute, sel_extra * compute, alt_extra * compute
    tp_fwd = tp_bwd = 0.0
    if shard > 1:
        tp_fwd, tp_bwd = tp_collectives_s(layer, shard, cand.sequence_parallel, lk.tp, scale)
        if cand.sequence_parallel and training.tp_batch_first:
            copies = stream_s(tp_layout_copy_bytes(layer, scale, cand.micro_batch), gpu)
            tp_fwd, tp_bwd = tp_fwd + copies, tp_bwd + copies
        # DTensor's work on the host per sharded Linear (plan calibrate measures it): on top of a
        # CPU's measured seconds; beside a GPU's kernels, which it outlasts only when they are tiny
        linears = len(layer.tp.colwise) + len(layer.tp.rowwise)
        host_fwd, host_bwd = linears * gpu.tp_forward_overhead_s, linears * gpu.tp_backward_overhead_s
        if cpu_factor is not None:
            fwd, bwd = fwd + host_fwd, bwd + host_bwd
        else:
            fwd, bwd = max(fwd, fwd_work.ops * OP_OVERHEAD_S + host_fwd), max(bwd, bwd_work.ops * OP_OVERHEAD_S + host_bwd)
        if _vocab_split(profile, layer, cand.tp):
            # the loss on the logits shards as torch's loss_parallel runs it, beyond the fused
            # cross-entropy the profile timed with the head (plan calibrate measures it per element);
            # the head's activations are the loss's saved fp32 log-probabilities (loss_working_bytes)
            per_fwd, per_bwd = gpu.loss_parallel_s_per_element(cluster.num_gpus)
            logits = layer.activation_bytes / 4 * scale / shard
            fwd, bwd = fwd + per_fwd * logits, bwd + per_bwd * logits
        if cand.tp_overlap and cand.sequence_parallel:
            # chunked beside the Linear GEMMs (their share of the phase's time): what they do not
            # hide (all that outlasts them, with the trainer's share of the rest), and at least
            # the first chunk
            gemm_fwd = fwd * layer.fwd_linear_flops / layer.fwd_flops if layer.fwd_flops else 0.0
            gemm_bwd = bwd * layer.bwd_linear_flops / layer.bwd_flops if layer.bwd_flops else 0.0
            share = training.tp_overlap_share
            tp_fwd = max(tp_fwd / shard, comm.exposed_after_s(gemm_fwd, tp_fwd, share))
            tp_bwd = max(tp_bwd / shard, comm.exposed_after_s(gemm_bwd, tp_bwd, share))
    cp_fwd = cp_bwd = 0.0
    if cand.cp > 1 and layer.attention_kv_bytes:
        # The ring: forward gathers every rank's keys and values, beside the attention on those
        # already there; backward gathers them again and passes their gradients back (a
        # reduce-scatter's volume, in fp32). Exposed past the attention steps each runs beside
        # (ring_exposed_s), with the contention of the CP link's rate (comm.overlap_share).
        kv, dkv = ring_bytes(layer, profile, cand.micro_batch, shard, training)
        ag, rs = comm.allgather(cand.cp, lk.cp), comm.reduce_scatter(cand.cp, lk.cp)
        attn_fwd = fwd * _attention_share(fwd_work, gpu, training.precision)
        attn_bwd = bwd * _attention_share(bwd_work, gpu, training.precision)
        hidden = comm.overlap_share(None, comm.link_load(lk.cp, gpu.hbm_bandwidth_Bps))
        cp_fwd, cp_bwd = ring_exposed_s(attn_fwd, attn_bwd, ag(kv), rs(dkv), cand.cp, hidden,
                                        gathers_first=training.attention_kernel != "te")
        # the partial outputs merged (forward) and the gradients summed (backward) at every step:
        # the whole sequence's queries (SDPA's FLOPs are 4 x seq per query element)
        queries = layer.fwd_attention_flops * _scale(profile, cand.micro_batch) / (4 * profile.seq_len * shard)
        if training.attention_kernel == "te":
            merge = CP_MERGE_PASSES[0] * 4 * queries, CP_MERGE_PASSES[1] * 4 * queries
        else:
            size = _dtype_bytes(profile)
            merge = torch_ring_merge_bytes(queries / cand.cp, kv / size / cand.cp, cand.cp, size)
        fwd += memory_bound_s(merge[0], gpu) * compute
        bwd += memory_bound_s(merge[1], gpu) * compute
    tp_fwd, tp_bwd = tp_fwd * gpu.factor("tp_comm"), tp_bwd * gpu.factor("tp_comm")
    ep_fwd = ep_bwd = 0.0
    if cand.ep > 1 and layer.moe_dispatch_bytes:
        # Expert parallelism: forward sends each token's rows to the ranks of the experts it chose
        # and brings their outputs back (two all-to-alls); backward the same for their gradients.
        # Not overlapped with compute (the experts wait for their tokens), as torchtitan runs it.
        # With TP (and its sequence parallelism) a rank sends the rows of its 1/tp of the tokens.
        # DeepEP's kernels send a token over the network once to each node of its experts
        # (Training.ep_dispatch).
        routed = cand.tp if cand.tp > 1 and cand.sequence_parallel else 1
        a2a = (deepep_all_to_all(cluster, cand, layer.moe_experts, layer.moe_top_k, training.expert_node_limit, lk.ep)
               if training.ep_dispatch == "deepep" else comm.all_to_all(cand.ep, lk.ep))
        ep_fwd = ep_bwd = 2 * a2a(layer.moe_dispatch_bytes * scale / routed)
    cp_fwd, cp_bwd = cp_fwd * gpu.factor("comm"), cp_bwd * gpu.factor("comm")
    ep_fwd, ep_bwd = ep_fwd * gpu.factor("comm"), ep_bwd * gpu.factor("comm")
    rerun_ep = ep_fwd  # a fully recomputed layer reruns its forward alone (Megatron refuses the overlap with it)
    if cand.ep_overlap:
        # one micro-batch's forward beside another's backward, layer by layer (Candidate.ep_overlap):
        # the forward's all-to-alls beside the backward's compute, and the backward's beside the forward's
        ep_fwd, ep_bwd = comm.exposed_after_s(bwd, ep_fwd, 1.0), comm.exposed_after_s(fwd, ep_bwd, 1.0)
    # a recomputed layer exchanges its tokens again (checkpointing keeps matmul outputs at most),
    # and gathers again what its policy does not keep (Training.recompute_collectives)
    rerun_tp_comm = {"all": 1.0, "none": 0.0,
                     "all_gathers": 0.5 if cand.sequence_parallel else 1.0}[training.recompute_collectives]
    sel_extra, alt_extra = (x + ep_fwd + tp_fwd * rerun_tp_comm for x in (sel_extra, alt_extra))
    full_extra = fwd * rerun + tp_fwd * rerun_tp + cp_fwd + rerun_ep
    fwd += tp_fwd + cp_fwd + ep_fwd
    bwd += tp_bwd + cp_bwd + ep_bwd

    def split(total: int, tp_part: int) -> float:
        """Bytes per device of `total`, of which `tp_part` TP splits even without SP."""
        return total * scale / shard if split_all else (tp_part / shard + total - tp_part) * scale

    act = split(layer.activation_bytes, layer.activation_tp_bytes)
    if training.fused_kernels and layer.activation_fused_bytes is not None and layer.index < len(profile.layers) - 1:
        # fused kernels save what they read, not what they make and read themselves (the head's
        # activations are the loss's, which `fused_loss` and `compiled_loss_saving` price)
        act = split(layer.activation_fused_bytes, layer.activation_fused_tp_bytes or 0)
    if fp8 and training.fp8_recipe == "te" and layer.activation_linear_input_bytes:
        # Transformer Engine's Linears cache their inputs quantized for the weight gradient, not in
        # 16 bits (torchao's Float8Linear keeps the 16-bit input: no change there)
        whole = split(layer.activation_linear_input_bytes, layer.activation_linear_input_tp_bytes or 0)
        act = max(0.0, act - whole + te_saved_inputs_bytes(layer, whole, training.precision, _dtype_bytes(profile)))
    if split_all and shard > 1 and training.tp_saves_gathered and layer.activation_linear_input_bytes:
        # with sequence parallelism DTensor's TP saves what it gathers for the column-wise Linears
        # whole (Training.tp_saves_gathered): their inputs outside the TP regions (the norms'
        # outputs), divided by tp above with the rest. Under EP a mixture-of-experts block takes
        # the shard, not gathered: its input is counted as without EP (whole), the same figure.
        gathered = layer.activation_linear_input_bytes - (layer.activation_linear_input_tp_bytes or 0)
        act += gathered * scale * (1 - 1 / shard)
    kept_inputs = input_bytes * scale / (shard if split_all else 1)  # the block input: whole without SP
    # compiled (Training.compiled), selective checkpointing keeps no output that backward never reads
    sel_tail, alt_tail = ((layer.activation_matmul_tail_bytes, layer.activation_alternate_tail_bytes)
                          if training.compiled else (0, 0))
    act_sel = min(act, split(layer.activation_matmul_bytes - sel_tail, layer.activation_matmul_tp_bytes) + kept_inputs)
    alt_bytes, alt_tp_bytes = layer.activation_alternate_bytes, layer.activation_alternate_tp_bytes
    if alt_bytes is None:  # a profile from before the policy: as selective
        alt_bytes, alt_tp_bytes, alt_extra, alt_tail = (layer.activation_matmul_bytes, layer.activation_matmul_tp_bytes,
                                                        sel_extra, sel_tail)
    act_alt = min(act_sel, split(alt_bytes - alt_tail, alt_tp_bytes or 0) + kept_inputs)
    act_full = min(act, kept_inputs)
    sharded = layer.tp.sharded_params if shard > 1 and layer.tp is not None else 0
    experts = layer.expert_params / cand.ep if cand.ep > 1 else 0.0
    params = layer.num_params - sharded + sharded / shard - (layer.expert_params - experts if cand.ep > 1 else 0.0)
    return (fwd, bwd, tp_fwd + tp_bwd, cp_fwd + cp_bwd, ep_fwd + ep_bwd, (0.0, sel_extra, alt_extra, full_extra),
            (act, act_sel, act_alt, act_full), params, experts)


_NAMES = ("index", "name", "modules", "kind")


def _layer_figures(profile: ModelProfile) -> list[int]:
    """Per layer, an id of everything its costs depend on (all but where it is and what it is
    called): equal ids, equal costs. Made once per profile (the search asks for many tables)."""
    cache = cache_of(profile)
    if "figures" in cache:
        return cache["figures"]
    names = [f.name for f in fields(LayerProfile) if f.name not in _NAMES]

    def figure(layer: LayerProfile, name: str):
        value = getattr(layer, name)
        # the dropout modules a TP rank shards are named by the layer's path: the runtime's, no cost
        return replace(value, shard_dropout=()) if name == "tp_role" and value is not None else value

    ids: dict[tuple, int] = {}
    cache["figures"] = [ids.setdefault(tuple(figure(layer, n) for n in names), len(ids)) for layer in profile.layers]
    return cache["figures"]


def atoms_of(profile: ModelProfile) -> list[tuple[int, int]]:
    """Layer ranges [first, last] between valid pipeline cuts."""
    out, start = [], 0
    for layer in profile.layers:
        if layer.cut_after_ok or layer.index == len(profile.layers) - 1:
            out.append((start, layer.index))
            start = layer.index + 1
    return out


def ring_exposed_s(attn_fwd_s: float, attn_bwd_s: float, gather_s: float, reduce_s: float, cp: int, hidden: float,
                   gathers_first: bool) -> tuple[float, float]:
    """(forward, backward) seconds a context-parallel ring adds past its attention: the keys and
    values gathered (`gather_s`, forward and again in backward) and their gradients passed back
    (`reduce_s`, backward), each overlapped with the attention it runs beside (comm.exposed_after_s,
    `hidden` the share contention leaves hidden). Torch's context_parallel (`gathers_first`: its
    default rotater, _AllGatherRotater, all-gathers every rank's shard at the first step and waits
    for it at the second) hides the gather behind the first of its cp steps alone, the gradients'
    rotation behind the other cp - 1; Transformer Engine's ring sends each step's shard beside the
    step before, the whole attention."""
    if not gathers_first:
        return (comm.exposed_after_s(attn_fwd_s, gather_s, hidden),
                comm.exposed_after_s(attn_bwd_s, gather_s + reduce_s, hidden))
    return (comm.exposed_after_s(attn_fwd_s / cp, gather_s, hidden),
            comm.exposed_after_s(attn_bwd_s / cp, gather_s, hidden)
            + comm.exposed_after_s(attn_bwd_s * (cp - 1) / cp, reduce_s, hidden))


def atom_table(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    tp: int,
    micro_batch: int,
    cpu_factor: float | None = None,
    sequence_parallel: bool = True,
    tp_overlap: bool = False,
    cp: int = 1,
    ep: int = 1,
    ep_overlap: bool = False,
) -> tuple[AtomCost, ...]:
    """Per-atom costs for a TP degree, micro-batch, sequence-parallel, TP-overlap, CP, EP and
    EP-overlap choice (what the other choices do not change). `cpu_factor`: use the profile's
    measured seconds, times this."""
    probe = Candidate(tp, 1, ep, micro_batch, 1, 0, "1f1b", sequence_parallel=sequence_parallel, tp_overlap=tp_overlap,
                      cp=cp, ep=ep, ep_overlap=ep_overlap)
    lk = links(cluster, probe)
    layers = profile.layers
    per_layer = []
    seen: dict[tuple, tuple] = {}  # identical layers (a transformer's blocks) cost the same
    figures = _layer_figures(profile)
    for layer in layers:
        input_bytes = layers[layer.index - 1].output_bytes if layer.index > 0 else 0
        key = (figures[layer.index], input_bytes)
        if key not in seen:
            seen[key] = _layer_costs(layer, input_bytes, profile, cluster, training, probe, lk, cpu_factor)
        per_layer.append(seen[key])
    scale = _scale(profile, micro_batch, cp)
    atoms = []
    for first, last in atoms_of(profile):
        rows = per_layer[first : last + 1]
        act = tuple(sum(r[6][k] for r in rows) for k in KINDS)
        # Recomputing an atom keeps its own input only (the first layer's), not each layer's.
        act = (*act[:FULL], rows[0][6][FULL])
        if last == len(layers) - 1:
            # The last atom's backward follows its forward at once: recomputed, its activations
            # are made again before anything is freed, so recomputing it lowers no peak.
            # A compiled loss keeps the logits in their dtype, not fp32 log-probabilities.
            act = (act[NONE] - compiled_loss_saving(profile, training, tp) * scale,) * len(KINDS)
        last_layer = layers[last]
        # What crosses a pipeline cut, per rank: a TP layer's output, or the final norm's, is sent
        # 1/tp by each tp rank with sequence parallelism (its sequence shard) or where the trainer
        # scatters the replicated tensor (Training.p2p_scatter_gather); whole otherwise. The cut
        # after the final norm counted whole made every boundary of a tp x pp plan tp times its size.
        sharded = last_layer.tp is not None or (last_layer.tp_role is not None and last_layer.tp_role.kind == "norm")
        split = sequence_parallel or training.p2p_scatter_gather
        out_shard = tp if tp > 1 and sharded and split else 1
        atoms.append(
            AtomCost(
                first=first,
                last=last,
                fwd_s=sum(r[0] for r in rows),
                bwd_s=sum(r[1] for r in rows),
                tp_comm_s=sum(r[2] for r in rows),
                cp_comm_s=sum(r[3] for r in rows),
                ep_comm_s=sum(r[4] for r in rows),
                extra_s=tuple(sum(r[5][k] for r in rows) for k in KINDS),
                act_bytes=act,
                params=sum(r[7] for r in rows),
                out_bytes=last_layer.output_bytes * scale / out_shard,
                cut_ok=last_layer.cut_after_ok,
                expert_params=sum(r[8] for r in rows),
                gathers=zero3_gathers(layers[first : last + 1], training.zero3_gathers),
            )
        )
    return AtomTable(atoms)


def zero3_gathers(layers: list[LayerProfile], how: str) -> int:
    """The collectives ZeRO-3 gathers these layers' parameters with (Training.zero3_gathers): one
    for "layer"; one per module ("module") or parameter tensor ("tensor") that holds them, a layer
    of a profile that does not count them taken as one, and at least one."""
    if how == "layer":
        return 1
    return max(1, sum((l.param_modules if how == "module" else l.param_tensors) or (1 if l.num_params else 0)
                      for l in layers))


def _ring_working_bytes(profile: ModelProfile, cand: Candidate, training: Training) -> float:
    """With CP, one layer's gathered keys and values and their fp32 gradients live at once."""
    if cand.cp == 1:
        return 0.0
    return max((sum(ring_bytes(l, profile, cand.micro_batch, _shard(l, cand.tp), training)) for l in profile.layers),
               default=0.0)


def _exposed_sends(atoms: AtomTable, training: Training, cand: Candidate, sends_s: float) -> float:
    """A stage's pipeline sends per micro-batch (its activation forward, its gradient backward),
    as far as they hold the stage up. Under the interleaved schedule a trainer that overlaps them
    (Training.p2p_overlap) posts each chunk's sends and receives beside the next chunk's compute
    and waits only when it needs their data: exposed past that compute, for which a chunk's least
    is taken as a typical atom's (the median atom's forward and backward; a chunk holds one at
    least). Otherwise they run between the chunks' compute, all exposed."""
    if not (training.p2p_overlap and cand.schedule == "interleaved"):
        return sends_s
    chunk = atoms.memo("median_atom_s", lambda: statistics.median(a.fwd_s + a.bwd_s for a in atoms))
    return comm.exposed_after_s(chunk, sends_s, 1.0)


def stage_costs(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    cand: Candidate,
    cpu_factor: float | None = None,
    atoms: tuple[AtomCost, ...] | None = None,
) -> StageCosts:
    """The cost tables of `cand` (`atoms`: its atom_table, when the caller has it already)."""
    lk = links(cluster, cand)
    layers = profile.layers
    if atoms is None:
        atoms = atom_table(profile, cluster, training, cand.tp, cand.micro_batch, cpu_factor, cand.sequence_parallel,
                           cand.tp_overlap, cand.cp, cand.ep, cand.ep_overlap)
    elif not isinstance(atoms, AtomTable):
        atoms = AtomTable(atoms)
    w, g, o = training.bytes_per_param()
    atom_working, max_params, cut_bytes = atoms.memo("largest", lambda: (
        # backward's working set: an atom's activation gradients and, recomputed, its activations
        # again (two copies); the last atom is never recomputed, and the loss's own is measured
        max([2 * a.act_bytes[NONE] for a in atoms[:-1]]
            + [(1 if profile.loss_working_bytes is not None else 2) * atoms[-1].act_bytes[NONE]]),
        sorted((a.params for a in atoms), reverse=True)[:2],
        max((a.out_bytes for a in atoms if a.cut_ok), default=0.0),
    ))
    on_gpu = cluster.gpu.origin != "measured"
    ranks, zero, shard = cand.grad_ranks, cand.zero, cand.dp_shard
    grads_per_rank = atoms.param_totals[0] / cand.pp * g  # a model smaller than a bucket
    # refit from this cluster's runs (1 without): all traffic, and ZeRO-2/3's every micro-batch
    comm_factor, zero_factor = cluster.gpu.factor("comm"), cluster.gpu.factor("zero_comm")
    copy_s = memory_bound_s(1.0, cluster.gpu)
    dense = _dp_traffic(cand, shard, ranks, lk, w, g, (comm_factor, zero_factor), hsdp=True, copy_s_per_byte=copy_s,
                        hbm_Bps=cluster.gpu.hbm_bandwidth_Bps, zero1_rs=training.zero1_reduce_scatter)
    in_pipeline = pipelined_fsdp(cand)
    measured = cluster.gpu.optimizer_s_per_param(cluster.num_gpus, training.optimizer)  # plan calibrate's
    optimizer_s = measured if measured is not None else memory_bound_s(training.optimizer_traffic_per_param(), cluster.gpu)
    optimizer_s *= cluster.gpu.factor("optimizer")
    experts = {}
    if cand.ep > 1:
        # the experts' own group: the dp x cp x tp / ep ranks that hold the same experts (an owner's
        # gradients already sum every tp rank's tokens of its group; the router's tp sum, a few
        # parameters, is not counted)
        replicas = cand.expert_replicas
        expert_lk = replace(lk, dp=lk.expert_dp) if lk.expert_dp is not None else lk
        ex = _dp_traffic(cand, replicas, replicas, expert_lk, w, g, (comm_factor, zero_factor), hsdp=False, copy_s_per_byte=copy_s,
                         zero1_rs=training.zero1_reduce_scatter)
        experts = dict(
            expert_state_bytes=_sharded_state(cand, replicas, w, g, o),
            expert_mb_comm_param_s=ex.per_param,
            expert_grad_sync_per_byte_s=ex.grad_sync.per_byte_s,
            expert_after_step_param_s=ex.after_step_param_s + optimizer_s / (replicas if zero >= 1 else 1),
        )
    model_flops = atoms.memo("flops", lambda: sum(l.fwd_flops + l.bwd_flops for l in layers)) * training.global_batch / profile.batch_size
    first_atoms = 1
    if cand.pp > 1 and not profile.tracer_splits(cand.tp):
        def first() -> int:
            start = profile.plain_from()
            return next((k + 1 for k, a in enumerate(atoms) if a.last >= start), len(atoms))

        first_atoms = atoms.memo("first_atoms", first)
    return StageCosts(
        cand=cand,
        atoms=atoms,
        inflight_stage=inflight_per_stage(cand),
        weight_bytes=w,
        grad_bytes=g,
        optim_bytes=o,
        # a block's backward (with its context-parallel ring) and the loss's do not run at once
        working_bytes=max(atom_working + _ring_working_bytes(profile, cand, training),
                          loss_working_bytes(profile, cand.tp, cand.micro_batch, cand.cp,
                                             fused_loss(profile, training, cand.tp), _loss_gradients(training))),
        zero3_gather_bytes=sum(max_params) * w if cand.zero == 3 and not in_pipeline else 0.0,
        grads_freed=(cand.num_microbatches == 1 and cand.pp == 1 and training.trainer != "megatron"
                     and (zero >= 2 or ranks == 1)),
        reserve_fixed_bytes=RESERVE_GPU_BYTES if on_gpu else RESERVE_CPU_BYTES,
        fragmentation=(training.fragmentation if training.fragmentation is not None
                       else FRAGMENTATION_GPU if on_gpu else FRAGMENTATION_CPU),
        limit_bytes=training.memory_limit_bytes,
        p2p_s=_exposed_sends(atoms, training, cand, 2 * comm.p2p(lk.pp)(cut_bytes) * comm_factor) if cand.pp > 1 else 0.0,
        min_first_atoms=first_atoms,
        mb_comm_atom_s=dense.per_atom,
        mb_comm_param_s=dense.per_param,
        grad_sync=dense.grad_sync,
        tail_s=dense.sync_or_reduce(min(DDP_BUCKET_BYTES, grads_per_rank)) if ranks > 1 else 0.0,
        after_step_param_s=dense.after_step_param_s,
        after_step_atom_s=dense.after_step_atom_s,
        optimizer_s_per_param=optimizer_s / (shard if cand.zero >= 1 else 1),
        links=lk,
        model_flops_per_step=model_flops,
        dp_overlap=training.dp_overlap,
        dp_load=dense.load,
        **experts,
    )


@dataclass(frozen=True)
class _DPTraffic:
    grad_sync: comm.Affine
    sync_or_reduce: comm.Affine
    """The gradient collective of a DDP bucket (all-reduce) or of ZeRO-2/3 (reduce-scatter)."""
    per_atom: float
    per_param: float
    after_step_param_s: float
    after_step_atom_s: float
    load: float = 0.0
    """What the traffic takes from compute beside it (comm.link_load): its links' loads, each
    weighted by the time the traffic spends on it (HSDP: the shard group's NVLink ring and the
    replicas' all-reduce over the network, whose few bytes a second barely touch HBM)."""


def _dp_traffic(cand: Candidate, shard: int, ranks: int, lk: Links, w: int, g: int, factors: tuple[float, float],
                hsdp: bool, copy_s_per_byte: float = 0.0, hbm_Bps: float = 0.0, zero1_rs: bool = False) -> _DPTraffic:
    """The data-parallel collectives (StageCosts: mb_comm_*, grad_sync, after_step_*) of
    parameters sharded by ZeRO over `shard` ranks of the `ranks` that average their gradients
    (HSDP: replicas of the shard groups, when `hsdp`). `factors`: the cluster's refit factors
    (GPUSpec.phase_factors) of its traffic ("comm") and of ZeRO-2/3's every micro-batch ("zero_comm").
    `zero1_rs`: ZeRO-1 reduce-scatters the gradients (Training.zero1_reduce_scatter), else all-reduces them.

    ZeRO-2/3 (FSDP2) also copy what they gather and reduce, a memory-bound pass each
    (`copy_s_per_byte`: seconds per byte read or written): an all-gather copies the rank's shard
    into the collective's buffer and the gathered buffer out into the layer's parameters
    (torch.distributed.fsdp: foreach_all_gather, foreach_all_gather_copy_out), a reduce-scatter
    the layer's gradients into its buffer and the reduced shard out (foreach_reduce). On a CPU
    these are a tenth of a ZeRO-3 step with 4 micro-batches (examples/gpt.py, 2 processes:
    aten::copy_ 0.22 s of 2.3 s in a torch.profiler trace); on an H100, about half a millisecond
    per micro-batch for a layer of a 70B model at tp 8."""
    zero = cand.zero
    # per parameter, read and written, in and out; none where the group is one rank (as its
    # collectives: HSDP with tp filling a node shards over 1 rank)
    copy = copy_s_per_byte if shard > 1 else 0.0
    gather_copy, reduce_copy = copy * 2 * (w / shard + w), copy * 2 * (g + g / shard)
    ag, rs = comm.allgather(shard, lk.dp), comm.reduce_scatter(shard, lk.dp)
    load = comm.link_load(lk.dp, hbm_Bps)
    if hsdp and lk.dp_replicate is not None:
        # HSDP: each shard group's reduce-scatter, then the replicas all-reduce their 1/shard
        ar = comm.allreduce(cand.dp_replicate, lk.dp_replicate)
        inner = (2 * ag.per_byte_s * w if zero == 3 else 0.0) + rs.per_byte_s * g  # a parameter's, every micro-batch
        outer = ar.per_byte_s / shard * g
        if inner + outer > 0:
            load = (inner * load + outer * comm.link_load(lk.dp_replicate, hbm_Bps)) / (inner + outer)
        rs = comm.Affine(rs.fixed_s + ar.fixed_s, rs.per_byte_s + ar.per_byte_s / shard)
    comm_factor, zero_factor = factors
    bare_ag, bare_rs = ag, rs
    ag, rs = ag.scaled(comm_factor), rs.scaled(comm_factor)
    rs_or_ar = comm.allreduce(ranks, lk.dp).scaled(comm_factor) if zero == 0 or zero == 1 and not zero1_rs else rs
    grad_sync = rs_or_ar if zero <= 1 and ranks > 1 else comm.NONE
    per_atom = per_param = 0.0
    in_pipeline = pipelined_fsdp(cand)
    if in_pipeline:
        # Once per step: the first forward gathers the stage's weights, the last backward
        # reduce-scatters its gradients (an all-reduce's volume), overlapped like DDP's sync.
        # ZeRO-3 also frees the weights after each forward, so each backward gathers them again.
        grad_sync = comm.Affine(ag.fixed_s + rs.fixed_s,
                                (ag.per_byte_s * w + gather_copy + reduce_copy) / g + rs.per_byte_s)
        if zero == 3:
            per_atom, per_param = ag.fixed_s, ag.per_byte_s * w + gather_copy
    elif zero == 3 and ranks > 1:
        per_atom = (2 * bare_ag.fixed_s + bare_rs.fixed_s) * zero_factor
        per_param = (2 * (bare_ag.per_byte_s * w + gather_copy) + bare_rs.per_byte_s * g + reduce_copy) * zero_factor
    elif zero == 2 and ranks > 1:
        per_atom, per_param = bare_rs.fixed_s * zero_factor, (bare_rs.per_byte_s * g + reduce_copy) * zero_factor
    after = zero in (1, 2) and not in_pipeline
    return _DPTraffic(grad_sync, rs_or_ar, per_atom, per_param, ag.per_byte_s * w if after else 0.0,
                      ag.fixed_s if after else 0.0, load)

