"""The runtime on this CPU: its overhead against a hand-written DDP loop, and measured against
predicted step time and memory for a handful of plans (gloo, one process per planned device),
with the rank correlation (Kendall tau) of predicted and measured step times. Run
`plan calibrate --gpu cpu` first to plan with this machine's measured figures.

    python bench/bench_runtime.py [--steps 6] [--model examples/gpt.py]

Each run is a fresh torchrun launch; step times are medians after one warm-up step. CPU timings
on a shared 2-core machine move 5-10% run to run: read the ratios, not the third digit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.model_file import load_model_file  # noqa: E402
from planner.planning import PlanRequest, make_plan  # noqa: E402
from planner.search.space import Fixed  # noqa: E402
from runtime.launch import free_port, launch  # noqa: E402

PLANS = [  # (label, world size, fixed choices)
    ("DDP dp=2", 2, Fixed(dp=2, tp=1, pp=1, zero=0)),
    ("FSDP dp=2 ZeRO-3", 2, Fixed(dp=2, tp=1, pp=1, zero=3)),
    ("TP tp=2", 2, Fixed(dp=1, tp=2, pp=1)),
    ("DDP dp=2, full recompute", 2, Fixed(dp=2, tp=1, pp=1, zero=0, recompute="full")),
    ("DDP dp=2, selective recompute", 2, Fixed(dp=2, tp=1, pp=1, zero=0, recompute="selective")),
    ("ZeRO-1 dp=2", 2, Fixed(dp=2, tp=1, pp=1, zero=1)),
    ("PP pp=2 1F1B, 4 micro-batches", 2, Fixed(dp=1, tp=1, pp=2, micro_batch=2, schedule="1f1b")),
    ("DDP dp=4", 4, Fixed(dp=4, tp=1, pp=1, zero=0)),
    ("TP tp=2 x dp=2", 4, Fixed(dp=2, tp=2, pp=1, zero=0)),
]


def plan_file(handle, world: int, fixed: Fixed, global_batch: int, tmp: Path, label: str) -> Path:
    if fixed.micro_batch is None:  # one micro-batch per step unless the row says otherwise
        fixed = Fixed(**{**vars(fixed), "micro_batch": global_batch // (fixed.dp or 1)})
    request = PlanRequest(gpus=world, gpu="cpu", global_batch=global_batch, precision="fp32", optimizer="adamw", fixed=fixed)
    path = tmp / (label.replace(" ", "_").replace(",", "").replace("=", "") + ".json")
    path.write_text(make_plan(handle, request).to_json())
    return path


def baseline(model: Path, world: int, micro_batch: int, steps: int, tmp: Path) -> float:
    out = tmp / f"baseline_{world}.json"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(ROOT / "bench" / "ddp_baseline.py"), str(model), str(micro_batch), str(steps), str(out)],
        check=True, capture_output=True, cwd=ROOT,
    )
    return json.loads(out.read_text())["step_time_s"]


def kendall_tau(pairs: list[tuple[float, float]]) -> float:
    """Kendall's tau-a between the two orders: (concordant - discordant) pairs over all pairs."""
    score, total = 0, 0
    for i in range(len(pairs)):
        for j in range(i + 1, len(pairs)):
            a = pairs[i][0] - pairs[j][0]
            b = pairs[i][1] - pairs[j][1]
            score += (a * b > 0) - (a * b < 0)
            total += 1
    return score / total if total else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default=str(ROOT / "examples" / "gpt.py"))
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()
    handle = load_model_file(args.model)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"{handle.name}, global batch {args.global_batch}, {args.steps} steps per run, fp32, AdamW, gloo")
        print(f"{'plan':32s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s} {'pred. mem':>10s} {'meas. mem':>10s} {'ratio':>6s}")
        ddp2_path = None
        pairs = []
        for label, world, fixed in PLANS:
            path = plan_file(handle, world, fixed, args.global_batch, tmp, label)
            report = launch([path], world, steps=args.steps, run_dir=tmp / path.stem).reports[0]
            pred, meas = report.predicted, report.measured
            pairs.append((pred.step_time_s, meas.step_time_s))
            mem = max(meas.peak_memory_bytes)
            print(
                f"{label:32s} {pred.step_time_s:9.3f}s {meas.step_time_s:9.3f}s {meas.step_time_s / pred.step_time_s:6.2f} "
                f"{pred.peak_memory_bytes / 1e9:9.2f}G {mem / 1e9:9.2f}G {mem / pred.peak_memory_bytes:6.2f}",
                flush=True,
            )
            for warning in report.warnings:  # where the run differs from what the plan assumed
                print(f"    warning: {warning}")
            if label == "DDP dp=2":
                ddp2_path = path
        ratios = sorted(m / p for p, m in pairs)
        print(f"measured / predicted step time: median {statistics.median(ratios):.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}, "
              f"within 15%: {sum(abs(r - 1) <= 0.15 for r in ratios)} of {len(ratios)}; "
              f"Kendall tau (order of predicted against measured) {kendall_tau(pairs):.2f}")
        # The overhead: the runtime's DDP and a hand-written DDP loop back to back, three times over
        # (the load on a shared machine drifts over minutes): the median of the pairs' ratios.
        ratios = []
        for _ in range(3):
            ours = launch([ddp2_path], 2, steps=args.steps, run_dir=tmp / "overhead").reports[0].measured.step_time_s
            base = baseline(Path(args.model), 2, args.global_batch // 2, args.steps, tmp)
            ratios.append(ours / base)
            print(f"hand-written DDP loop, dp=2: {base:.3f} s per step; runtime's DDP dp=2: {ours:.3f} s; ratio {ours / base:.2f}")
        print(f"runtime / hand-written DDP (median of {len(ratios)} back-to-back pairs) = {statistics.median(ratios):.2f}")
    print(f"bench total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
