"""The global batch a practitioner would choose when the user does not say (`plan`, `plan whatif`).

Only the global batch is defaulted; the micro-batch and the number of micro-batches are then
searched like every other choice (fixing the micro-batch would let activations fill the GPU and
force a model split that a smaller micro-batch avoids).

- Sequence models (the inputs are token ids): a token budget per step that grows with the model,
  interpolated log-log in GPT-3's batch sizes (Brown et al. 2020, Table 2.1: 0.5M tokens for
  125M-760M parameters, 1M for 1.3B-2.7B, 2M for 6.7B-13B, 3.2M for 175B), clamped at the ends
  of the table. Published runs fall in the same range: Llama 2 trained with 4M tokens per step
  (Touvron et al. 2023), Megatron-LM's SC'21 runs with 1M-6M (published_runs.yaml).
- Other models: a number of samples per GPU, 32, as the ImageNet recipes do (Goyal et al. 2017,
  "Accurate, Large Minibatch SGD": 32 images per GPU, 256 on 8 GPUs for ResNet-50).
- The local CPU (`--gpu cpu`), whose steps check a plan rather than train: 8 samples per process.

The batch in samples is rounded to the GPU count times a power of two (nearest in ratio), so that
every data-parallel degree the search may choose divides it into power-of-two micro-batches. A
what-if sweep computes one batch for all its counts (`for_sweep`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from planner.profile.types import ModelProfile

# (parameters, tokens per step): Brown et al. 2020 (GPT-3), Table 2.1.
GPT3_BATCH_TOKENS = (
    (125e6, 0.5e6),
    (350e6, 0.5e6),
    (760e6, 0.5e6),
    (1.3e9, 1e6),
    (2.7e9, 1e6),
    (6.7e9, 2e6),
    (13e9, 2e6),
    (175e9, 3.2e6),
)
# Samples per GPU for models without a sequence: Goyal et al. 2017 (32 images per GPU).
SAMPLES_PER_GPU = 32
# Samples per process on the local CPU: a plan run there checks a plan, it does not train.
SAMPLES_PER_CPU_PROCESS = 8


@dataclass(frozen=True)
class DefaultBatch:
    global_batch: int
    basis: str
    """Why this batch, in one phrase for the plan's assumptions."""


def tokens_per_step(num_params: float) -> float:
    """GPT-3's batch size in tokens for a model of `num_params`, interpolated log-log."""
    table = GPT3_BATCH_TOKENS
    if num_params <= table[0][0]:
        return table[0][1]
    if num_params >= table[-1][0]:
        return table[-1][1]
    for (p0, t0), (p1, t1) in zip(table, table[1:]):
        if p0 <= num_params <= p1:
            x = math.log(num_params / p0) / math.log(p1 / p0)
            return t0 * (t1 / t0) ** x
    raise AssertionError("unreachable: the table covers the range")


def _round_to(target: float, granule: int) -> int:
    """`granule` times the power of two nearest `target / granule` (in ratio), at least `granule`:
    the per-replica batch of every data-parallel degree then splits into power-of-two micro-batches,
    as trainers' batches do (512, 1,024, 1,536 = 3 x 512 on 24 GPUs)."""
    if target <= granule:
        return granule
    return granule * 2 ** round(math.log2(target / granule))


def _target(profile: ModelProfile, num_gpus: int, on_cpu: bool) -> tuple[float, str]:
    """(samples per step before rounding, the basis in words)."""
    if on_cpu:
        return SAMPLES_PER_CPU_PROCESS * num_gpus, f"{SAMPLES_PER_CPU_PROCESS} samples per process on the local CPU"
    if profile.seq_len:
        tokens = tokens_per_step(profile.num_params)
        return tokens / profile.seq_len, (
            f"about {tokens / 1e6:.2g}M tokens per step, GPT-3's batch size for a model of this size "
            "(Brown et al. 2020, Table 2.1)"
        )
    return SAMPLES_PER_GPU * num_gpus, f"{SAMPLES_PER_GPU} samples per GPU (Goyal et al. 2017)"


def for_cluster(profile: ModelProfile, num_gpus: int, on_cpu: bool) -> DefaultBatch:
    """The default global batch of `plan MODEL --gpus num_gpus`."""
    return for_sweep(profile, (num_gpus,), on_cpu)


def for_sweep(profile: ModelProfile, counts: Sequence[int], on_cpu: bool) -> DefaultBatch:
    """One global batch for every GPU count of a sweep (the same as `for_cluster` for one count).

    The target comes from the smallest count (for models sized per GPU); it is rounded to a
    multiple of the least common multiple of the counts that do not exceed it, so that each of
    them divides it (when that multiple would exceed the target, the largest such count alone).
    A count that still does not divide it gets `for_count`'s nearest batch.
    """
    counts = sorted(set(counts))
    target, basis = _target(profile, counts[0], on_cpu)
    small = [n for n in counts if n <= target] or counts[:1]
    granule = math.lcm(*small)
    if granule > target:
        granule = small[-1]
    batch = _round_to(target, granule)
    unit = "sequences" if profile.seq_len and not on_cpu else "samples"
    return DefaultBatch(batch, f"global batch {batch:,} {unit}: {basis}")


def for_count(global_batch: int, num_gpus: int) -> int:
    """`global_batch` if `num_gpus` divides it, else the nearest `num_gpus` x a power of two."""
    return global_batch if global_batch % num_gpus == 0 else _round_to(global_batch, num_gpus)
