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

The global batch: --global-batch, else the default `plan` takes (planner/default_batch.py),
computed once for the sweep, so every point trains at the same batch; a count that the default
does not split over gets the nearest batch that does, said in its row (`Point.batch_note`).
--scale-batch grows it with the count instead (the smallest count's samples per GPU).

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
from typing import Callable, Optional

from planner import default_batch, planning
from planner.cost import constants
from planner.errors import BadInput, Infeasible
from planner.hardware import GPUSpec, get_gpu
from planner.model_file import ModelHandle
from planner.planning import PlanRequest
from planner.profile.types import ModelProfile
from planner.report.sweep_types import Headroom, Point, SweepSpec  # noqa: F401 (re-exported)
from planner.report.units import fmt_bytes, fmt_count

MAX_GPUS = 16384


@dataclass(frozen=True)
class Batching:
    """The global batch of every point: one for the whole sweep unless --scale-batch."""

    global_batch: int
    """The sweep's batch (--global-batch, or the default computed once for the model)."""
    basis: str
    smallest_count: int
    default: bool
    """True: the planner chose it (rounded per count when a count does not divide it)."""
    scale: bool

    def for_count(self, n: int) -> tuple[int, str]:
        """(the global batch at n GPUs, a note when it is not the sweep's batch)."""
        if self.scale:
            per_gpu = self.global_batch / self.smallest_count
            batch = default_batch.for_count(max(1, round(per_gpu * n)), n)
            return batch, f"{batch:,}: --scale-batch, {per_gpu:g} samples per GPU" if batch != self.global_batch else ""
        if not self.default or self.global_batch % n == 0:
            return self.global_batch, ""
        batch = default_batch.for_count(self.global_batch, n)
        return batch, f"{batch:,}: {self.global_batch:,} does not split over {n} GPUs"

    @staticmethod
    def of(profile: ModelProfile, spec: "SweepSpec", on_cpu: bool) -> "Batching":
        counts = spec.gpu_counts
        if spec.global_batch is not None:
            return Batching(spec.global_batch, f"global batch {spec.global_batch:,} (--global-batch)", min(counts), False, spec.scale_batch)
        d = default_batch.for_sweep(profile, counts, on_cpu)
        return Batching(d.global_batch, d.basis, min(counts), True, spec.scale_batch)


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
    batching: Optional[Batching] = None

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


def plan_line(plan) -> str:
    """The plan in one line, marked when it fits only without the allocator's fragmentation."""
    return plan.parallel.one_line() + (" (tight: no room for fragmentation)" if plan.predicted.fragmentation == 0.0 else "")


def gpu_key(gpu: GPUSpec) -> str:
    """What `--gpu` names this type by: its catalogue name, or the YAML file it came from."""
    return gpu.name if gpu.origin in ("packaged", "measured") else gpu.origin


def evaluate_point(handle: ModelHandle, profile: ModelProfile, spec: SweepSpec, batching: Batching, gpu: GPUSpec, n: int) -> Point:
    batch, note = batching.for_count(n)
    request = spec.request(gpu_key(gpu), n, batch)
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
        return Point(gpu.name, gpu.display_name, n, False, why, batch, None, None, None, None, None,
                     int(need) if need else None, limit, batch_note=note)
    except BadInput as exc:  # e.g. a count that is not whole nodes, a global batch dp cannot divide
        return Point(gpu.name, gpu.display_name, n, False, f"not valid: {exc}", batch, None, None,
                     None, None, None, None, limit, batch_note=note)
    pr = plan.predicted
    steps = _length(spec, plan.training.global_batch, plan.model.seq_len)
    days = steps * pr.step_time_s / 86400 if steps is not None else None
    hours = days * 24 * n if days is not None else None
    price = spec.price(gpu.name)
    return Point(
        gpu.name, gpu.display_name, n, True,
        plan_line(plan),
        plan.training.global_batch,
        plan.parallel.micro_batch, pr.step_time_s, pr.samples_per_s, pr.tokens_per_s, pr.mfu,
        pr.peak_memory_bytes, plan.cluster.memory_limit_bytes, steps, days, hours,
        hours * price if hours is not None and price is not None else None, batch_note=note, detail=plan,
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


def min_gpus(handle: ModelHandle, profile: ModelProfile, spec: SweepSpec, batching: Batching, gpu: GPUSpec,
             points: list[Point]) -> MinGpus:
    mine = sorted((p for p in points if p.gpu == gpu.name), key=lambda p: p.num_gpus)
    fitting = [p for p in mine if p.fits]
    key = gpu_key(gpu)

    def request(n: int) -> PlanRequest:
        return spec.request(key, n, batching.for_count(n)[0])

    if fitting:
        best, n = fitting[0], fitting[0].num_gpus
        swept = {p.num_gpus for p in mine}
        while n % 2 == 0 and n // 2 not in swept and planning.feasible(profile, request(n // 2)):
            n //= 2
        if n == best.num_gpus:
            return MinGpus(gpu.name, n, best.plan, True)
    elif mine and all(p.plan.startswith("not valid:") for p in mine):  # e.g. --precision fp8 on an A100
        return MinGpus(gpu.name, None, mine[0].plan, False)
    else:
        n = (mine[-1].num_gpus if mine else 1) * 2
        while n <= MAX_GPUS and not planning.feasible(profile, request(n)):
            n *= 2
        if n > MAX_GPUS:
            return MinGpus(gpu.name, None, f"nothing fits up to {MAX_GPUS:,} GPUs", False)
    plan = planning.make_plan(handle, request(n), profile=profile)
    return MinGpus(gpu.name, n, plan_line(plan), False)


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


def assumptions(spec: SweepSpec, batching: Batching, gpus: dict[str, GPUSpec], points: list[Point]) -> list[str]:
    out = []
    for g in gpus.values():
        dtype = spec.precision
        src = g.sources.get(f"peak_flops.{dtype}") or g.sources.get("peak_flops", "")
        out.append(
            f"{g.name} ({g.display_name}): {g.peak_flops.get(dtype, 0) / 1e12:,.1f} TFLOP/s dense {dtype}"
            + (f" [{src}]" if src else "")
            + f", {g.memory_gb:.0f} GB [{g.sources.get('memory_bytes', g.origin)}], "
            f"HBM {g.hbm_bandwidth_Bps / 1e9:,.0f} GB/s, {g.intra_node_bandwidth_Bps / 1e9:,.0f} GB/s in a node, "
            + (f"{spec.inter_node_gbps:g} Gb/s across nodes per GPU (--inter-node-gbps)" if spec.inter_node_gbps else
               f"{g.inter_node_bandwidth_Bps / 1e9:,.1f} GB/s across nodes per GPU")
            + f", {g.gpus_per_node} per node"
        )
    plan = next((p.detail for p in points if p.detail is not None), None)
    if plan is not None:
        # the first names one cluster, and the global batch line one point; the rest hold for all
        out += [a for a in plan.assumptions[1:] if not a.startswith("global batch")]
    else:
        out.append(f"efficiencies: matmuls {constants.MATMUL_EFFICIENCY:.0%} of each GPU's best measured matmul rate, "
                   f"memory-bound ops {constants.MEMORY_EFFICIENCY:.0%} of HBM bandwidth, data-parallel traffic beside "
                   f"compute hidden but for its contention (that share of the overlap exposed: "
                   f"{constants.OVERLAP_CONTENTION:g} x its link's bandwidth / HBM bandwidth), links {constants.LINK_EFFICIENCY:.0%}")
    if batching.scale:
        held = (f"grows with the GPUs (--scale-batch): {batching.global_batch / batching.smallest_count:g} samples per GPU, "
                f"{batching.global_batch:,} on {batching.smallest_count} GPUs")
    else:
        held = "the same at every count, so that speed, scaling, days and cost compare like with like" + (
            "; a count it does not split over gets the nearest batch that does (said in its row)" if batching.default else "")
    out.append(f"{spec.precision} mixed precision, {spec.optimizer}; {batching.basis}; {held}")
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
    profile = profile or planning.profile_for(handle, spec.request(local, 1, None))
    profile_s = time.perf_counter() - t0
    if spec.tokens is not None and not profile.seq_len:
        raise BadInput(f"--tokens: {handle.name} has no sequence length (its inputs are not token ids); use --steps")
    t1 = time.perf_counter()
    batching = Batching.of(profile, spec, on_cpu=local == "cpu")
    points: list[Point] = []
    for g in gpus.values():
        for n in spec.gpu_counts:
            points.append(evaluate_point(handle, profile, spec, batching, g, n))
            if on_point:
                on_point(points[-1].label)
    points = with_efficiency(points)
    mins = tuple(min_gpus(handle, profile, spec, batching, g, points) for g in gpus.values())
    fastest, cheapest, basis, pick, note = picks(spec, points)
    headroom = None
    if len(points) == 1 and points[0].fits:
        from planner.report.headroom import headroom_of

        headroom = headroom_of(profile, spec, points[0])
    return Sweep(
        spec, handle.name, str(handle.path), profile.num_params, profile.seq_len, profile, gpus, tuple(points),
        mins, fastest, cheapest, basis, pick, note, tuple(assumptions(spec, batching, gpus, points)), profile_s,
        time.perf_counter() - t1, headroom, batching,
    )
