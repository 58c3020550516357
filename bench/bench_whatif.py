"""How long `plan whatif` takes: 4 GPU types x 8 counts for Llama-2 70B (examples/llama_70b.py,
profiled once on fake tensors, the profile reused for all 32 points).

Types: a100-80gb, h100-sxm-80gb, h200, mi300x; counts 8, 16, ..., 1024; bf16, AdamW, the default
global batch (GPUs x the largest micro-batch that fits), 300 B tokens. Prints the profiling time,
the sweep's wall time (every point through planning.make_plan, plus the minimum-GPU search and the
answers) and the time per point, and the fastest and cheapest configurations.

    python bench/bench_whatif.py [--report /tmp/whatif_70b.html]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.model_file import load_model_file  # noqa: E402
from planner.report.whatif import SweepSpec, run_sweep  # noqa: E402
from planner.report.whatif_table import render_sweep  # noqa: E402

TYPES = ("a100-80gb", "h100-sxm-80gb", "h200", "mi300x")
COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
PRICES = (("a100-80gb", 1.8), ("h100-sxm-80gb", 3.5), ("h200", 4.5), ("mi300x", 3.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="also write the HTML report here")
    parser.add_argument("--table", action="store_true", help="print the sweep's table")
    args = parser.parse_args()
    handle = load_model_file(ROOT / "examples" / "llama_70b.py")
    spec = SweepSpec(gpu_types=TYPES, gpu_counts=COUNTS, tokens=300e9, prices_per_gpu_hour=PRICES, deadline_days=60)
    done: list[float] = []
    t0 = time.perf_counter()
    sweep = run_sweep(handle, spec, on_point=lambda label: done.append(time.perf_counter()))
    wall = time.perf_counter() - t0
    n = len(sweep.points)
    print(f"model: {sweep.model_name}, {sweep.num_params / 1e9:.2f} B parameters, profiled once in {sweep.profile_s:.1f} s")
    print(f"sweep: {len(TYPES)} types x {len(COUNTS)} counts = {n} points; {sum(p.fits for p in sweep.points)} fit")
    print(f"wall time: {wall:.1f} s in all (profile {sweep.profile_s:.1f} s + points and answers {sweep.sweep_s:.1f} s)")
    gaps = [b - a for a, b in zip([t0 + sweep.profile_s, *done[:-1]], done)]
    print(f"time per point: mean {sum(gaps) / n:.2f} s, slowest {max(gaps):.2f} s")
    for name, p in (("fastest", sweep.fastest), ("cheapest", sweep.cheapest), ("deadline 60 days", sweep.deadline_pick)):
        if p is not None:
            print(f"{name}: {p.label}: {p.plan}, {p.days_to_train:.1f} days, ${p.cost_usd:,.0f}")
    if args.table:
        render_sweep(sweep)
    if args.report:
        from planner.report.html_report import write_report

        t = time.perf_counter()
        write_report(sweep, args.report)
        print(f"report: {args.report} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
