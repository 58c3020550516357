"""What one NVIDIA GPU's kernels reach, against the figures the cost model uses for it.

Run on a machine with a CUDA GPU (bench/gpu_check.sh runs it first):

    python3 bench/gpu_kernels.py --gpu h200 [--out DIR]

Prints, and writes to DIR/gpu_kernels.json:
- bf16 matmuls: the large square GEMMs (the catalogue's `matmul_efficiency`, the MAMF figure) and
  the forward, input-gradient and weight-gradient GEMMs of Llama 3 8B and 70B Linears (70B as a
  tensor-parallel shard of 8), each measured against the planner's rate for that shape (the
  catalogue ceiling x planner/cost/gemm_shapes.py's table share; MATMUL_EFFICIENCY, the fitted share
  of a whole model's step, is left out: one GEMM alone has no step around it);
- FP8 matmuls (torch._scaled_mm, one scale per tensor, as torchao's Float8Linear runs them) at the
  same large shapes: the catalogue's `fp8_matmul_efficiency`;
- fused causal and full attention (SDPA; FlashAttention-2, cuDNN and memory-efficient back ends,
  and at 8K tokens the one this torch picks unasked), head width 128, 32 heads, 2K to 128K tokens
  per sequence, forward and backward: the catalogue's
  `attention_efficiency` (FlashAttention-2, which the runtime and torchtitan run) and
  `cudnn_attention_efficiency` (Transformer Engine's);
- a grid of GEMM shapes (rows 256 to 16,384, n and k 256 to 4,096) in bf16 and FP8: this GPU's own
  table of what a GEMM's shape costs (planner/cost/gemm_shapes.py's grid), beside the planner's share;
- grouped GEMMs (torch._grouped_mm, the runtime's experts) against one GEMM per expert, for 1 to
  128 experts sharing the same rows: what a local expert costs beyond its FLOPs;
- HBM bandwidth (a device-to-device copy) against the catalogue's;
- FP8 casts as torchao's compiled Float8 runs them (tensorwise: the absolute maximum, then the
  scaled, clamped copy in 8 bits), and with the transposed copy written too: their time against
  the cost model's (stage_costs.FP8_CAST_PASSES x the bf16 bytes at STREAM_EFFICIENCY of HBM);
- a large bf16 GEMM run back to back for 20 s: its rate in the first half second against the last
  five (and the SM clock where torch reads it), whether this GPU holds the MAMF figure (a short
  burst) under the sustained load of training or falls at its power limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.cost.gemm_shapes import TABLES, shape_efficiency  # noqa: E402
from planner.hardware import get_gpu  # noqa: E402


def timed_s(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() on the GPU (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def repeats_for(flops: float, rate: float = 5e14) -> int:
    """Enough calls for about 0.2 s of work, 3 to 20."""
    return int(min(20, max(3, 0.2 / max(flops / rate, 1e-6))))


def matmuls(gpu, results: list) -> None:
    table = TABLES.get(gpu.matmul_shapes)
    peak = gpu.peak("bf16")

    def one(label: str, m: int, n: int, k: int) -> None:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * n * k
        s = timed_s(lambda: a @ b, repeats_for(flops))
        share = shape_efficiency(table, m, n, k) if table else 1.0
        planned = peak * gpu.matmul_efficiency * share
        results.append({"kind": "bf16 matmul", "label": label, "m": m, "n": n, "k": k, "tflops": flops / s / 1e12,
                        "of_peak": flops / s / peak, "planned_tflops": planned / 1e12, "measured_over_planned": flops / s / planned})
        print(f"  {label:34} {m:6}x{n:6}x{k:6} {flops / s / 1e12:7.1f} TF/s  {flops / s / peak:5.1%} of peak  "
              f"planned {planned / 1e12:6.1f}  ratio {flops / s / planned:5.2f}", flush=True)

    print("bf16 matmuls (m x k) @ (k x n):")
    for side in (4096, 8192, 16384):
        one("square", side, side, side)
    for name, tokens, linears in (
            ("8B", 8192, (("wqkv", 6144, 4096), ("wo", 4096, 4096), ("w1", 14336, 4096), ("w2", 4096, 14336))),
            ("70B tp8", 8192, (("wqkv", 1280, 8192), ("wo", 8192, 1024), ("w1", 3584, 8192), ("w2", 8192, 3584)))):
        for lin, n, k in linears:
            one(f"{name} {lin} forward", tokens, n, k)
            one(f"{name} {lin} input grad", tokens, k, n)
            one(f"{name} {lin} weight grad", n, k, tokens)
        torch.cuda.empty_cache()


def fp8_matmuls(gpu, results: list) -> None:
    if not hasattr(torch, "float8_e4m3fn") or gpu.peak("fp8") is None:
        return
    peak = gpu.peak("fp8")
    print("fp8 matmuls (torch._scaled_mm, one scale per tensor):")
    one = torch.ones((), device="cuda")
    for m, n, k in ((8192, 8192, 8192), (16384, 16384, 16384), (8192, 14336, 4096), (8192, 4096, 14336)):
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        flops = 2 * m * n * k
        try:
            s = timed_s(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), repeats_for(flops, 1e15))
        except RuntimeError as e:
            print(f"  fp8 matmul not run: {str(e).splitlines()[0]}")
            return
        planned = peak * gpu.matmul_share("fp8")
        results.append({"kind": "fp8 matmul", "m": m, "n": n, "k": k, "tflops": flops / s / 1e12, "of_peak": flops / s / peak,
                        "planned_tflops": planned / 1e12, "measured_over_planned": flops / s / planned})
        print(f"  {m:6}x{n:6}x{k:6} {flops / s / 1e12:7.1f} TF/s  {flops / s / peak:5.1%} of fp8 peak  planned {planned / 1e12:6.1f}",
              flush=True)
        del a, b


def attention(gpu, results: list, seqs: tuple[int, ...]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    peak = gpu.peak("bf16")
    heads, dim, tokens = 32, 128, 131072
    backends = (("flash", SDPBackend.FLASH_ATTENTION, gpu.attention_efficiency),
                ("cudnn", SDPBackend.CUDNN_ATTENTION, gpu.cudnn_attention_efficiency),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION, None),
                ("default", None, None))  # what this torch picks unasked (constants.SDPA_CUDNN_FROM_TORCH)
    print(f"attention (SDPA, {heads} heads of {dim}, {tokens} tokens a call; TF/s forward, backward, both; share of the bf16 peak):")
    for seq in seqs:
        batch = max(1, tokens // seq)
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        for causal in (True, False):
            fwd_flops = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
            for name, backend, planned in backends:
                if name == "efficient" and seq > 16384 or name == "default" and seq != 8192:
                    continue
                try:
                    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        reps = repeats_for(3.5 * fwd_flops, 3e14)
                        fwd = timed_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), reps, warmup=1)
                        both = timed_s(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                                   (q, k, v), grad), reps, warmup=1)
                    del out
                except RuntimeError as e:
                    print(f"  {name:9} seq {seq:6} causal={causal!s:5}: not run ({str(e).splitlines()[0][:80]})")
                    continue
                bwd = max(both - fwd, 1e-9)
                share = 3.5 * fwd_flops / both / peak
                results.append({"kind": "attention", "backend": name, "seq": seq, "batch": batch, "causal": causal,
                                "fwd_tflops": fwd_flops / fwd / 1e12, "bwd_tflops": 2.5 * fwd_flops / bwd / 1e12,
                                "tflops": 3.5 * fwd_flops / both / 1e12, "of_peak": share, "planned_of_peak": planned})
                print(f"  {name:9} seq {seq:6} x{batch:<3} causal={causal!s:5} {fwd_flops / fwd / 1e12:6.1f} "
                      f"{2.5 * fwd_flops / bwd / 1e12:6.1f} {3.5 * fwd_flops / both / 1e12:6.1f} TF/s  {share:5.1%} "
                      f"(planned {planned if planned is None else f'{planned:.0%}'})", flush=True)
        del q, k, v, grad
        torch.cuda.empty_cache()


def grouped(gpu, results: list) -> None:
    if not hasattr(torch, "_grouped_mm"):
        return
    peak = gpu.peak("bf16")
    rows, hidden, width = 16384, 2048, 768  # Qwen3-30B-A3B's expert: 2048 -> 768 (x2 gate and up) -> 2048
    print(f"grouped GEMMs: {rows} routed rows, {hidden} -> {2 * width}, split evenly over E experts:")
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    for experts in (1, 8, 16, 32, 64, 128):
        w = torch.randn(experts, hidden, 2 * width, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
        flops = 2 * rows * hidden * 2 * width
        try:
            g = timed_s(lambda: torch._grouped_mm(x, w, offs=offs), 20)
        except RuntimeError as e:
            print(f"  grouped mm not run: {str(e).splitlines()[0][:80]}")
            return
        chunks = x.split(rows // experts)
        loop = timed_s(lambda: [c @ w[i] for i, c in enumerate(chunks)], 20)
        results.append({"kind": "grouped", "experts": experts, "grouped_s": g, "loop_s": loop, "flops": flops})
        print(f"  E={experts:4}: grouped {g * 1e6:8.1f} us ({flops / g / peak:5.1%} of peak)   one GEMM per expert "
              f"{loop * 1e6:8.1f} us ({flops / loop / peak:5.1%})", flush=True)
        del w


def hbm(gpu, results: list) -> None:
    a = torch.empty(2**30, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    s = timed_s(lambda: b.copy_(a), 10)
    rate = 2 * a.numel() * 4 / s
    results.append({"kind": "hbm copy", "GBps": rate / 1e9, "catalogue_GBps": gpu.hbm_bandwidth_Bps / 1e9})
    print(f"HBM copy: {rate / 1e9:7.0f} GB/s read + write, {rate / gpu.hbm_bandwidth_Bps:5.1%} of the catalogue's "
          f"{gpu.hbm_bandwidth_Bps / 1e9:.0f}", flush=True)


def casts(gpu, results: list, rows: int = 16384, cols: int = 8192) -> None:
    """A bf16 activation of rows x cols cast to FP8 e4m3 with one scale per tensor, compiled as
    torchao's Float8 casts are (an absolute-maximum reduction, then the scaled copy), and the same
    with its transpose written as well (Transformer Engine's cast_transpose): seconds against the
    cost model's, FP8_CAST_PASSES (FP8_CAST_TRANSPOSE_PASSES) x the bf16 bytes at STREAM_EFFICIENCY
    of the catalogue's HBM bandwidth."""
    from planner.cost.constants import STREAM_EFFICIENCY
    from planner.cost.stage_costs import FP8_CAST_PASSES, FP8_CAST_TRANSPOSE_PASSES

    if not hasattr(torch, "float8_e4m3fn"):
        raise RuntimeError("this torch has no float8_e4m3fn")
    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def cast(x):
        scale = fp8_max / x.abs().amax().float().clamp(min=1e-12)
        return (x.float() * scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), scale

    def cast_transpose(x):
        y, scale = cast(x)
        return y, y.t().contiguous(), scale

    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * 2
    for name, fn, passes in (("cast", torch.compile(cast), FP8_CAST_PASSES),
                             ("cast + transpose", torch.compile(cast_transpose), FP8_CAST_TRANSPOSE_PASSES)):
        s = timed_s(lambda: fn(x), 20, warmup=3)
        planned = passes * nbytes / (gpu.hbm_bandwidth_Bps * STREAM_EFFICIENCY)
        results.append({"kind": "fp8 cast", "variant": name, "rows": rows, "cols": cols, "seconds": s,
                        "planned_seconds": planned, "bf16_passes_at_hbm": s * gpu.hbm_bandwidth_Bps / nbytes})
        print(f"FP8 {name} of a {rows}x{cols} bf16 tensor: {s * 1e6:7.1f} us, the cost model {planned * 1e6:7.1f} us "
              f"({passes:g} passes at {STREAM_EFFICIENCY:.0%} of HBM; measured / planned {s / planned:.2f})", flush=True)


GRID_ROWS = (256, 512, 1024, 2048, 4096, 8192, 16384)
GRID_SIDES = (256, 512, 1024, 2048, 4096)


def shape_grid(gpu, results: list) -> None:
    """bf16 and FP8 GEMMs of rows x k @ k x n over planner/cost/gemm_shapes.py's grid (rows 256 to
    16,384, n and k 256 to 4,096), one GEMM each: this GPU's own table of what a GEMM's shape costs,
    in 16 bits and in 8, each entry beside the planner's share for it (the FP8 grid is what the
    cost model has no table of on Hopper: OpenXLA's sm_90 FP8 entries exceed the H100's FP8 peak)."""
    table = TABLES.get(gpu.matmul_shapes)
    fp8 = hasattr(torch, "float8_e4m3fn") and "fp8" in gpu.peak_flops
    one = torch.ones((), device="cuda")
    print("GEMM grid (rows x n x k, TF/s: bf16, fp8 with one scale per tensor):")
    for rows in GRID_ROWS:
        for n in GRID_SIDES:
            for k in GRID_SIDES:
                flops = 2 * rows * n * k
                a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                bf16 = flops / timed_s(lambda: a @ b, repeats_for(flops)) / 1e12
                entry = {"kind": "gemm grid", "rows": rows, "n": n, "k": k, "bf16_tflops": bf16,
                         "planned_share": shape_efficiency(table, rows, n, k) if table else None}
                if fp8:
                    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn)
                    try:
                        s8 = timed_s(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16),
                                     repeats_for(flops, 1e15))
                        entry["fp8_tflops"] = flops / s8 / 1e12
                    except RuntimeError as e:  # a shape the FP8 kernels refuse: the rest still measured
                        entry["fp8_error"] = str(e).splitlines()[0]
                results.append(entry)
                print(f"  {rows:6}x{n:5}x{k:5} {bf16:7.1f} {entry.get('fp8_tflops', float('nan')):7.1f}", flush=True)
        torch.cuda.empty_cache()


