"""What context parallelism does to long-sequence Llama training, predicted, against what was published.

1. Llama 3 405B as Meta trained it (Llama 3 paper, Dubey et al. 2024, Table 4 "Scaling
   configurations and MFU for each stage of Llama 3 405B pre-training"; also P. Balaji, "Herding
   Llamas", SC'24): H100 SXM 80 GB (700 W), 400 Gb/s per GPU, 16M tokens per step, TP 8, PP 16,
   FSDP over the rest; 8,192 GPUs at 8,192 tokens (CP 1): 430 TFLOP/s per GPU; 16,384 GPUs at 8,192
   tokens (CP 1): 400; 16,384 GPUs at 131,072 tokens (CP 16, DP 8): 380. The plan fixes tp, cp, pp
   and dp as published and ZeRO-2 (FSDP without resharding under the pipeline), micro-batch 1; the
   schedule and recompute are searched. TFLOP/s per GPU here are the plan's: the profile's FLOPs
   (attention counted over the whole s x s, as Megatron-LM's MFU formula does) per second; the
   paper's FLOP count for attention is not stated, so the ratio CP 16 / CP 1 at 16,384 GPUs (0.95
   published) is the figure least sensitive to it.
2. The free search on Llama 3 8B, 64 H100s, 4M tokens per step, from 8k to 128k tokens per
   sequence: the best plan, the best without context parallelism (--cp 1), and what CP gains.

Both models keep grouped-query attention inside the kernel (SDPA's enable_gqa: 8 key/value heads
read and exchanged), as Meta's training did; examples/llama.py, like torchtitan's model, repeats
them to every query head first, so its ring passes 16x the bytes at 405B's 128 heads.

    python bench/bench_context_parallel.py [--skip-405b]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.errors import BadInput, Infeasible  # noqa: E402
from planner.model_file import load_model_file  # noqa: E402
from planner.planning import PlanRequest, make_plan, profile_for  # noqa: E402
from planner.search.space import Fixed  # noqa: E402

LLAMA = """
import sys
sys.path.insert(0, {examples!r})
import torch.nn.functional as F
import llama
from llama import LlamaConfig, build_llama, llama_batch, apply_rope
CFG = LlamaConfig(dim={dim}, n_layers={layers}, n_heads={heads}, n_kv_heads=8, ffn_dim={ffn}, vocab=128256,
                  seq_len={seq}, rope_theta=500000.0)


class Attention(llama.Attention):
    # grouped-query attention inside the kernel (SDPA enable_gqa): the 8 key/value heads are what
    # attention reads and what context parallelism exchanges, as Meta's Llama 3 training did (its
    # CP all-gathers K and V, "small thanks to GQA"); examples/llama.py repeats them first, as
    # torchtitan's model does
    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def build_model():
    model = build_llama(CFG)
    for layer in model.layers:
        layer.self_attn.__class__ = Attention
    return model
def sample_batch(b):
    return llama_batch(CFG, b)
