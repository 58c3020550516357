"""Every constant of the cost model, with where it comes from.

Efficiencies are fractions of a measured or datasheet ceiling. The two compute efficiencies and
the overlap's contention were fitted once, jointly, against the measured runs in
``bench/reference/published_runs.yaml`` (all rows at once, by ``bench/bench_published.py --fit``)
and checked on runs nothing was fitted on (``bench/reference/held_out_runs.yaml``,
``bench/reference/llm_foundry_sweep.yaml``); they are not per-row or per-model constants, and they
apply to every GPU type through its own catalogue figures (a roofline).
"""

# Share of the GPU's maximum achievable matmul throughput (its catalogue `matmul_efficiency` x
# dense peak: the best shapes, measured) that a model's GEMMs reach in training. One figure for
# every GPU: the GPU's own ceiling carries the difference between generations (A100 86%, H100 80%
# of peak), its matmul-by-shape table what smaller GEMMs lose (gemm_shapes.py). Fitted jointly
# with MEMORY_EFFICIENCY and OVERLAP_CONTENTION on the 60 runs of
# bench/reference/published_runs.yaml (Megatron-LM, torchtitan, llm-foundry; A100, H100, H200) by
# bench/bench_published.py --fit, with the trainers' fused kernels costed as fused
# (Training.fused_kernels), each trainer's loss as it computes it (Training.loss_bytes_per_logit)
# and each trainer's data-parallel overlap its own: mean |log error| over all rows 0.0621 (median
# 4.3%, worst 28%), the least along each of the three; along the matmul share, memory at 0.50:
# 0.0762 at 0.78, 0.0683 at 0.80, 0.0637 at 0.82, 0.0621 at 0.84, 0.0633 at 0.86, 0.0673 at 0.88.
# The grid's least, 0.0617 at (0.82, 0.55, 4), lies off those lines in a flat valley (median
# 4.4%, worst 29%). Leaving one source out (all three fitted on the other five): every row held
# out, median 6.9%, worst 29% (7.0% once Megatron's ZeRO-1 reduce-scatters, Training.zero1_reduce_scatter,
# where the grid still picks these three). Checked on runs nothing was fitted on:
# bench/reference/held_out_runs.yaml, 107 runs of Megatron-Bridge, NeMo, Nemotron-4, Llama 3,
# MT-NLG, BLOOM, torchtitan, IBM's fms-fsdp and mixture-of-experts models: median 8.7%, its 64
# dense runs 5.6% / worst 25%; bench/reference/llm_foundry_sweep.yaml, 98 MPT runs from 125M to
# 70B: median 4.0%, worst 20.5%; bench/reference/dgxc_runs.yaml, 214 dense runs of NVIDIA's DGX
# Cloud recipes (NeMo on H100 and GB200): median 3.1%, worst 16.8%. (0.78 while memory was held at a copy's 0.90; 0.90 before fused
# kernels were costed, when eager traffic on Megatron-LM's rows stood in for slower matmuls.)
MATMUL_EFFICIENCY = 0.84

# Share of the HBM bandwidth that a model's memory-bound kernels (norms, activation functions,
# softmax, dropout, the optimizer's step) reach in training, over the bytes the profile
# counts for them (each op's inputs and outputs once, no temporaries). Fitted jointly with
# MATMUL_EFFICIENCY (above): mean |log error| 0.0648 at 0.45, 0.0621 at 0.50, 0.0624 at 0.55,
# 0.0676 at 0.60, 0.0775 at 0.70, 0.0862 at 0.80, 0.0939 at 0.90 (matmul 0.84). A large copy
# reaches more (an H200 here: 88% of the catalogue's bandwidth, bench/measured/
# h200_kernels_2026-12-04.json); a step's memory-bound kernels are many and small, reduce (norms,
# softmax), draw random numbers (dropout) or stride (transposes). Held at a copy's 0.90
# until the llm-foundry rows' loss was counted as the kernel they run moves it
# (bench/published/models.py: flash-attn's fused cross-entropy, about 6 bytes a logit, had been
# counted as eager fp32 ops, 66; now 24): that excess on small models' vocabulary-heavy heads had
# stood in for slower kernels (a quarter to a third of the sweep's MPT-125M runs' predicted step
# was the loss), and with it gone the reference, the held-out runs and the llm-foundry sweep each fit 0.50
# to 0.60 (the sweep at the former shares and loss: median 4.7%, worst 24.4%).
MEMORY_EFFICIENCY = 0.50

