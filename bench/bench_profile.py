"""How long profiling takes, and the peak memory of the process.

Each case runs in a fresh subprocess (`plan profile ... --json`), so its wall time includes
Python and torch start-up and its peak RSS is its own. Cases: GPT-2 small (124M + untied head)
materialised and timed on the local CPU, and Llama-2 7B and 70B on fake tensors (meta).

    python bench/bench_profile.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("GPT-2 small, materialised + timed", ["examples/gpt2_small.py"]),
    ("GPT-2 small, fake tensors (--meta)", ["examples/gpt2_small.py", "--meta"]),
    ("Llama-2 7B, fake tensors", ["examples/llama_7b.py"]),
    ("Llama-2 70B, fake tensors", ["examples/llama_70b.py"]),
]


def run_case(args: list[str]) -> tuple[float, float, dict]:
    """Wall seconds, peak RSS in MB (of this child alone, via wait4), and the profile JSON."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner.cli", "profile", *args, "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out_text = proc.stdout.read()
    err_text = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"plan profile {' '.join(args)} failed ({proc.returncode}): {err_text.strip()}")
    return wall, usage.ru_maxrss / 1024, json.loads(out_text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="runs per case; the median wall time is printed")
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores, torch threads default; each case a fresh process")
    print(f"{'case':40s} {'params':>8s} {'layers':>6s} {'wall s':>8s} {'in-profiler s':>13s} {'peak RSS MB':>12s}")
    for name, case in CASES:
        walls, peak, prof = [], 0.0, {}
        for _ in range(args.repeats):
            wall, peak, prof = run_case(case)
            walls.append(wall)
        print(
            f"{name:40s} {prof['totals']['num_params'] / 1e9:7.2f}B {len(prof['layers']):6d} "
            f"{statistics.median(walls):8.1f} {prof['profile_s']:13.1f} {peak:12.0f}"
        )


if __name__ == "__main__":
    main()
