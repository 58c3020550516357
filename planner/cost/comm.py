"""Collective and point-to-point times: the alpha-beta model.

A collective over n ranks costs latency * ceil(log2 n) (tree-like startup, as NCCL's double
binary trees) plus its bus volume over the link's achievable bandwidth (ring algorithms:
all-reduce moves 2(n-1)/n of the buffer per rank, all-gather and reduce-scatter (n-1)/n of the
gathered size). Thakur, Rabenseifner & Gropp 2005; NCCL's nccl-tests "bus bandwidth" definition.
All-gather and reduce-scatter have no tree in NCCL: their ring's n - 1 steps each add a step
latency (`Link.ring_step_s`), which at hundreds of ranks outweighs the startup (NCCL's own
tuning model, src/graph/tuning.cc: (n - nodes) NVLink steps + (nodes - 1) network steps).
Each cost is affine in the bytes (`Affine`), so the ILP can use it as a linear expression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cost.constants import LINK_EFFICIENCY, OVERLAP_CONTENTION


@dataclass(frozen=True)
class Link:
    """The link a group's traffic crosses: per-GPU per-direction bandwidth and latency."""

    bandwidth_Bps: float
    latency_s: float
    ring_step_s: float = 0.0
    """Mean latency one step of a ring over the group adds (GPU links: `ring_step_s`)."""
    measured: tuple[tuple[str, float, float], ...] = ()
    """(kind, latency s, bus bandwidth B/s) that `plan calibrate` measured for this group's size:
    all_reduce, all_gather, reduce_scatter, all_to_all, p2p; each costs exactly that (no efficiency applied)."""

    def fitted(self, kind: str, volume: float) -> "Affine | None":
        for k, latency, busbw in self.measured:
            if k == kind:
                return Affine(latency, volume / busbw)
        return None


@dataclass(frozen=True)
class Affine:
    """seconds = fixed_s + per_byte_s * bytes."""

    fixed_s: float
    per_byte_s: float

    def __call__(self, nbytes: float) -> float:
        return self.fixed_s + self.per_byte_s * nbytes

    def scaled(self, factor: float) -> "Affine":
        return self if factor == 1.0 else Affine(self.fixed_s * factor, self.per_byte_s * factor)


NONE = Affine(0.0, 0.0)


# NCCL's latency per ring step, Simple protocol (large messages), from its tuning model
# (NVIDIA/nccl src/graph/tuning.cc, hwLat[NVLINK|NET][RING][SIMPLE]).
RING_STEP_NVLINK_S = 3.4e-6
RING_STEP_NET_S = 9.6e-6


def ring_step_s(n: int, nodes: int) -> float:
    """Mean latency of one of a ring's n - 1 steps over n GPUs in `nodes` nodes: n - nodes steps
    inside a node, nodes - 1 across."""
    if n <= 1:
        return 0.0
    return ((n - nodes) * RING_STEP_NVLINK_S + (nodes - 1) * RING_STEP_NET_S) / (n - 1)


def _coef(volume: float, n: int, link: Link, ring_steps: int = 0) -> Affine:
    if n <= 1:
        return NONE
    startup = link.latency_s * math.ceil(math.log2(n)) + ring_steps * link.ring_step_s
    return Affine(startup, volume / (link.bandwidth_Bps * LINK_EFFICIENCY))


def allreduce(n: int, link: Link) -> Affine:
    if n <= 1:
        return NONE
    return link.fitted("all_reduce", 2 * (n - 1) / n) or _coef(2 * (n - 1) / n, n, link)


def allgather(n: int, link: Link) -> Affine:
    """Applied to the size of the gathered (full) buffer."""
    if n <= 1:
        return NONE
    return link.fitted("all_gather", (n - 1) / n) or _coef((n - 1) / n, n, link, ring_steps=n - 1)


def reduce_scatter(n: int, link: Link) -> Affine:
    """Applied to the size of the whole (input) buffer; as all-gather unless measured."""
    if n <= 1:
        return NONE
    return link.fitted("reduce_scatter", (n - 1) / n) or _coef((n - 1) / n, n, link, ring_steps=n - 1)


def all_to_all(n: int, link: Link) -> Affine:
    """Applied to the bytes each rank holds before the exchange ((n - 1) / n of them leave it)."""
    if n <= 1:
        return NONE
    return link.fitted("all_to_all", (n - 1) / n) or _coef((n - 1) / n, n, link)


def p2p(link: Link) -> Affine:
    # measured: a message each way, one after the other (2 x the bytes); one message is half
    fitted = link.fitted("p2p", 2.0)
    if fitted is not None:
        return Affine(fitted.fixed_s / 2, fitted.per_byte_s / 2)
    return Affine(link.latency_s, 1 / (link.bandwidth_Bps * LINK_EFFICIENCY))


def link_load(link: Link, hbm_Bps: float) -> float:
    """The rate `link` moves a GPU's bytes at against its HBM bandwidth: what its collectives take
    from compute beside them (overlap_share)."""
    return link.bandwidth_Bps / hbm_Bps if hbm_Bps > 0 else 0.0


def overlap_share(e: float | None = None, load: float = 0.0) -> float:
    """The share of the shorter of two overlapped activities that the overlap hides: the
    trainer's own (Training.dp_overlap) when given, else what the collective's contention leaves,
    1 - OVERLAP_CONTENTION x `load` (link_load: its link's bandwidth over the GPU's HBM
    bandwidth), at least 0; the constant read at the call (bench_published --fit varies it)."""
    return max(0.0, 1.0 - OVERLAP_CONTENTION * load) if e is None else e


def overlapped_s(a_s: float, b_s: float, e: float) -> float:
    """Two activities run at once (compute and a collective): the longer, plus the share of the
    shorter that contention leaves exposed (1 - e, e from overlap_share). Equals
    max(a + (1 - e) b, b + (1 - e) a), which the ILP states as two linear rows."""
    return max(a_s, b_s) + (1 - e) * min(a_s, b_s)


def exposed_after_s(window_s: float, comm_s: float, e: float) -> float:
    """Of a collective overlapped with `window_s` of compute, the seconds it adds past the window:
    max(comm - e window, (1 - e) comm)."""
    return overlapped_s(window_s, comm_s, e) - window_s