# Share of the HBM bandwidth a streaming kernel reaches: one that reads a large tensor once and
# writes its result once, in order, with nothing to reduce across threads but a running maximum.
# FP8 training's casts are such kernels (an absolute-maximum pass, then the scaled copy: torchao's
# compiled casts, Transformer Engine's cast_transpose). Measured: a large copy on an H200 here,
# 88.3% of the catalogue's bandwidth (bench/measured/h200_kernels_2026-12-04.json). Priced at the
# step's average (MEMORY_EFFICIENCY), the casts made FP8 runs slower than they ran: this runtime's
# FP8 runs on the same H200 (bench/measured/h200_fp8_compiled_2026-12-04.txt: gpt_1b 4.88 s, a
# Llama 3 8B slice 1.88 s) predicted 19% and 18% slow (7% and 12% at this share; their bf16 runs,
# 6.09 s and 2.73 s, within 6% either way), torchtitan's Float8 gains over bf16 (8B on 8 and 128
# GPUs 1.28x and 1.29x, 8B with TP 8 1.16x, 70B with TP 8 1.36x) predicted 1.03x, 1.02x, 1.06x and
# 1.21x (1.15x, 1.18x, 1.14x and 1.27x at this share; 1.24x, 1.24x, 1.17x and 1.29x once compiled
# casts run once per tensor, Training.fp8_cast_scope, which also brought this runtime's two FP8
# runs to 2% fast and 8% slow).
STREAM_EFFICIENCY = 0.88

# What a collective run beside compute (FSDP's prefetched gathers and reduce-scatters, DDP's
# bucketed all-reduce, a context-parallel ring's exchanges) takes from that compute while both run:
# its kernels read and write every byte they move in HBM and hold SMs for as long as they run
# (Jangda et al., CoCoNet, ASPLOS 2022; Pati et al., T3, ASPLOS 2024: tens of percent where the
# traffic runs at NVLink rates), so both slow down in proportion to the rate the collective moves
# bytes at against the GPU's HBM bandwidth. A collective over `link` beside compute leaves
# exposed what outlasts the compute plus the share
#     s = OVERLAP_CONTENTION x link bandwidth per GPU / HBM bandwidth   (at most 1)
# of the shorter of the two (comm.overlap_share: hidden share 1 - s). An NVLink ring (an H100's
# 450 GB/s against 3.35 TB/s) leaves 54% of the shorter exposed; FSDP across nodes behind 400 Gb/s
# a node (50 GB/s a ring, an A100's 2 TB/s) 10%. A trainer that states what it does brings its
# own hidden share (Training.dp_overlap): Megatron's --overlap-grad-reduce hides the gradient
# reduce-scatter (1), while Megatron-LM before it, DeepSpeed's pipeline engine and DeepSpeed's
# ZeRO-3 of 2021 ran their data-parallel traffic after the backward or synchronised on it (0;
# bench/published/rows.py says where each is read). Fitted with MATMUL_EFFICIENCY and
# MEMORY_EFFICIENCY on the 60 runs of bench/reference/published_runs.yaml (each row's solved
# assignment re-evaluated on a grid, bench/published/fit.py): at matmul 0.84 and memory 0.50, mean
# |log error| 0.0684 at 0 (all hidden), 0.0658 at 1, 0.0637 at 2, 0.0625 at 3, 0.0621 at 4, 0.0623
# at 5, 0.0652 at 6, 0.0698 at 8 (median 5.0%, 4.9%, 4.7%, 4.5%, 4.3%, 4.6%, 4.9%, 5.3%). Leaving one
# source out the folds pick 3 to 8. It replaces one hidden share for every link (0.4), which fitted
# the reference a little better while memory was held at 0.90 (mean |log error| 0.0832 against
# 0.0865 at 4) but not the published FSDP runs of IBM's fms-fsdp (bench/reference/held_out_runs.yaml,
# not fitted on), Llama 2 7B-70B on A100s behind 400 Gb/s a node and H100s behind 800 Gb/s: median
# 19% / worst 41% with it, 12.6% / 18.8% with this at the former shares; their 34B and 70B runs
# shard over the network, which the flat share took as 60% exposed. Traffic over two links (HSDP:
# the shard group's NVLink ring, then the replicas' all-reduce over the network) takes the load of
# each weighted by the seconds it spends there (stage_costs._dp_traffic): priced at the NVLink
# ring's share, fms-fsdp's six HSDP runs (7B and 13B) came out 5-24% slow; weighted, 11% fast to
# 5% slow (its 12 runs: median 14.8% / worst 24.3% before, 8.4% / 18.3% weighted; 6.9% / 12.0%
# once their non-reentrant checkpoint stops early, bench/published/rows.py). On a CPU the same
# formula, with gloo's measured bandwidth against a core's share of the memory bandwidth, hides none:
# gloo's threads take the cores the compute runs on (a 4-process run here measured its compute
# 1.6x the prediction while the collectives' own exposed time was under 1 ms).
OVERLAP_CONTENTION = 4.0

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

