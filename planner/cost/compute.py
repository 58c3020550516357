"""Compute time of a layer on one device: a roofline, or the local measurement.

For a GPU, each phase (forward, backward) of a layer costs
    max(matmul FLOPs / (peak x gpu.matmul_efficiency x MATMUL_EFFICIENCY)
        + attention FLOPs / (16-bit peak x gpu.attention_efficiency),
        matmul bytes / (HBM x MEMORY_EFFICIENCY))
  + other bytes / (HBM x MEMORY_EFFICIENCY),
at least ops x OP_OVERHEAD_S (launch-bound when kernels are tiny). The FLOPs and bytes come from
the profile (measured per op), so the same formula covers GEMM-heavy transformers and
bandwidth-heavy CNNs, and the balance of each GPU (FLOP/s against HBM bandwidth) shows.
`gpu.matmul_efficiency` is the GPU's own measured ceiling (best matmul / peak, a catalogue field
with its source: newer GPUs reach a smaller share of their peak); MATMUL_EFFICIENCY is the share
of that ceiling a model's GEMMs reach, one figure for every GPU. Fused attention (SDPA) is not a
GEMM: its kernels reach a share of the peak published per GPU generation
(`gpu.attention_efficiency`: FlashAttention-2, which SDPA runs, was written for Ampere and reaches
about 60% of an A100's peak but 35% of an H100's), the matmul rate where the catalogue has none.

When the target is the local CPU and the profile was timed on it, the measured seconds are used,
scaled to the micro-batch and to the threads each process gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.constants import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, OP_OVERHEAD_S
from planner.hardware import GPUSpec


@dataclass(frozen=True)
class Work:
    """One phase of one layer for one micro-batch on one device (already divided by TP)."""

    flops: float
    matmul_bytes: float
    other_bytes: float
    ops: int
    fp8_flops: float = 0.0
    """Of flops, those run at the FP8 rate (Linear matmuls under --precision fp8)."""
    attention_flops: float = 0.0
    """Of flops, the fused attention kernels' (16-bit whatever the precision)."""

    def minus(self, other: "Work") -> "Work":
        """This work without `other` (a part of it)."""
        return Work(max(0.0, self.flops - other.flops), max(0.0, self.matmul_bytes - other.matmul_bytes),
                    max(0.0, self.other_bytes - other.other_bytes), max(0, self.ops - other.ops),
                    max(0.0, self.fp8_flops - other.fp8_flops), max(0.0, self.attention_flops - other.attention_flops))

    def scaled(self, factor: float) -> "Work":
        return Work(self.flops * factor, self.matmul_bytes * factor, self.other_bytes * factor, self.ops,
                    self.fp8_flops * factor, self.attention_flops * factor)


def roofline_s(work: Work, gpu: GPUSpec, dtype: str) -> float:
    """`dtype` "fp8": `work.fp8_flops` at the FP8 peak, the other matmuls at bf16's."""
    peak = gpu.peak("bf16" if dtype == "fp8" else dtype)
    rate = gpu.matmul_efficiency * MATMUL_EFFICIENCY  # the same share of each peak (no FP8 MAMF published)
    attention = rate if gpu.attention_efficiency is None else gpu.attention_efficiency
    flops_s = (work.flops - work.fp8_flops - work.attention_flops) / (peak * rate) + work.attention_flops / (peak * attention)
    if work.fp8_flops:
        flops_s += work.fp8_flops / (gpu.peak("fp8") * rate)
    hbm = gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY
    matmul = max(flops_s, work.matmul_bytes / hbm)
    return max(matmul + work.other_bytes / hbm, work.ops * OP_OVERHEAD_S)


def memory_bound_s(nbytes: float, gpu: GPUSpec) -> float:
    return nbytes / (gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY)
