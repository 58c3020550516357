"""`plan whatif`: the same planner over a grid of GPU types x GPU counts, and what follows from it.

Every point is `planning.make_plan` with a `PlanRequest` (what `plan MODEL.py --gpus N --gpu G`
runs), on ONE profile made up front with `planning.profile_for` in the sweep's precision. Fit
checks beyond the grid (the minimum GPUs, the headroom) call `planning.search` with a
`PlanRequest` on the same profile, as `make_plan` does.

Derived answers:
- time to train: with --tokens T, steps = ceil(T / (global batch x sequence length)); with
  --steps S, S steps; days = steps x step time / 86400; GPU-hours = days x 24 x GPUs; cost =
  GPU-hours x the price per GPU-hour;
- scaling efficiency of a point: (its samples/s / the smallest fitting count's) / (its GPUs / that
  count's): 100% is linear scaling;
- the minimum GPUs of a type: the smallest fitting count of the sweep, then halved while it still
  fits (down to 1); when no swept count fits, doubled beyond the largest up to 16,384;
- cheapest: the lowest cost (with --price), else the fewest GPU-hours (with --tokens/--steps),
  else the fewest GPU-seconds per sample; fastest: the fewest days, else the most samples/s; the
  deadline pick: the cheapest of those that finish within --deadline-days.

Headroom, for a single cluster (one type, one count), with the plan's global batch unless said:
- memory: the limit less the plan's fullest GPU;
- the largest micro-batch: doubled (`plan --micro-batch b`, global batch GPUs x b) until nothing
  fits; the largest global batch: doubled (free search) until nothing fits, up to 16x the plan's
  (with 1F1B, more micro-batches per step cost no memory, so it often has no limit);
- model and sequence: the largest factor k (bracketed from the memory ratio by doubling, then 5 bisection steps: about 2%) at which
  a scaled copy of the profile still fits. Model x k multiplies every layer's parameters, FLOPs,
  saved activations and memory traffic by k: in memory, k times as many layers of the same shape
  (a wider model, whose parameters grow faster than its activations, would fit a little more).
  Sequence x k multiplies activations, the tensors between layers, TP all-reduces and FLOPs by k
  and leaves parameters alone (attention's quadratic FLOPs are not modelled; flash attention keeps
  its memory linear).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

from planner import planning
from planner.cost import constants
from planner.errors import BadInput, Infeasible
from planner.hardware import GPUSpec, get_gpu
from planner.model_file import ModelHandle
from planner.plan import Plan
from planner.planning import PlanRequest
from planner.profile.types import ModelProfile
from planner.report.units import fmt_bytes, fmt_count

if TYPE_CHECKING:
    from planner.report.headroom import Headroom

MAX_GPUS = 16384


@dataclass(frozen=True)
class SweepSpec:
    """What the user asked: the grid, the training length, the prices."""

    gpu_types: tuple[str, ...]
    gpu_counts: tuple[int, ...]
    global_batch: Optional[int] = None
    tokens: Optional[float] = None
    steps: Optional[int] = None
    prices_per_gpu_hour: tuple[tuple[str, float], ...] = ()
    deadline_days: Optional[float] = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    gpus_per_node: Optional[int] = None
    memory_limit_gib: Optional[float] = None

    def request(self, gpu: str, num_gpus: int) -> PlanRequest:
        """The PlanRequest `plan MODEL.py --gpus num_gpus --gpu gpu ...` would make."""
        return PlanRequest(
            gpus=num_gpus, gpu=gpu, gpus_per_node=self.gpus_per_node, global_batch=self.global_batch,
            precision=self.precision, optimizer=self.optimizer, memory_limit_gib=self.memory_limit_gib,
        )

    def price(self, gpu: str) -> Optional[float]:
        return dict(self.prices_per_gpu_hour).get(gpu)


@dataclass(frozen=True)
class Point:
    """One GPU type and count: the best plan `plan` finds there, or why nothing fits."""

    gpu: str
    display_name: str
    num_gpus: int
    fits: bool
    plan: str
    """The plan in one line, or why nothing fits."""
    global_batch: Optional[int]
    micro_batch: Optional[int]
    step_time_s: Optional[float]
    samples_per_s: Optional[float]
    tokens_per_s: Optional[float]
    mfu: Optional[float]
    peak_memory_bytes: Optional[int]
    """The fullest GPU of the plan; when nothing fits, the least any candidate needs."""
    memory_limit_bytes: int
    steps: Optional[int] = None
    days_to_train: Optional[float] = None
    gpu_hours: Optional[float] = None
    cost_usd: Optional[float] = None
    scaling_efficiency: Optional[float] = None
    detail: Optional[Plan] = field(default=None, compare=False, repr=False)
    """The full Plan (for the report's memory and pipeline charts); not in CSV/JSON rows."""

    @property
    def label(self) -> str:
        return f"{self.num_gpus} x {self.gpu}"

    def row(self) -> dict:
        """The CSV/JSON fields, in order."""
        return {k: v for k, v in vars(self).items() if k != "detail"}


@dataclass(frozen=True)
class MinGpus:
    gpu: str
    num_gpus: Optional[int]
    """None: nothing fits up to MAX_GPUS."""
    plan: str
    in_sweep: bool


@dataclass(frozen=True)
class Sweep:
    spec: SweepSpec
    model_name: str
    model_path: str
    num_params: int
    seq_len: Optional[int]
    profile: ModelProfile = field(repr=False)
    gpus: dict[str, GPUSpec] = field(repr=False)
    points: tuple[Point, ...]
    min_gpus: tuple[MinGpus, ...]
    fastest: Optional[Point]
    cheapest: Optional[Point]
    cheapest_basis: str
    deadline_pick: Optional[Point]
    deadline_note: str
    assumptions: tuple[str, ...]
    profile_s: float
    sweep_s: float
    headroom: Optional["Headroom"] = None
    """For a single cluster (one type, one count), else None."""

    def chosen(self) -> Optional[Point]:
        """The configuration the report features: the deadline pick, else the cheapest, else the fastest."""
        return self.deadline_pick or self.cheapest or self.fastest


# -- one point ----------------------------------------------------------------------------------
def _length(spec: SweepSpec, global_batch: int, seq_len: Optional[int]) -> Optional[int]:
    if spec.steps is not None:
        return spec.steps
    if spec.tokens is not None:
        assert seq_len, "checked in run_sweep"
        return math.ceil(spec.tokens / (global_batch * seq_len))
    return None


def evaluate_point(handle: ModelHandle, profile: ModelProfile, spec: SweepSpec, gpu: GPUSpec, n: int) -> Point:
    request = spec.request(gpu.name if gpu.origin in ("packaged", "measured") else gpu.origin, n)
    limit = gpu.memory_bytes if spec.memory_limit_gib is None else int(spec.memory_limit_gib * 2**30)
    try:
        plan = planning.make_plan(handle, request, profile=profile)
    except Infeasible:
        need = None
        try:
            need = planning.search(profile, request, planning.cluster_for(request))[0].min_need_bytes
        except BadInput:
            pass
        why = f"does not fit: needs {fmt_bytes(need)} per GPU" if need else "does not fit"
        return Point(gpu.name, gpu.display_name, n, False, why, spec.global_batch, None, None, None, None, None,
                     int(need) if need else None, limit)
    except BadInput as exc:  # e.g. a count that is not whole nodes, a global batch dp cannot divide
        return Point(gpu.name, gpu.display_name, n, False, f"not valid: {exc}", spec.global_batch, None, None,
                     None, None, None, None, limit)
    pr = plan.predicted
    steps = _length(spec, plan.training.global_batch, plan.model.seq_len)
    days = steps * pr.step_time_s / 86400 if steps is not None else None
    hours = days * 24 * n if days is not None else None
    price = spec.price(gpu.name)
    return Point(
        gpu.name, gpu.display_name, n, True, plan.parallel.one_line(), plan.training.global_batch,
        plan.parallel.micro_batch, pr.step_time_s, pr.samples_per_s, pr.tokens_per_s, pr.mfu,
        pr.peak_memory_bytes, plan.cluster.memory_limit_bytes, steps, days, hours,
        hours * price if hours is not None and price is not None else None, detail=plan,
    )


# -- derived answers ----------------------------------------------------------------------------
def with_efficiency(points: list[Point]) -> list[Point]:
    """Scaling efficiency against the smallest fitting count of the same GPU type."""
    out = []
    for p in points:
        base = min((q for q in points if q.gpu == p.gpu and q.fits), key=lambda q: q.num_gpus, default=None)
        if p.fits and base is not None:
            eff = (p.samples_per_s / base.samples_per_s) / (p.num_gpus / base.num_gpus)
            p = replace(p, scaling_efficiency=eff)
        out.append(p)
    return out


def min_gpus(handle: ModelHandle, profile: ModelProfile, spec: SweepSpec, gpu: GPUSpec, points: list[Point]) -> MinGpus:
    mine = sorted((p for p in points if p.gpu == gpu.name), key=lambda p: p.num_gpus)
    fitting = [p for p in mine if p.fits]
    key = gpu.name if gpu.origin in ("packaged", "measured") else gpu.origin
    if fitting:
        best, n = fitting[0], fitting[0].num_gpus
        swept = {p.num_gpus for p in mine}
        while n % 2 == 0 and n // 2 not in swept and planning.feasible(profile, spec.request(key, n // 2)):
            n //= 2
        if n == best.num_gpus:
            return MinGpus(gpu.name, n, best.plan, True)
    else:
        n = (mine[-1].num_gpus if mine else 1) * 2
        while n <= MAX_GPUS and not planning.feasible(profile, spec.request(key, n)):
            n *= 2
        if n > MAX_GPUS:
            return MinGpus(gpu.name, None, f"nothing fits up to {MAX_GPUS:,} GPUs", False)
    plan = planning.make_plan(handle, spec.request(key, n), profile=profile)
    return MinGpus(gpu.name, n, plan.parallel.one_line(), False)


def _cost_key(points: list[Point]) -> tuple[Callable[[Point], float], str]:
    if points and all(p.cost_usd is not None for p in points):
        return (lambda p: p.cost_usd), "lowest cost"
    if points and all(p.gpu_hours is not None for p in points):
        return (lambda p: p.gpu_hours), "fewest GPU-hours (no --price)"
    return (lambda p: p.num_gpus * p.step_time_s / p.global_batch), "fewest GPU-seconds per sample (no --tokens/--steps)"


def picks(spec: SweepSpec, points: list[Point]) -> tuple[Optional[Point], Optional[Point], str, Optional[Point], str]:
    """(fastest, cheapest, cheapest's basis, deadline pick, a note on the deadline)."""
    ok = [p for p in points if p.fits]
    if not ok:
        return None, None, "nothing fits", None, ""
    if all(p.days_to_train is not None for p in ok):
        fastest = min(ok, key=lambda p: (p.days_to_train, p.num_gpus))
    else:
        fastest = max(ok, key=lambda p: (p.samples_per_s, -p.num_gpus))
    cost, basis = _cost_key(ok)
    cheapest = min(ok, key=lambda p: (cost(p), p.num_gpus))
    pick, note = None, ""
    if spec.deadline_days is not None:
        meet = [p for p in ok if p.days_to_train is not None and p.days_to_train <= spec.deadline_days]
        if meet:
            pick = min(meet, key=lambda p: (cost(p), p.num_gpus))
            note = f"{len(meet)} of {len(ok)} fitting configurations finish within {spec.deadline_days:g} days"
        else:
            note = (f"none finishes within {spec.deadline_days:g} days: the fastest, {fastest.label}, "
                    f"takes {fastest.days_to_train:,.1f} days")
    return fastest, cheapest, basis, pick, note


def assumptions(spec: SweepSpec, gpus: dict[str, GPUSpec], points: list[Point]) -> list[str]:
    out = []
    for g in gpus.values():
        dtype = spec.precision
        src = g.sources.get(f"peak_flops.{dtype}") or g.sources.get("peak_flops", "")
        out.append(
            f"{g.name} ({g.display_name}): {g.peak_flops.get(dtype, 0) / 1e12:,.1f} TFLOP/s dense {dtype}"
            + (f" [{src}]" if src else "")
            + f", {g.memory_gb:.0f} GB [{g.sources.get('memory_bytes', g.origin)}], "
            f"HBM {g.hbm_bandwidth_Bps / 1e9:,.0f} GB/s, {g.intra_node_bandwidth_Bps / 1e9:,.0f} GB/s in a node, "
            f"{g.inter_node_bandwidth_Bps / 1e9:,.1f} GB/s across nodes per GPU, {g.gpus_per_node} per node"
        )
    plan = next((p.detail for p in points if p.detail is not None), None)
    if plan is not None:
        # the first names one cluster, and the global batch line one point; the rest hold for all
        out += [a for a in plan.assumptions[1:] if not a.startswith("global batch")]
    else:
        out.append(f"efficiencies: matmuls {constants.MATMUL_EFFICIENCY:.0%} of peak, memory-bound ops "
                   f"{constants.MEMORY_EFFICIENCY:.0%} of HBM bandwidth, links {constants.LINK_EFFICIENCY:.0%}")
    out.append(f"{spec.precision} mixed precision, {spec.optimizer}; "
               + (f"global batch {spec.global_batch}" if spec.global_batch
                  else "global batch GPUs x the largest micro-batch that fits (up to 64): it grows with the GPUs"))
    if spec.prices_per_gpu_hour:
        out.append("prices per GPU-hour: " + ", ".join(f"{g} ${p:,.2f}" for g, p in spec.prices_per_gpu_hour))
    else:
        out.append("no prices given (--price): costs in GPU-hours")
    if spec.tokens is not None:
        out.append(f"training length: {fmt_count(spec.tokens)} tokens; steps = ceil(tokens / (global batch x sequence length))")
    elif spec.steps is not None:
        out.append(f"training length: {spec.steps:,} steps")
    out.append("days = steps x predicted step time / 86,400 (no restarts, evaluation or data stalls)")
    return out


# -- the sweep ----------------------------------------------------------------------------------
def run_sweep(handle: ModelHandle, spec: SweepSpec, on_point: Callable[[str], None] | None = None,
              profile: ModelProfile | None = None) -> Sweep:
    """Evaluate every (type, count) with the profile made once; `on_point` after each point."""
    import time

    gpus = {g.name: g for g in (get_gpu(name) for name in spec.gpu_types)}
    t0 = time.perf_counter()
    first = next(iter(gpus.values()))
    local = "cpu" if any(g.origin == "measured" for g in gpus.values()) else first.name
    profile = profile or planning.profile_for(handle, spec.request(local, 1))
    profile_s = time.perf_counter() - t0
    if spec.tokens is not None and not profile.seq_len:
        raise BadInput(f"--tokens: {handle.name} has no sequence length (its inputs are not token ids); use --steps")
    t1 = time.perf_counter()
    points: list[Point] = []
    for g in gpus.values():
        for n in spec.gpu_counts:
            points.append(evaluate_point(handle, profile, spec, g, n))
            if on_point:
                on_point(points[-1].label)
    points = with_efficiency(points)
    mins = tuple(min_gpus(handle, profile, spec, g, points) for g in gpus.values())
    fastest, cheapest, basis, pick, note = picks(spec, points)
    headroom = None
    if len(points) == 1 and points[0].fits:
        from planner.report.headroom import headroom_of

        headroom = headroom_of(profile, spec, points[0])
    return Sweep(
        spec, handle.name, str(handle.path), profile.num_params, profile.seq_len, profile, gpus, tuple(points),
        mins, fastest, cheapest, basis, pick, note, tuple(assumptions(spec, gpus, points)), profile_s,
        time.perf_counter() - t1, headroom,
    )