# Bytes per parameter of gradients FSDP2 accumulates whole between micro-batches (under a
# pipeline schedule, which turns its gradient sync off but on the last one): its reduce dtype,
# fp32 in mixed precision (runtime/data_parallel.mixed_precision, as torchtitan's default).
ACCUMULATE_BYTES = 4

# Memory reserve per device, stated in every plan:
# - GPU: CUDA context + cuBLAS/cuDNN workspaces (~0.5-0.8 GB measured on A100/H100 with PyTorch)
#   and NCCL's communication buffers (~0.2-0.5 GB): 1 GiB;
# - CPU (a gloo process): the Python interpreter with torch imported, ~0.3 GB resident
#   (measured here: bench/bench_profile.py peak RSS of a fake-tensor profile, 321-334 MB).
RESERVE_GPU_BYTES = 2**30
RESERVE_CPU_BYTES = int(0.35 * 2**30)
# Allocator fragmentation on top of what tensors need: memory the allocator holds (what trainers
# report as peak: torch.cuda.max_memory_reserved) but no tensor uses.
# - GPU: PyTorch's caching allocator splits cached blocks, and the irregular allocations of the
#   memory-saving techniques LLM training runs with (recomputation, sharded data parallelism)
#   fragment them: GMLake (Guo et al., ASPLOS 2024, arXiv 2401.08156) removed 15% fragmentation
#   on average (up to 33%) across eight LLMs on A100-80GB. Checked, not fitted, against the
#   torchtitan peaks in bench/reference (median error 12.9% at the former 5%, 5.2% at 15%).
# - CPU (a gloo process): glibc malloc, no caching allocator: 5%.
FRAGMENTATION_GPU = 0.15
FRAGMENTATION_CPU = 0.05

# A fused attention kernel's (FlashAttention-2's, cuDNN's) work per query row beyond its keys:
# loading the row's queries, the softmax's final rescale, writing its output and log-sum-exp (and
# in backward its query gradient): the work of this many keys, per call. A causal call also runs
# the masked half of its diagonal tiles (ATTENTION_TILE keys wide). So a call over k keys runs, at
# the kernel's plateau rate (GPUSpec.attention_efficiency, reached at long sequences), the FLOPs
# of k + ATTENTION_ROW_KEYS keys per query row, or k / 2 + ATTENTION_TILE / 2 + ATTENTION_ROW_KEYS
# when causal (planner.cost.stage_costs.attention_run_flops). Measured on an H200 with torch 2.11's
# SDPA, 32 heads of 128, 2K to 32K tokens, forward and backward (bench/gpu_kernels.py:
# bench/measured/h200_kernels_2026-12-04.json): fitted with the plateau, every point within 2.5%
# (FlashAttention-2: 330 keys, plateau 33.8% of the peak) and 4% (cuDNN: 350 keys, 58.1%); causal at
# 2K tokens reaches 75% of the plateau (FlashAttention-2) and 73% (cuDNN), at 8K 91% and 90%. The
# tile: FlashAttention-2's and cuDNN's 128-row blocks for a head width of 128. Checked on other
# kernels, forward alone, full attention: an H100's FlashAttention-3 and Triton's tutorial kernel
# (pytorch/benchmark#2391: 512 to 16K tokens, 430-621 and 329-477 TFLOP/s) fit a row's fixed work
# of 230 and 245 keys, every point within 1% (backward's is larger: it also makes the query
# gradient and the rows' output-gradient dot products). Not applied to FlashAttention in Triton
# (llm-foundry's MPT, TRITON_FLASH_SLOWDOWN below): its share is FlashAttention-2's over a slowdown
# its paper read across 512 to 16K tokens, rows' work in it; llm-foundry's sweep of 98 MPT runs
# (bench/reference/llm_foundry_sweep.yaml, 512 to 64K tokens) fits it so (median 4.2%; signed
# medians by sequence +5% at 512 tokens, +3% at 2K, -3% at 8K, +2% at 64K) and does not with the
# row term added on top (6.5%; +12%, +8%, 0%, +3%: too slow where sequences are short).
ATTENTION_ROW_KEYS = 340
ATTENTION_TILE = 128

# The kernels torch's scaled_dot_product_attention picks. Before torch 2.11 FlashAttention-2
# first (cuDNN's attention was made opt-in after torch 2.5's bugs: pytorch/pytorch#138522, Oct 2024;
# a Dec 2024 nightly on an H100 ran FlashAttention-2 at 329 TFLOP/s where cuDNN ran 631:
# pytorch/pytorch#142132). torch's sdp_utils.cpp (check_prefer_cudnn_attention) puts cuDNN first
# on compute capability 9.0 and 10.0 (major 9 or 10, minor 0: H100, H200, H800, B200, GB200; not
# Blackwell Ultra's 10.3) with cuDNN above 9.15.1, which the wheels bundle from torch 2.11
# (released 2026-03-23; huggingface/transformers#48163, 2026-08-31, reading torch's source). Seen
# here: torch 2.11 on an H200 ran causal SDPA at 48% of the peak by default (plan calibrate,
# bench/measured/h200_gpu_check_2026-12-04.txt) where FlashAttention-2 reaches 31% and cuDNN 52%.
SDPA_CUDNN_FROM_TORCH = (2, 11)
SDPA_CUDNN_ARCHS = ("9.0", "10.0")

