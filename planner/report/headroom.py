"""Memory headroom of a single cluster: how much larger the batch, the model or the sequence
could be before the best plan stops fitting (`plan whatif` with one GPU type and count).

Batch: doubled until the search finds nothing. Model and sequence: a scaled copy of the profile
(`scale_profile`: a model k x larger multiplies every layer's parameters, FLOPs and activations,
i.e. k times the layers in memory; a sequence k x longer multiplies activations, the tensors
between layers and FLOPs), the largest factor found by doubling and geometric bisection (~2%).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional

from planner import planning
from planner.profile.types import ModelProfile
from planner.report.sweep_types import Headroom, Point, SweepSpec  # noqa: F401 (re-exported)

MAX_MICRO_BATCH = 1 << 15
GLOBAL_BATCH_CAP = 16
SCALE_CAP = 1024.0


def scale_profile(profile: ModelProfile, model: float = 1.0, seq: float = 1.0) -> ModelProfile:
    """A copy of the profile for a model `model` x larger and a sequence `seq` x longer (module doc)."""
    both = model * seq

    def r(x: Optional[float], k: float):
        return None if x is None else (x * k if isinstance(x, float) else int(round(x * k)))

    layers = []
    for l in profile.layers:
        tp = l.tp and replace(l.tp, sharded_params=r(l.tp.sharded_params, model), allreduce_bytes=r(l.tp.allreduce_bytes, seq))
        layers.append(replace(
            l, num_params=r(l.num_params, model), param_bytes=r(l.param_bytes, model),
            fwd_flops=r(l.fwd_flops, both), bwd_flops=r(l.bwd_flops, both), activation_bytes=r(l.activation_bytes, both),
            activation_matmul_bytes=r(l.activation_matmul_bytes, both), output_bytes=r(l.output_bytes, seq),
            fwd_matmul_io_bytes=r(l.fwd_matmul_io_bytes, both), fwd_other_io_bytes=r(l.fwd_other_io_bytes, both),
            bwd_matmul_io_bytes=r(l.bwd_matmul_io_bytes, both), bwd_other_io_bytes=r(l.bwd_other_io_bytes, both),
            fwd_s=r(l.fwd_s, both), bwd_s=r(l.bwd_s, both), tp=tp,
            fwd_attention_flops=r(l.fwd_attention_flops, both), bwd_attention_flops=r(l.bwd_attention_flops, both),
            fwd_causal_attention_flops=r(l.fwd_causal_attention_flops, both),
            bwd_causal_attention_flops=r(l.bwd_causal_attention_flops, both),
            attention_kv_bytes=r(l.attention_kv_bytes, both),
            attention_kv_unique_bytes=r(l.attention_kv_unique_bytes, both),
        ))
    t = profile.totals
    totals = replace(
        t, num_params=sum(l.num_params for l in layers), param_bytes=sum(l.param_bytes for l in layers),
        fwd_flops=r(t.fwd_flops, both), bwd_flops=r(t.bwd_flops, both), activation_bytes=r(t.activation_bytes, both),
        fwd_s=r(t.fwd_s, both), bwd_s=r(t.bwd_s, both),
    )
    edges = tuple(replace(e, num_bytes=r(e.num_bytes, seq)) for e in profile.edges)
    seq_len = r(profile.seq_len, seq) if profile.seq_len else profile.seq_len
    return replace(profile, layers=tuple(layers), totals=totals, edges=edges, seq_len=seq_len)


def _largest_factor(check: Callable[[float], bool], guess: float) -> tuple[float, bool]:
    """The largest k >= 1 with check(k) (check(1) holds), to about 2%: bracket from `guess` (the
    memory ratio) by doubling, then 5 geometric bisections."""
    guess = min(max(guess, 1.0), SCALE_CAP)
    if guess > 1.0 and not check(guess):
        lo, hi = 1.0, guess
    else:
        lo, hi = guess, guess * 2
        while check(hi):
            lo, hi = hi, hi * 2
            if lo >= SCALE_CAP:
                return lo, True
    for _ in range(5):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if check(mid) else (lo, mid)
    return lo, False


def headroom_of(profile: ModelProfile, spec: SweepSpec, point: Point) -> Headroom:
    from planner.search.space import Fixed

    plan = point.detail
    assert plan is not None and point.fits
    n = point.num_gpus
    base = spec.request(spec.gpu_types[0], n, plan.training.global_batch)
    b = plan.parallel.micro_batch
    # a micro-batch of 2b on any data-parallel degree: a global batch of GPUs x 2b
    while b < MAX_MICRO_BATCH and planning.feasible(profile, replace(base, global_batch=n * b * 2, fixed=Fixed(micro_batch=b * 2))):
        b *= 2
    g = plan.training.global_batch
    while g < plan.training.global_batch * GLOBAL_BATCH_CAP and planning.feasible(profile, replace(base, global_batch=g * 2)):
        g *= 2
    ratio = point.memory_limit_bytes / (point.peak_memory_bytes or point.memory_limit_bytes)
    model_k, model_cap = _largest_factor(lambda k: planning.feasible(scale_profile(profile, model=k), base), ratio)
    seq_k, seq_cap = (None, False)
    if profile.seq_len:
        seq_k, seq_cap = _largest_factor(lambda k: planning.feasible(scale_profile(profile, seq=k), base), ratio)
    return Headroom(
        memory_free_bytes=point.memory_limit_bytes - (point.peak_memory_bytes or 0),
        micro_batch=plan.parallel.micro_batch, max_micro_batch=b, max_micro_batch_capped=b >= MAX_MICRO_BATCH,
        global_batch=plan.training.global_batch, max_global_batch=g,
        max_global_batch_capped=g >= plan.training.global_batch * GLOBAL_BATCH_CAP,
        model_scale=model_k, model_scale_capped=model_cap, max_params=int(profile.num_params * model_k),
        seq_scale=seq_k, seq_scale_capped=seq_cap,
        max_seq_len=int(profile.seq_len * seq_k) if seq_k and profile.seq_len else None,
    )
