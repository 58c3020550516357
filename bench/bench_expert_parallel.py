"""What expert parallelism does to mixture-of-experts training, predicted, against what was published.

Model: Mixtral 8x7B (examples/mixtral_8x7b.py: Hugging Face transformers' MixtralForCausalLM from
its published config, profiled on fake tensors), 4,096-token sequences, bf16, AdamW.

1. Published: Megatron-Core's MoE guide (NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md,
   MCore v0.8) reports Mixtral 8x7B bf16 training at 438 TFLOP/s per GPU on H100, and its example
   run is 32 H100s (4 nodes of 8), micro-batch 1, global batch 128, TP 1, PP 4, EP 8, the
   distributed optimizer (ZeRO-1), no recompute, and says EP 8 x TP 1 beats EP 4 x TP 2 for 8x7B. The
   guide does not say that the 438 came from that exact run; it is the one configuration it gives.
   The plan fixes it (schedule 1F1B, recompute searched) and prints its TFLOP/s per GPU: the
   profile's FLOPs (the top-2 experts' matmuls for each token, attention over the whole s x s)
   per second.
2. The same configuration with EP 1, 2, 4, 8: step time, the all-to-alls' share, the data-parallel
   traffic and peak memory (an EP degree whose plan does not fit says so).
3. The free search on 32 and 64 H100s: the best plan, and the best without expert parallelism.

    python bench/bench_expert_parallel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.errors import BadInput, Infeasible  # noqa: E402
from planner.model_file import load_model_file  # noqa: E402
from planner.planning import PlanRequest, make_plan, profile_for  # noqa: E402
from planner.search.space import Fixed  # noqa: E402

PUBLISHED_TFLOPS = 438.0  # Megatron-Core MoE README, MCore v0.8, Mixtral 8x7B bf16 on H100
GPUS, BATCH = 32, 128


def request(gpus: int, batch: int, fixed: Fixed = Fixed()) -> PlanRequest:
    return PlanRequest(gpus=gpus, gpu="h100-sxm-80gb", global_batch=batch, precision="bf16", optimizer="adamw",
                       fixed=fixed, top_k=1)


def _short(plan) -> str:
    p = plan.parallel
    sched = f" {p.schedule}" + (f"x{p.virtual_stages}" if p.schedule == "interleaved" else "") if p.pp > 1 else ""
    return (f"dp{p.dp} tp{p.tp} pp{p.pp} ep{p.ep} mb{p.micro_batch}x{p.num_microbatches} z{p.zero}{sched} "
            f"rc={p.recompute}")


def main() -> None:
    try:
        handle = load_model_file(ROOT / "examples" / "mixtral_8x7b.py")
    except BadInput as exc:  # transformers missing
        sys.exit(f"bench_expert_parallel: {exc}")
    profile = profile_for(handle, request(GPUS, BATCH))
    moe = [l for l in profile.layers if l.moe_experts]
    experts = sum(l.expert_params for l in moe)
    print(f"Mixtral 8x7B: {profile.num_params / 1e9:.1f} B parameters, {experts / 1e9:.1f} B in {len(moe)} layers of "
          f"{moe[0].moe_experts} experts (top {moe[0].moe_top_k}); profiled in {profile.profile_s:.1f} s")

    print(f"\n1. Megatron-Core's configuration: {GPUS} H100s, global batch {BATCH}, tp1 pp4 ep8 dp8, ZeRO-1, micro-batch 1")
    fixed = Fixed(tp=1, pp=4, dp=8, ep=8, zero=1, micro_batch=1, schedule="1f1b")
    plan = make_plan(handle, request(GPUS, BATCH, fixed), profile)
    tflops = plan.predicted.model_tflops_per_gpu
    print(f"   predicted {plan.predicted.step_time_s:.2f} s per step, {tflops:.0f} TFLOP/s per GPU; published "
          f"{PUBLISHED_TFLOPS:.0f}: predicted / published {tflops / PUBLISHED_TFLOPS:.2f}; "
          f"peak memory {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB ({_short(plan)})")

    print("\n2. The same with other EP degrees")
    print(f"   {'ep':>3} | {'step s':>7} {'TFLOP/s':>8} | {'EP a2a s':>8} {'DP s':>6} {'bubble s':>8} | {'peak GiB':>8}")
    for ep in (1, 2, 4, 8):
        try:
            p = make_plan(handle, request(GPUS, BATCH, Fixed(tp=1, pp=4, dp=8, ep=ep, zero=1, micro_batch=1,
                                                             schedule="1f1b")), profile)
        except Infeasible as exc:
            print(f"   {ep:>3} | does not fit: {exc}")
            continue
        b = p.predicted.breakdown_s
        print(f"   {ep:>3} | {p.predicted.step_time_s:>7.2f} {p.predicted.model_tflops_per_gpu:>8.0f} | "
              f"{b['ep_comm']:>8.3f} {b['dp_comm']:>6.3f} {b['bubble']:>8.3f} | {p.predicted.peak_memory_bytes / 2**30:>8.1f}")

    print("\n3. The free search")
    print(f"   {'GPUs':>4} {'batch':>5} | {'best plan':<52} {'step s':>6} {'TFLOP/s':>7} | {'best with --ep 1':<52} {'step s':>6}")
    for gpus, batch in ((32, 128), (64, 256)):
        best = make_plan(handle, request(gpus, batch), profile)
        try:
            no_ep = make_plan(handle, request(gpus, batch, Fixed(ep=1)), profile)
            other, other_s = _short(no_ep), f"{no_ep.predicted.step_time_s:.2f}"
        except Infeasible:
            other, other_s = "nothing fits", "-"
        print(f"   {gpus:>4} {batch:>5} | {_short(best):<52} {best.predicted.step_time_s:>6.2f} "
              f"{best.predicted.model_tflops_per_gpu:>7.0f} | {other:<52} {other_s:>6}")


if __name__ == "__main__":
    main()