# FlashAttention written in Triton (Tri Dao's flash_attn_triton, the first FlashAttention's
# algorithm; llm-foundry's MPT runs it for ALiBi: attn_impl "triton") against FlashAttention-2 on
# the same GPU: FlashAttention-2 "is around 1.3-1.5x faster than FlashAttention in Triton in the
# forward pass and around 2x faster in the backward pass" (Dao 2023, arXiv 2307.08691, sec. 4.1,
# A100). Forward and backward together, at FlashAttention-2's own rates there (forward up to 73%
# of the peak, backward 63%; backward 2.5x the forward's FLOPs):
#   (1.4 / 0.73 + 2 x 2.5 / 0.63) / (1 / 0.73 + 2.5 / 0.63) = 1.85 times FlashAttention-2's time.
# Both kernels use Ampere's tensor-core instructions, so the ratio is taken to hold on every GPU
# (GPUSpec.attention_share("triton")).
TRITON_FLASH_SLOWDOWN = (1.4 / 0.73 + 2 * 2.5 / 0.63) / (1 / 0.73 + 2.5 / 0.63)

# The default loss under tensor parallelism runs on the head's vocabulary shards (torch's
# loss_parallel, as torchtitan and this runtime do: planner.model_file.sharded_cross_entropy).
# Its log-softmax and their backward are separate ops (max, shift, exp, sum, subtract), so at the
# loss's peak they hold this many more fp32 copies of the logits shard than the fused
# cross-entropy the profile measured on whole logits: measured with torch's MemTracker on torch
# 2.13 (peak 5.5 x the fp32 logits shard, against 3.5 x whole logits for F.cross_entropy);
# tests/unit/test_loss_memory.py measures it again against the installed torch.
LOSS_PARALLEL_EXTRA = 2.0

# HBM bytes per logit (forward, backward) of Megatron-LM's own cross-entropy without its loss
# fusion (megatron/core/tensor_parallel/cross_entropy.py, VocabParallelCrossEntropy; the only one
# before 2024, and Megatron-LM's default since: --cross-entropy-loss-fusion is off unless set), one
# torch op at a time over the logits upcast to fp32: forward the upcast (2 read, 4 written), the
# max (4), the max subtracted in place (4 + 4), exp in place (4 + 4), the sum (4), the division in
# place (4 + 4): 38; backward the gradient scaled in place (4 + 4) and cast back to the logits'
# dtype (4 + 2): 14. Training.loss_bytes_per_logit; NeMo's and Megatron-Bridge's configurations
# turn the fusion on (Megatron-Bridge's performance configs: cross_entropy_loss_fusion true,
# cross_entropy_fusion_impl "te", one fused kernel), which the fused profile figure prices.
VOCAB_PARALLEL_CE_BYTES = (38.0, 14.0)

# torchtitan's async TP (torch.compile's micro-pipelined TP over symmetric memory) hides this share
# of the sequence-parallel collectives it runs beside the GEMMs (Training.tp_overlap_share), not
# all of them: torchtitan's own published pairs, the same run with and without it on 500 W H100s,
# gain 1.06-1.16x where a whole overlap predicts 1.17-1.35x. Least squares over the five pairs
# (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: Llama 3.1 8B and 70B in bf16 and float8
# tensorwise, 1.10 / 1.10 / 1.09 / 1.16; benchmarks/llama3_h100_202412_torchtitan.md Table 4, 70B
# Float8, 829 -> 876 tokens/s, 1.06; the float8 rowwise pairs left out, whose baseline the doc
# calls abnormally slow; bench/reference/async_tp_pairs.yaml), on the log of each pair's gain:
# 0.35-0.4 (0.35 taken), each pair's gain then within 7.5%; fitted without any one pair, 0.35 or
# 0.4, which predicts that pair's gain within 7.5%. Checked again once the vanilla runs paid
# DTensor's layout copies (Training.tp_batch_first): over the four 2025 pairs 0.35 is still the
# least (root mean square of the log error 0.032; 0.3: 0.032, 0.4: 0.039), each pair's gain within
# 4.2%, the 2024 pair's 5.5%. Megatron-LM's userbuffers overlap hides it all (its published runs,
# bench/reference/held_out_runs.yaml).
ASYNC_TP_OVERLAP = 0.35
