"""Every constant of the cost model, with where it comes from.

Efficiencies are fractions of a datasheet peak. The two compute efficiencies were fitted once,
jointly, against the measured runs in ``../shared/reference/published_runs.yaml`` (all rows at
once, by ``bench/bench_published.py --fit``); they are not per-row or per-model constants, and
they apply to every GPU type through its own peak FLOP/s and HBM bandwidth (a roofline).
"""

# Fraction of dense peak FLOP/s that bf16/fp16 GEMMs reach. Fitted (0.78) on the 18 runs of
# published_runs.yaml with bench/bench_published.py --fit, jointly with MEMORY_EFFICIENCY
# (grid 0.50-1.00 x 0.30-0.90; worst error 13.6%, median 7.2%). Consistent with cuBLAS reaching
# 240-280 of the A100's 312 TFLOP/s on large GEMMs.
MATMUL_EFFICIENCY = 0.78

# Fraction of HBM bandwidth that memory-bound kernels (elementwise, norms, softmax, dropout)
# reach. Fitted jointly (0.85); STREAM-like copies reach 85-90% of HBM peak on A100/H100.
MEMORY_EFFICIENCY = 0.85

# Fraction of link bandwidth a collective achieves at large messages: NCCL bus bandwidth is
# typically 70-90% of the per-direction link rate (../shared/reference/hardware.yaml,
# interconnect.achievable_vs_peak, a rule of thumb).
LINK_EFFICIENCY = 0.8

# Host-side cost of one eager PyTorch op (Python, dispatcher, kernel launch): ~5-10 us per op
# on current CPUs (PyTorch "eager mode overhead" measurements; CUDA launch ~3-5 us). An op takes
# at least this long; large kernels hide it, tiny ones are bound by it.
OP_OVERHEAD_S = 6e-6

# DDP gradient bucket (torch.nn.parallel.DistributedDataParallel bucket_cap_mb default 25 MB):
# the last bucket's all-reduce starts after the backward ends, so at least this share of the
# gradient sync is exposed.
DDP_BUCKET_BYTES = 25 * 2**20

# Memory reserve per device, stated in every plan:
# - GPU: CUDA context + cuBLAS/cuDNN workspaces (~0.5-0.8 GB measured on A100/H100 with PyTorch)
#   and NCCL's communication buffers (~0.2-0.5 GB): 1 GiB;
# - CPU (a gloo process): the Python interpreter with torch imported, ~0.3 GB resident
#   (measured here: bench/bench_profile.py peak RSS of a fake-tensor profile, 321-334 MB).
RESERVE_GPU_BYTES = 2**30
RESERVE_CPU_BYTES = int(0.35 * 2**30)
# Allocator fragmentation on top of what tensors need (PyTorch's caching allocator typically
# leaves 5-10% of reserved memory unused in training loops).
FRAGMENTATION = 0.05