"""
LLAMA_405B = dict(dim=16384, layers=126, heads=128, ffn=53248)
LLAMA_8B = dict(dim=4096, layers=32, heads=32, ffn=14336)
# (GPUs, seq, tp, cp, pp, dp, published TFLOP/s per GPU): Llama 3 paper, Table 4
TABLE4 = (
    (8192, 8192, 8, 1, 16, 64, 430.0),
    (16384, 8192, 8, 1, 16, 128, 400.0),
    (16384, 131072, 8, 16, 16, 8, 380.0),
)
TOKENS_405B = 16 * 2**20
TOKENS_8B = 4 * 2**20


def model_file(folder: Path, shape: dict, seq: int):
    path = folder / f"llama_{shape['layers']}l_{seq}.py"
    path.write_text(LLAMA.format(examples=str(ROOT / "examples"), seq=seq, **shape))
    return load_model_file(path)


def request(gpus: int, batch: int, fixed: Fixed = Fixed()) -> PlanRequest:
    return PlanRequest(gpus=gpus, gpu="h100-sxm-80gb", global_batch=batch, precision="bf16", optimizer="adamw",
                       inter_node_gbps=400, fixed=fixed, top_k=1)


def llama3_405b(folder: Path) -> None:
    print("Llama 3 405B, Table 4 of the Llama 3 paper (H100 80 GB, 400 Gb/s per GPU, 16M tokens a step)")
    print("published step = 16M tokens x FLOPs per token / (TFLOP/s x GPUs), with attention's FLOPs counted over the")
    print("causal half of the s x s scores .. over all of them (the paper does not say which)")
    print(f"{'GPUs':>6} {'seq':>7} {'tp cp pp dp':>13} | {'TFLOP/s':>7} {'published step s':>16} | {'predicted s':>11} "
          f"{'pred/pub':>11} | {'cp comm s':>9} {'schedule, recompute':<24}")
    profiles = {}
    predicted, published_mid = {}, {}
    for gpus, seq, tp, cp, pp, dp, published in TABLE4:
        handle = model_file(folder, LLAMA_405B, seq)
        batch = TOKENS_405B // seq
        fixed = Fixed(tp=tp, cp=cp, pp=pp, dp=dp, zero=2, micro_batch=1)
        if seq not in profiles:
            profiles[seq] = profile_for(handle, request(gpus, batch, fixed))
        profile = profiles[seq]
        plan = make_plan(handle, request(gpus, batch, fixed), profile)
        tokens = batch * seq
        whole = sum(l.fwd_flops + l.bwd_flops for l in profile.layers) / (profile.batch_size * seq)
        attention = sum(l.fwd_attention_flops + l.bwd_attention_flops for l in profile.layers) / (profile.batch_size * seq)
        rate = published * 1e12 * gpus
        lo, hi = tokens * (whole - attention / 2) / rate, tokens * whole / rate
        step = plan.predicted.step_time_s
        predicted[(gpus, cp)], published_mid[(gpus, cp)] = step, (lo, hi)
        p = plan.parallel
        how = f"{p.schedule}{' x' + str(p.virtual_stages) if p.schedule == 'interleaved' else ''}, {p.recompute}"
        print(f"{gpus:>6} {seq:>7} {f'{tp} {cp} {pp} {dp}':>13} | {published:>7.0f} {f'{lo:.2f} .. {hi:.2f}':>16} | "
              f"{step:>11.2f} {f'{step / hi:.2f} .. {step / lo:.2f}':>11} | {plan.predicted.breakdown_s['cp_comm']:>9.3f} {how:<24}")
    # seconds per token at 131k with CP 16 against 8k with CP 1, both on 16,384 GPUs (16M tokens each)
    ratio = predicted[(16384, 16)] / predicted[(16384, 1)]
    lo = published_mid[(16384, 16)][0] / published_mid[(16384, 1)][0]
    hi = published_mid[(16384, 16)][1] / published_mid[(16384, 1)][1]
    print(f"step at 131k (CP 16) over step at 8k (CP 1), 16,384 GPUs: predicted {ratio:.2f}, published {lo:.2f} .. {hi:.2f}")


def llama3_8b_sweep(folder: Path) -> None:
    gpus = 64
    print(f"\nLlama 3 8B on {gpus} H100s, {TOKENS_8B // 2**20}M tokens a step: the free search, with and without CP")
    print(f"{'seq':>7} | {'best plan':<64} {'step s':>7} | {'best with --cp 1':<56} {'step s':>7} | {'CP gain':>7}")
    for seq in (8192, 16384, 32768, 65536, 131072):
        handle = model_file(folder, LLAMA_8B, seq)
        batch = max(TOKENS_8B // seq, 1)
        profile = profile_for(handle, request(gpus, batch))
        best = make_plan(handle, request(gpus, batch), profile)
        try:
            no_cp = make_plan(handle, request(gpus, batch, Fixed(cp=1)), profile)
            other, other_s = _short(no_cp.parallel), no_cp.predicted.step_time_s
            gain = f"{other_s / best.predicted.step_time_s:.2f}x"
        except (Infeasible, BadInput) as exc:
            other, other_s, gain = f"nothing fits ({str(exc)[:40]})", float("nan"), "fits"
        print(f"{seq:>7} | {_short(best.parallel):<64} {best.predicted.step_time_s:>7.2f} | {other:<56} {other_s:>7.2f} | {gain:>7}")


def _short(p) -> str:
    return (f"tp{p.tp} cp{p.cp} pp{p.pp} dp{p.dp} mb{p.micro_batch}x{p.num_microbatches} z{p.zero} "
            f"{p.schedule if p.pp > 1 else ''} rc={p.recompute}").replace("  ", " ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-405b", action="store_true", help="only the 8B sweep")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_405b:
            llama3_405b(Path(tmp))
        llama3_8b_sweep(Path(tmp))
    print(f"\nbench took {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
