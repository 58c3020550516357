"""Pipeline schedules: activations in flight per rank, and the step time from stage times.

With p ranks, m micro-batches and per-micro-batch stage times T_i (forward + backward):
- GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021) both take
  (m - 1) * max(T) + sum(T): with balanced stages (m + p - 1) * T, a bubble of (p-1)/(m+p-1).
  GPipe holds all m micro-batches' activations; 1F1B holds p - i on rank i (at most m).
- Interleaved 1F1B with v chunks per rank (Narayanan et al. 2021, Sec. 2.2): the fill and drain
  shrink by v: m * max(T) + (sum(T) - max(T)) / v, i.e. a bubble of (p-1)/v stage times, at the
  price of v times the pipeline sends. Rank i holds 2(p-i-1) + (v-1)p + 1 chunk-micro-batches at
  peak (Megatron-LM's warm-up count plus the one in flight), each 1/v of its layers: on rank 0
  that is (1 + (p-1)/(pv)) x the 1F1B figure, as Korthikanti et al. 2022 Sec. 4.2.3 state; its
  first chunks hold more of them than its last (inflight_per_stage).
"""

from __future__ import annotations

import functools

from planner.cost.setup import Candidate


def interleaved_rounds(num_microbatches: int, pp: int) -> int:
    """The rounds torch's ScheduleInterleaved1F1B runs m micro-batches in (m // pp, at least one);
    it takes m only in equal rounds."""
    return max(1, num_microbatches // pp)


def inflight_per_stage(cand: Candidate) -> tuple[float, ...]:
    """Micro-batches of each stage's activations held at the peak of the schedule (stage s on
    rank s % pp). Interleaved 1F1B runs its forwards a round of micro-batches per chunk (torch's
    ScheduleInterleaved1F1B and Megatron-LM alike: m / rounds of them, then the next chunk), so
    rank i's 2(p-i-1) + (v-1)p + 1 in flight at the end of its warm-up fill its first chunks
    whole and its last ones least: the last rank holds one micro-batch of its last chunk (the
    model's head and loss), as its backward follows each forward at once."""
    return _inflight(cand.schedule, cand.pp, cand.num_microbatches, cand.virtual_stages, cand.num_stages)


@functools.lru_cache(maxsize=4096)
def _inflight(schedule: str, p: int, m: int, v: int, num_stages: int) -> tuple[float, ...]:
    """inflight_per_stage, once per schedule (the search asks for it for thousands of candidates)."""
    if p == 1:
        return (1.0,) * num_stages
    if schedule == "gpipe":
        return tuple(float(m) for _ in range(num_stages))
    if schedule == "1f1b" or v == 1:
        return tuple(float(min(m, p - i)) for i in range(p))
    group = m // interleaved_rounds(m, p)
    out = [0.0] * num_stages
    for i in range(p):
        for k in range(min(m * v, 2 * (p - i - 1) + (v - 1) * p + 1)):
            out[((k // group) % v) * p + i] += 1.0
    # a chunk the warm-up does not reach still holds a micro-batch between its forward and backward
    return tuple(max(1.0, x) for x in out)


def pipeline_s(stage_s: list[float], cand: Candidate) -> float:
    """Time for all micro-batches to pass forward and backward through the pipeline."""
    m, v = cand.num_microbatches, cand.virtual_stages if cand.schedule == "interleaved" else 1
    slowest = max(stage_s)
    return m * slowest + (sum(stage_s) - slowest) / v

