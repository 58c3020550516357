"""How long the search takes (run_search: enumerate, prune, one ILP per surviving candidate),
against the number of layers and against the number of GPUs.

Models: examples/gpt.py's GPT at width 6144 (48 heads), sequence 2048, vocabulary 50304, with
12-128 blocks (48 blocks: 22.4 B parameters), each written to a temporary model file and
profiled once on fake tensors (measure=False; the profiling time is not part of the figures).
Cluster: H100 SXM 80 GB nodes of 8; memory limit the GPU's 80 GB; bf16 with AdamW.

- against layers: 12, 24, 48, 96, 128 blocks on 64 GPUs, global batch 128;
- against GPUs: the 48-block model on 8, 64, 512, 4096 GPUs, global batch 2 x GPUs.

Each search runs `--repeats` times (default 3); the search seconds printed are the median, the
other columns are from the last run (the search is deterministic up to its time limits). A search
that stops at its time budget (SEARCH_BUDGET_S) is not repeated: its time is the budget ('runs').

    python bench/bench_solve.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cost.setup import Training  # noqa: E402
from planner.hardware import make_cluster  # noqa: E402
from planner.model_file import load_model_file  # noqa: E402
from planner.profile import profile_model  # noqa: E402
from planner.profile.types import ModelProfile  # noqa: E402
from planner.search.search import SEARCH_BUDGET_S, SearchResult, run_search  # noqa: E402

GPU = "h100-sxm-80gb"
WIDTH, HEADS, SEQ, VOCAB = 6144, 48, 2048, 50304
LAYERS = (12, 24, 48, 96, 128)
LAYER_SWEEP_GPUS = 64
GPUS = (8, 64, 512, 4096)
GPU_SWEEP_LAYERS = 48

MODEL_FILE = """
import sys
sys.path.insert(0, {examples!r})
from gpt import GPTConfig, build_gpt, gpt_batch

CONFIG = GPTConfig(vocab={vocab}, seq_len={seq}, n_layer={layers}, n_head={heads}, n_embd={width})


def build_model():
    return build_gpt(CONFIG)


def sample_batch(batch_size):
    return gpt_batch(CONFIG, batch_size)
"""


def gpt_profile(folder: Path, layers: int) -> tuple[ModelProfile, float]:
    path = folder / f"gpt_{layers}.py"
    path.write_text(
        textwrap.dedent(
            MODEL_FILE.format(
                examples=str(ROOT / "examples"), vocab=VOCAB, seq=SEQ, layers=layers, heads=HEADS, width=WIDTH
            )
        )
    )
    start = time.perf_counter()
    profile = profile_model(load_model_file(path), batch_size=1, measure=False, force_meta=True)
    return profile, time.perf_counter() - start


def search(profile: ModelProfile, num_gpus: int, global_batch: int, repeats: int) -> tuple[SearchResult, float, int]:
    cluster = make_cluster(GPU, num_gpus)
    training = Training("bf16", "adamw", global_batch, cluster.gpu.memory_bytes)
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run_search(profile, cluster, training)
        seconds.append(time.perf_counter() - start)
        if result.budget_hit:  # the search stopped at its budget: that is its time, every run
            break
    return result, statistics.median(seconds), len(seconds)


HEADER = (
    f"{'layers':>6s} {'params':>7s} {'GPUs':>5s} {'batch':>5s} {'cands':>6s} {'pr.mem':>6s} {'pr.time':>7s} "
    f"{'ILPs':>5s} {'solver s':>8s} {'search s':>8s} {'runs':>4s}  {'status':22s} {'step s':>7s}  plan"
)


def row(layers: int, profile: ModelProfile, gpus: int, batch: int, result: SearchResult, median_s: float, runs: int) -> str:
    best = result.best
    plan = best.cand.label() if best else "nothing fits"
    step = f"{best.step_time_s:7.3f}" if best else f"{'-':>7s}"
    return (
        f"{layers:6d} {profile.num_params / 1e9:6.1f}B {gpus:5d} {batch:5d} {result.stats.enumerated:6d} "
        f"{result.pruned_memory:6d} {result.pruned_time:7d} {result.ilps:5d} {result.solver_s:8.2f} "
        f"{median_s:8.2f} {runs:4d}  {result.status:22s} {step}  {plan}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="searches per configuration; the median is printed")
    args = ap.parse_args()
    total = time.perf_counter()
    print(
        f"{os.cpu_count()} cores; GPT width {WIDTH}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}; {GPU}, "
        f"bf16 + AdamW, 80 GB limit; search budget {SEARCH_BUDGET_S:.0f} s; median of {args.repeats} searches"
    )
    profiles: dict[int, ModelProfile] = {}
    with tempfile.TemporaryDirectory() as tmp:
        took = []
        for layers in sorted(set(LAYERS) | {GPU_SWEEP_LAYERS}):
            profiles[layers], s = gpt_profile(Path(tmp), layers)
            took.append(f"{layers}: {s:.1f}s")
    print("profiling (fake tensors, not counted): " + ", ".join(took))

    results: dict[tuple[int, int], tuple[SearchResult, float, int, int]] = {}

    def run(layers: int, gpus: int, batch: int):
        if (layers, gpus) not in results:
            results[layers, gpus] = (*search(profiles[layers], gpus, batch, args.repeats), batch)
        return results[layers, gpus]

    print(f"\nSearch time against layers ({LAYER_SWEEP_GPUS} GPUs, global batch {2 * LAYER_SWEEP_GPUS})")
    print(HEADER)
    for layers in LAYERS:
        result, median_s, runs, batch = run(layers, LAYER_SWEEP_GPUS, 2 * LAYER_SWEEP_GPUS)
        print(row(layers, profiles[layers], LAYER_SWEEP_GPUS, batch, result, median_s, runs), flush=True)

    print(f"\nSearch time against GPUs ({GPU_SWEEP_LAYERS} layers, global batch 2 x GPUs)")
    print(HEADER)
    for gpus in GPUS:
        result, median_s, runs, batch = run(GPU_SWEEP_LAYERS, gpus, 2 * gpus)
        print(row(GPU_SWEEP_LAYERS, profiles[GPU_SWEEP_LAYERS], gpus, batch, result, median_s, runs), flush=True)

    print(
        "\ncands: candidates enumerated; pr.mem / pr.time: pruned by the memory / time bound before any ILP; "
        "ILPs: partition ILPs solved (last run); solver s: their seconds (last run); search s: run_search wall "
        f"seconds, median of 'runs' searches (1 when the search stopped at its budget); status 'feasible (time limit)': the {SEARCH_BUDGET_S:.0f} s search budget or an ILP's "
        "time limit was hit"
    )
    print(f"bench total {time.perf_counter() - total:.0f} s")


if __name__ == "__main__":
    main()
