"""Compute time of a layer on one device: a roofline, or the local measurement.

For a GPU, each phase (forward, backward) of a layer costs
    max(matmul FLOPs / (peak x gpu.matmul_efficiency x MATMUL_EFFICIENCY)
        + attention FLOPs / (16-bit peak x gpu.attention_efficiency),
        matmul bytes / (HBM x MEMORY_EFFICIENCY))
  + max(batched FLOPs / that matmul rate, batched bytes / (HBM x MEMORY_EFFICIENCY))
  + other bytes / (HBM x MEMORY_EFFICIENCY) + streamed bytes / (HBM x STREAM_EFFICIENCY),
at least ops x OP_OVERHEAD_S (launch-bound when kernels are tiny); "batched" are the batched
matmuls of two activations (an unfused attention's), apart from the rest (Work.batched_flops).
The FLOPs and bytes come from the profile (measured per op), so the same formula covers
GEMM-heavy transformers and bandwidth-heavy CNNs, and the balance of each GPU (FLOP/s against HBM
bandwidth) shows.
`gpu.matmul_efficiency` is the GPU's own measured ceiling (best matmul / peak, a catalogue field
with its source: newer GPUs reach a smaller share of their peak; FP8 matmuls have their own,
`gpu.fp8_matmul_efficiency`, where measured, and NVFP4's follows from the two,
`GPUSpec.matmul_share`); MATMUL_EFFICIENCY is the share
of that ceiling a model's GEMMs reach, one figure for every GPU. Fused attention (SDPA) is not a
GEMM: its kernels reach a share of the peak published per GPU generation
(`gpu.attention_efficiency`: FlashAttention-2, which SDPA runs, was written for Ampere and reaches
about 60% of an A100's peak but 35% of an H100's), the matmul rate where the catalogue has none.

When the target is the local CPU and the profile was timed on it, the measured seconds are used,
scaled to the micro-batch and to the threads each process gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.constants import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, OP_OVERHEAD_S, STREAM_EFFICIENCY
from planner.cost.setup import tensor_dtype
from planner.hardware import GPUSpec


@dataclass(frozen=True)
class Work:
    """One phase of one layer for one micro-batch on one device (already divided by TP)."""

    flops: float
    matmul_bytes: float
    other_bytes: float
    ops: int
    fp8_flops: float = 0.0
    """Of flops, those run at the low-precision rate (Linear matmuls under --precision fp8 or fp4)."""
    attention_flops: float = 0.0
    """Of flops, the fused attention kernels' (16-bit whatever the precision)."""
    batched_flops: float = 0.0
    """Of flops, the batched matmuls of two activations (an unfused attention's Q K^T and scores x
    V): a roofline of their own, since their arithmetic intensity (about the head dimension: 96 to
    160 FLOPs per byte) does not grow with the batch and sits at or below a GPU's balance point
    (A100: 153 FLOPs per byte), where the layer's other matmuls are far above it."""
    batched_bytes: float = 0.0
    """Of matmul_bytes, what those matmuls read and write."""
    stream_bytes: float = 0.0
    """Bytes of streaming kernels (FP8 casts: an absolute-maximum pass and a scaled copy), priced at
    a copy's rate (STREAM_EFFICIENCY), not at the step's memory-bound average (other_bytes)."""

    def minus(self, other: "Work") -> "Work":
        """This work without `other` (a part of it)."""
        return Work(*(max(0, a - b) for a, b in zip(self.figures(), other.figures())))

    def scaled(self, factor: float) -> "Work":
        return Work(self.flops * factor, self.matmul_bytes * factor, self.other_bytes * factor, self.ops,
                    self.fp8_flops * factor, self.attention_flops * factor, self.batched_flops * factor,
                    self.batched_bytes * factor, self.stream_bytes * factor)

    def figures(self) -> tuple:
        return (self.flops, self.matmul_bytes, self.other_bytes, self.ops, self.fp8_flops, self.attention_flops,
                self.batched_flops, self.batched_bytes, self.stream_bytes)


def roofline_s(work: Work, gpu: GPUSpec, dtype: str) -> float:
    """`dtype` "fp8" or "fp4": `work.fp8_flops` at that dtype's peak, the other matmuls at bf16's."""
    peak = gpu.peak(tensor_dtype(dtype))
    rate = gpu.matmul_efficiency * MATMUL_EFFICIENCY
    attention = rate if gpu.attention_efficiency is None else gpu.attention_efficiency
    rest = work.flops - work.fp8_flops - work.attention_flops - work.batched_flops
    flops_s = rest / (peak * rate) + work.attention_flops / (peak * attention)
    if work.fp8_flops:
        flops_s += work.fp8_flops / (gpu.peak(dtype) * gpu.matmul_share(dtype) * MATMUL_EFFICIENCY)
    hbm = gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY
    matmul = max(flops_s, (work.matmul_bytes - work.batched_bytes) / hbm)
    matmul += max(work.batched_flops / (peak * rate), work.batched_bytes / hbm)
    return max(matmul + work.other_bytes / hbm + stream_s(work.stream_bytes, gpu), work.ops * OP_OVERHEAD_S)


def memory_bound_s(nbytes: float, gpu: GPUSpec) -> float:
    return nbytes / (gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY)


def stream_s(nbytes: float, gpu: GPUSpec) -> float:
    """Seconds a streaming kernel (a copy, a cast) takes to read and write `nbytes`."""
    return nbytes / (gpu.hbm_bandwidth_Bps * STREAM_EFFICIENCY)
