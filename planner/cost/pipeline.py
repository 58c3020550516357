"""Pipeline schedules: activations in flight per rank, and the step time from stage times.

With p ranks, m micro-batches and per-micro-batch stage times T_i (forward + backward):
- GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021) both take
  (m - 1) * max(T) + sum(T): with balanced stages (m + p - 1) * T, a bubble of (p-1)/(m+p-1).
  GPipe holds all m micro-batches' activations; 1F1B holds p - i on rank i (at most m).
- Interleaved 1F1B with v chunks per rank (Narayanan et al. 2021, Sec. 2.2): the fill and drain
  shrink by v: m * max(T) + (sum(T) - max(T)) / v, i.e. a bubble of (p-1)/v stage times, at the
  price of v times the pipeline sends. Rank i holds 2(p-i-1) + (v-1)p + 1 chunk-micro-batches at
  peak (Megatron-LM's warm-up count plus the one in flight), each 1/v of its layers: on rank 0
  that is (1 + (p-1)/(pv)) x the 1F1B figure, as Korthikanti et al. 2022 Sec. 4.2.3 state.
"""

from __future__ import annotations

from planner.cost.setup import Candidate


def interleaved_rounds(num_microbatches: int, pp: int) -> int:
    """The rounds torch's ScheduleInterleaved1F1B runs m micro-batches in (m // pp, at least one);
    it takes m only in equal rounds."""
    return max(1, num_microbatches // pp)


def inflight_per_device(cand: Candidate) -> tuple[float, ...]:
    """Micro-batches' worth of each rank's activations held at the peak of the schedule."""
    p, m, v = cand.pp, cand.num_microbatches, cand.virtual_stages
    if p == 1:
        return (1.0,)
    if cand.schedule == "gpipe":
        return tuple(float(m) for _ in range(p))
    if cand.schedule == "1f1b" or v == 1:
        return tuple(float(min(m, p - i)) for i in range(p))
    return tuple(min(m * v, 2 * (p - i - 1) + (v - 1) * p + 1) / v for i in range(p))


def pipeline_s(stage_s: list[float], cand: Candidate) -> float:
    """Time for all micro-batches to pass forward and backward through the pipeline."""
    m, v = cand.num_microbatches, cand.virtual_stages if cand.schedule == "interleaved" else 1
    slowest = max(stage_s)
    return m * slowest + (sum(stage_s) - slowest) / v

