"""Where a hand-written mixture-of-experts layer's time goes on a CUDA GPU: one layer of
bench/gpu_models/moe_2b.py (examples/moe.py's SparseMoE: a router, then each expert called in a
Python loop on the rows ``torch.where`` picks for it) at its plan's micro-batch, forward and
backward under torch.profiler.

On an H200 (2026-12-04, bench/measured/h200_fp8_compiled_2026-12-04.txt) `plan run` measured that
model's step at 2.96x the plan's (2.11 s against 0.71 s) while its dense runs came within 1.12x;
this prints what the layer's kernels take (the top ones by device time), the device's total
against the wall time (the rest: the GPU waiting for the host: the loop's per-expert host work
and ``torch.where``'s synchronisations), and the same for the stand-in forward the profiler
prices (planner.profile.moe.balanced_dispatch: the same rows per expert, no synchronisation).

    python3 bench/gpu_moe_profile.py [--micro-batch 8] [--experts 32] [--top-k 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from moe import MoEConfig, SparseMoE  # noqa: E402

from planner.profile.moe import balanced_dispatch  # noqa: E402


def run(layer: torch.nn.Module, x: torch.Tensor, steps: int) -> float:
    """Seconds per forward + backward (median of `steps`, after one warm-up)."""
    times = []
    for i in range(steps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def profile(name: str, layer: torch.nn.Module, x: torch.Tensor, top: int) -> None:
    wall = run(layer, x, 3)
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(layer, x, 1)
    events = prof.key_averages()
    device = sum(e.self_device_time_total for e in events) / 1e6 / 2  # two forward + backward ran
    print(f"== {name}: {wall * 1e3:.1f} ms per forward + backward; kernels {device * 1e3:.1f} ms "
          f"({device / wall:.0%} of it; the rest the device idle, waiting for the host)")
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--top", type=int, default=15, help="kernels listed per table")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/gpu_moe_profile.py needs a CUDA GPU")
    cfg = MoEConfig(dim=2048, n_layers=1, n_heads=16, n_kv_heads=8, ffn_dim=1024, vocab=50304, seq_len=4096,
                    n_experts=a.experts, top_k=a.top_k)
    torch.manual_seed(0)
    x = torch.randn(a.micro_batch, cfg.seq_len, cfg.dim, device="cuda", requires_grad=True)
    layer = SparseMoE(cfg).cuda()
    profile("the user's loop (torch.where per expert)", layer, x, a.top)
    holder = torch.nn.Module()
    holder.moe = layer
    if balanced_dispatch(holder):
        profile("the profiler's stand-in (balanced rows, no synchronisation)", holder.moe, x, a.top)


if __name__ == "__main__":
    main()
