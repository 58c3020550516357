"""The discrete search space and the bounds that prune it before any ILP is solved.

Candidates: tp x pp x dp = GPUs, tp a degree every tensor-parallel block accepts (head counts,
feature sizes) and at most a node (TP's all-reduces want NVLink: Narayanan et al. 2021, Sec. 3.2;
a user may force more), pp at most the number of atoms, micro-batch b a power of two dividing
the per-replica batch, m = global batch / (dp b) micro-batches, ZeRO 0-3 (0 only without data
parallelism), and the schedule (GPipe, 1F1B, interleaved 1F1B with v = 2-4 chunks when m % pp == 0,
as Megatron-LM requires).

Bounds, per candidate, from the cost tables alone:
- memory: the least any rank can hold (its share of the parameter state with perfect balance,
  and the activations of one micro-batch with full recompute) plus the reserve; above the limit,
  no partition fits;
- time: perfectly balanced stages without recompute and no exposed sync. Candidates are solved in
  order of this bound, and the search stops when the bound exceeds the K-th best plan found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from planner.cost.constants import FRAGMENTATION
from planner.cost.pipeline import pipeline_s
from planner.cost.setup import Candidate
from planner.cost.stage_costs import FULL, NONE, StageCosts
from planner.profile.types import ModelProfile


@dataclass(frozen=True)
class Fixed:
    """Choices the user fixed (None: the search chooses)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    zero: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None


# Model chunks per rank tried for interleaved 1F1B: the published Megatron-LM runs use 2-3
# (published_runs.yaml: 3-5 layers per virtual stage); more multiplies the pipeline sends.
INTERLEAVE = (2, 3, 4)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def legal_tp(profile: ModelProfile, tp: int) -> bool:
    """Every layer that TP must split accepts the degree (vocab-parallel ones may replicate)."""
    return all(l.tp is None or not l.tp.required or l.tp.legal(tp) for l in profile.layers)


def max_useful_tp(profile: ModelProfile) -> int:
    return 1 if all(l.tp is None or not l.tp.required for l in profile.layers) else 1 << 30


@dataclass
class SpaceStats:
    enumerated: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


def candidates(
    profile: ModelProfile,
    num_gpus: int,
    gpus_per_node: int,
    num_atoms: int,
    global_batch: int,
    fixed: Fixed,
    stats: SpaceStats,
) -> Iterator[Candidate]:
    for tp in divisors(num_gpus):
        if fixed.tp is not None and tp != fixed.tp:
            continue
        if fixed.tp is None and (tp > gpus_per_node or tp > max_useful_tp(profile)):
            continue
        if tp > 1 and not legal_tp(profile, tp):
            stats.reject(f"tp={tp} does not divide the heads or features")
            continue
        for pp in divisors(num_gpus // tp):
            if fixed.pp is not None and pp != fixed.pp:
                continue
            if pp > num_atoms:
                continue
            dp = num_gpus // (tp * pp)
            if fixed.dp is not None and dp != fixed.dp:
                continue
            if global_batch % dp:
                stats.reject(f"global batch not divisible by dp={dp}")
                continue
            per_replica = global_batch // dp
            b = 1
            while b <= per_replica:
                if per_replica % b == 0 and (fixed.micro_batch is None or b == fixed.micro_batch):
                    yield from _schedules(tp, pp, dp, b, per_replica // b, num_atoms, fixed, stats)
                b *= 2
            if fixed.micro_batch is not None and (fixed.micro_batch & (fixed.micro_batch - 1)):
                if per_replica % fixed.micro_batch == 0:  # a non-power-of-two the user asked for
                    yield from _schedules(tp, pp, dp, fixed.micro_batch, per_replica // fixed.micro_batch, num_atoms, fixed, stats)


def _schedules(tp, pp, dp, b, m, num_atoms, fixed: Fixed, stats: SpaceStats) -> Iterator[Candidate]:
    zeros = [0] if dp == 1 else [0, 1, 2, 3]
    for zero in zeros:
        if fixed.zero is not None and zero != fixed.zero:
            continue
        if pp == 1:
            stats.enumerated += 1
            yield Candidate(tp, pp, dp, b, m, zero, fixed.schedule or "1f1b", 1)
            continue
        for schedule in ("1f1b", "gpipe", "interleaved"):
            if fixed.schedule is not None and schedule != fixed.schedule:
                continue
            if schedule != "interleaved":
                stats.enumerated += 1
                yield Candidate(tp, pp, dp, b, m, zero, schedule, 1)
                continue
            if m % pp:
                stats.reject("interleaving needs micro-batches divisible by pp")
                continue
            for v in [fixed.virtual_stages] if fixed.virtual_stages else INTERLEAVE:
                if pp * v <= num_atoms:
                    stats.enumerated += 1
                    yield Candidate(tp, pp, dp, b, m, zero, schedule, v)


def memory_lower_bound(costs: StageCosts) -> float:
    """Bytes on the least-loaded rank of the best imaginable partition."""
    cand = costs.cand
    params = sum(a.params for a in costs.atoms) / cand.pp
    dp, zero = cand.dp, cand.zero
    state = params * (
        costs.weight_bytes / (dp if zero >= 3 else 1)
        + costs.grad_bytes / (dp if zero >= 2 else 1)
        + costs.optim_bytes / (dp if zero >= 1 else 1)
    )
    act = min(costs.inflight) * sum(a.act_bytes[FULL] for a in costs.atoms) / cand.pp
    held = state + act + costs.working_bytes + costs.zero3_gather_bytes
    return (1 + FRAGMENTATION) * held + costs.reserve_fixed_bytes


def time_lower_bound(costs: StageCosts) -> float:
    cand = costs.cand
    total = sum(a.fwd_s + a.bwd_s + a.extra_s[NONE] for a in costs.atoms) / cand.pp
    per_stage = total + costs.p2p_s * (cand.num_stages // cand.pp)
    params = sum(a.params for a in costs.atoms) / cand.pp
    return pipeline_s([per_stage] * cand.pp, cand) + costs.optimizer_s_per_param * params
