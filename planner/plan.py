"""Plan: the search's output and the runtime's input. Versioned JSON (schema planner.Plan)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from planner import schema
from planner.profile.types import ModelProfile, TPInfo, TPRole


@dataclass(frozen=True)
class Parallel:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    num_microbatches: int
    zero: int
    """0: DDP; 1: optimizer state sharded (FSDP2 would shard more: see README); 2: + gradients;
    3: + parameters (FSDP2 fully_shard)."""
    schedule: str
    """gpipe | 1f1b | interleaved (ignored when pp == 1)."""
    virtual_stages: int
    recompute: str
    """none | selective | alternate | full | mixed (per layer: see stages[].recompute_layers,
    selective_layers, alternate_layers)."""
    sequence_parallel: bool
    tp_overlap: bool = False
    """TP collectives overlapped with the GEMMs (a trainer's feature the runtime lacks: plan run refuses)."""
    ep_overlap: bool = False
    """Expert all-to-alls beside another micro-batch's compute (Megatron-Core's combined 1F1B,
    DeepSeek's DualPipe: a trainer's feature the runtime lacks: plan run refuses)."""
    dp_replicate: int = 1
    """HSDP (ZeRO-2/3): dp ranks in dp_replicate groups of dp / dp_replicate (one node's); FSDP
    shards inside a group and the groups are replicas (FSDP2 on a 2-D mesh). 1: no HSDP."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (ranks tp fastest, then cp, dp, pp),
    attention as a ring (torch's context_parallel); gradients averaged and ZeRO sharded over
    dp x cp. 1: none."""
    ep: int = 1
    """Expert parallelism (mixture-of-experts models): each MoE block's experts split over ep
    consecutive ranks of a pipeline stage, cp and tp ranks included (ep divides dp x cp x tp),
    tokens sent to the experts they chose and back with two all-to-alls; the experts' gradients are
    averaged over the dp x cp x tp / ep ranks that hold the same experts. With tp > 1 (and sequence
    parallelism, which it needs) the MoE blocks are not split by TP: each tp rank routes its own
    sequence shard, as each cp rank routes its own. 1: none."""

    @property
    def world_size(self) -> int:
        """The ranks the plan runs on: dp x tp x pp x cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stage_ranks(self) -> int:
        """The consecutive ranks of one pipeline stage: dp x cp x tp (an EP group is ep of them)."""
        return self.dp * self.cp * self.tp

    def one_line(self) -> str:
        sched = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": f"interleaved 1F1B x{self.virtual_stages}"}
        parts = [
            f"dp={self.dp} tp={self.tp} pp={self.pp}" + (f" cp={self.cp}" if self.cp > 1 else "")
            + (f" ep={self.ep}" if self.ep > 1 else ""),
            f"micro-batch {self.micro_batch} x {self.num_microbatches}",
        ]
        if self.pp > 1:
            parts.append(sched[self.schedule])
        if self.tp > 1:
            parts.append("sequence parallel" if self.sequence_parallel else "no sequence parallel")
            if self.tp_overlap:
                parts.append("TP overlap")
        if self.ep_overlap and self.ep > 1:
            parts.append("EP overlap")
        parts.append(f"ZeRO-{self.zero}" + (f" HSDP {self.dp_replicate} x {self.dp // self.dp_replicate}" if self.dp_replicate > 1 else ""))
        parts.append(f"recompute: {self.recompute}")
        return " · ".join(parts)


@dataclass(frozen=True)
class MemoryBytes:
    weights: int
    grads: int
    optimizer: int
    activations: int
    reserve: int
    total: int


@dataclass(frozen=True)
class Stage:
    """One pipeline rank: its layers (in chunks when interleaved) and what it costs."""

    rank: int
    layers: tuple[str, ...]
    chunks: tuple[tuple[str, ...], ...]
    recompute_layers: tuple[str, ...]
    """Layers recomputed in full (torch.utils.checkpoint)."""
    selective_layers: tuple[str, ...]
    """Layers with selective recompute (matmul outputs kept, the rest recomputed)."""
    memory_bytes: MemoryBytes
    time_per_microbatch_s: float
    alternate_layers: tuple[str, ...] = ()
    """Layers with the alternate policy (every other Linear matmul's output kept, as torchtitan's
    per-op selective checkpointing; the rest recomputed)."""


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    samples_per_s: float
    tokens_per_s: Optional[float]
    model_tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: int
    bubble_s: float
    breakdown_s: dict[str, float]
    """Where the bottleneck rank's step goes: compute, recompute, tp_comm, cp_comm, ep_comm, pp_comm, dp_comm,
    optimizer, bubble."""
    fragmentation: Optional[float] = None
    """The allocator's fragmentation counted in peak_memory_bytes (a share of what the tensors
    need); 0.0 for a tight plan, which fits only without it (SearchResult.tight); None in a plan
    from before the field."""
    phase_factors: dict[str, float] = field(default_factory=dict)
    """The calibration's phase factors these figures include (plan calibrate --from-run: compute,
    comm, optimizer), so that a refit from this plan's runs can take them out again; {} when none."""


