"""How long profiling takes, and the peak memory of the process.

Each case runs in a fresh subprocess (`plan profile ... --json`), so its wall time includes
Python and torch start-up and its peak RSS is its own. Cases: GPT-2 small (124M + untied head)
materialised and timed on the local CPU, and Llama-2 7B, 70B and GPT-3 175B on fake tensors (meta).

Then the shortcut for stacks of identical blocks (planner/profile/repeats.py): the profile time of
the models with the longest stacks, traced through 4 blocks per stack against every block, each
a fresh process, and the ratio. The profiles must be equal (the run fails otherwise). Last, the
wall time of the whole `plan` of the 175B GPT on 1,024 A100s (the issue's target: under 10 s).

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

from planner.profile.repeats import MIN_BLOCKS

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("GPT-2 small, materialised + timed", ["examples/gpt2_small.py"]),
    ("GPT-2 small, fake tensors (--meta)", ["examples/gpt2_small.py", "--meta"]),
    ("Llama-2 7B, fake tensors", ["examples/llama_7b.py"]),
    ("Llama-2 70B, fake tensors", ["examples/llama_70b.py"]),
    ("GPT-3 175B, fake tensors", ["examples/gpt_175b.py"]),
]
SHORTCUT_CASES = [
    ("Llama-2 70B (80 blocks)", "examples/llama_70b.py"),
    ("GPT-3 175B (96 blocks)", "examples/gpt_175b.py"),
]
# One profile on fake tensors in a fresh process; prints its time in the profiler and a digest of
# the profile (every field but the time), so that the two ways can be checked equal.
SHORTCUT_SCRIPT = """
import hashlib, json, sys
from planner.model_file import load_model_file
from planner.profile import profile_model
kw = {"reuse_min_blocks": None} if sys.argv[2] == "every" else {}
p = profile_model(load_model_file(sys.argv[1]), force_meta=True, measure=False, **kw)
data = json.loads(p.to_json()); data.pop("profile_s")
print(json.dumps({"profile_s": p.profile_s, "digest": hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()}))
"""


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


def shortcut_case(path: str, reuse: str) -> tuple[float, float, str]:
    """(wall s, in-profiler s, digest) of one fresh process; `reuse` "every" traces every block,
    "default" takes profile_model's default (the shortcut for stacks of MIN_BLOCKS or more)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", SHORTCUT_SCRIPT, path, reuse], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"profiling {path} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return wall, out["profile_s"], out["digest"]


def shortcut_table(repeats: int) -> None:
    print(f"\nstacks of >= {MIN_BLOCKS} identical blocks traced through 4 of them (repeats.py) against every block;"
          " in-profiler seconds (wall of the process), median of the runs")
    print(f"{'model':28s} {'every block s':>16s} {'4 blocks s':>14s} {'ratio':>6s}  profiles")
    for name, path in SHORTCUT_CASES:
        runs = {way: [shortcut_case(path, way) for _ in range(repeats)] for way in ("every", "default")}
        digests = {r[2] for way in runs.values() for r in way}
        if len(digests) != 1:
            raise SystemExit(f"{path}: the shortcut changed the profile ({len(digests)} different digests)")
        (full_wall, full_s), (fast_wall, fast_s) = (
            (statistics.median(r[0] for r in runs[w]), statistics.median(r[1] for r in runs[w])) for w in runs
        )
        print(f"{name:28s} {full_s:6.2f} ({full_wall:5.1f}) {fast_s:6.2f} ({fast_wall:5.1f}) {full_s / fast_s:5.1f}x  equal")


PLAN_175B = ["examples/gpt_175b.py", "--gpus", "1024", "--gpu", "a100-80gb"]


def plan_table(repeats: int) -> None:
    """Wall seconds of the whole `plan` command (load, profile, search, report), a fresh process each."""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "planner.cli", *PLAN_175B], cwd=ROOT, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"plan {' '.join(PLAN_175B)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    print(f"\nplan {' '.join(PLAN_175B)}: {statistics.median(walls):.1f} s wall (median of {repeats}; target < 10 s)")


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
    shortcut_table(args.repeats)
    plan_table(args.repeats)


if __name__ == "__main__":
    main()