def sustained(gpu, results: list, seconds: float = 20.0, side: int = 8192) -> None:
    """bf16 side^3 GEMMs back to back for `seconds`, timed ten at a time: the median rate of the
    first half second against that of the last five, with the SM clock (MHz) torch reads through
    NVML where it can. The catalogue's matmul ceiling is a burst (mamf-finder times each shape
    briefly); a step of training keeps the tensor cores busy for seconds."""
    a = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    flops, batch = 2 * side**3, 10

    def clock() -> float | None:
        try:
            return float(torch.cuda.clock_rate())
        except Exception:  # no NVML here: the rates alone
            return None

    samples = []  # (seconds since the start, TF/s, MHz)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            a @ b
        end.record()
        end.synchronize()
        samples.append((time.perf_counter() - t0, batch * flops / (start.elapsed_time(end) / 1e3) / 1e12, clock()))

    def window(lo: float, hi: float) -> tuple[float, float | None]:
        inside = [s for s in samples if lo <= s[0] < hi] or samples[:1]
        clocks = [s[2] for s in inside if s[2] is not None]
        return statistics.median(s[1] for s in inside), (statistics.median(clocks) if clocks else None)

    (first, first_mhz), (last, last_mhz) = window(0.0, 0.5), window(seconds - 5.0, seconds + 1.0)
    peak = gpu.peak("bf16")
    results.append({"kind": "sustained bf16 matmul", "side": side, "seconds": seconds, "first_tflops": first,
                    "last_tflops": last, "first_mhz": first_mhz, "last_mhz": last_mhz, "of_peak_first": first * 1e12 / peak,
                    "of_peak_last": last * 1e12 / peak, "catalogue_share": gpu.matmul_efficiency})
    mhz = f"; SM clock {first_mhz:.0f} -> {last_mhz:.0f} MHz" if first_mhz and last_mhz else ""
    print(f"sustained bf16 {side}^3 GEMMs for {seconds:.0f} s: first 0.5 s {first:.1f} TF/s ({first * 1e12 / peak:.1%} of peak), "
          f"last 5 s {last:.1f} ({last * 1e12 / peak:.1%}; ratio {last / first:.3f}){mhz}; "
          f"catalogue ceiling {gpu.matmul_efficiency:.1%}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="h200", help="catalogue name of this GPU (default h200)")
    p.add_argument("--out", type=Path, default=Path("/tmp/gpu_check"))
    p.add_argument("--seqs", default="2048,8192,32768,131072")
    p.add_argument("--only", default="hbm,casts,matmul,sustained,fp8,grouped,attention,grid")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py: no CUDA GPU here")
    gpu = get_gpu(a.gpu)
    print(f"{torch.cuda.get_device_name()} (catalogue: {gpu.name}), torch {torch.__version__}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    results: list = []
    steps = {"hbm": lambda: hbm(gpu, results), "matmul": lambda: matmuls(gpu, results), "fp8": lambda: fp8_matmuls(gpu, results),
             "grid": lambda: shape_grid(gpu, results), "sustained": lambda: sustained(gpu, results),
             "casts": lambda: casts(gpu, results),
             "attention": lambda: attention(gpu, results, tuple(int(s) for s in a.seqs.split(","))),
             "grouped": lambda: grouped(gpu, results)}
    for name in a.only.split(","):
        t = time.time()
        try:
            steps[name]()
        except Exception as e:  # one part failing keeps the others' figures
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
        print(f"  ({name}: {time.time() - t:.0f} s)", flush=True)
        (a.out / "gpu_kernels.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                            "results": results}, indent=1))


if __name__ == "__main__":
    main()