@dataclass(frozen=True)
class ClusterInfo:
    gpu: str
    display_name: str
    num_gpus: int
    gpus_per_node: int
    memory_limit_bytes: int
    peak_flops: float
    """Dense peak FLOP/s per GPU at the plan's precision (the MFU denominator)."""


@dataclass(frozen=True)
class PlanLayer:
    """One layer as the runtime shards it: what the profiler found (the runtime re-derives nothing)."""

    name: str
    """The layer's main module (``blocks.3``)."""
    tp: Optional[TPInfo] = None
    """Its tensor-parallel plan (column-/row-wise Linear names relative to the layer), or None."""
    role: Optional[TPRole] = None
    """What else tensor parallelism does to it (vocabulary-parallel embedding or head, sequence
    parallelism: planner.profile.tp_roles); None when unknown (its Linear pairs only)."""
    plain_cut: bool = False
    """A pipeline cut after this layer, and after every later one, hands over this layer's output
    alone (ModelProfile.plain_from): stages from there on run their layers one after another,
    without the pipelining tracer."""


def plan_layers(profile: ModelProfile) -> tuple[PlanLayer, ...]:
    """A profile's layers as a plan carries them."""
    start = profile.plain_from()
    return tuple(PlanLayer(layer.name, layer.tp, layer.tp_role, layer.index >= start and layer.index < len(profile.layers) - 1)
                 for layer in profile.layers)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    source_sha256: str
    num_params: int
    seq_len: Optional[int]
    layer_names: tuple[str, ...]
    layers: tuple[PlanLayer, ...]
    """Every layer, in order (the names of layer_names), with its TP split and role."""
    pipeline_split: str = "sequential"
    """The profile's: "traced" when the pipelining tracer can split the model at every valid cut
    (the runtime uses it for a first cut before the layers' plain_cut), else "sequential" or "none"."""
    pipeline_split_note: Optional[str] = None
    """Why the tracer could not split the model."""
    cp_blocker: Optional[str] = None
    """The profile's: why context parallelism cannot run on this model ("" when it can; None when
    unknown). The runtime refuses a plan with cp > 1 unless it is ""."""


@dataclass(frozen=True)
class TrainingInfo:
    precision: str
    optimizer: str
    global_batch: int
    trainer: str = "this"
    """The trainer the plan was made for (plan --trainer; planner.cost.setup.TRAINERS)."""
    compile: bool = False
    """It runs the model and its loss under torch.compile (plan --compile)."""
    ep_dispatch: str = "all_to_all"
    """How the expert-parallel tokens cross nodes (plan --ep-dispatch; Training.ep_dispatch)."""
    expert_node_limit: Optional[int] = None
    """The most nodes a token's experts come from (plan --expert-node-limit; Training.expert_node_limit)."""


@dataclass(frozen=True)
class SolverInfo:
    status: str
    seconds: float
    candidates: int
    pruned: int
    ilps_solved: int
    skipped: dict[str, int] = field(default_factory=dict)
    """Configurations left out before costing, by reason (e.g. "tp=4 does not divide the heads or
    features"): what a user who expected one of them should read."""


@dataclass(frozen=True)
class Alternative:
    plan: str
    step_time_s: float
    peak_memory_bytes: int
    fits: bool
    note: str = ""


@dataclass(frozen=True)
class Plan(schema.Versioned):
    SCHEMA = "planner.Plan"
    VERSION = 2
    OLDEST = 2
    """Version 1 plans lack model.layers (the runtime profiled the model again): re-plan."""

    parallel: Parallel
    stages: tuple[Stage, ...]
    predicted: Predicted
    cluster: ClusterInfo
    model: ModelInfo
    training: TrainingInfo
    solver: SolverInfo
    binding: str
    """What limits this plan, in words."""
    explanation: tuple[str, ...]
    alternatives: tuple[Alternative, ...]
    data_parallel: Optional[Alternative]
    """Plain data parallelism on the same cluster, for comparison (fits=False: it does not fit)."""
    assumptions: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    schema: str = field(default="planner.Plan")
    version: int = field(default=2)
