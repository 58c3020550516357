"""The cost model against published training runs (bench/reference/published_runs.yaml).

For every row: build the model the row describes on fake tensors (profiled once per shape), fix
the published configuration (tp, pp, dp, micro-batch, ZeRO/FSDP stage, schedule, recompute) on
the row's cluster (its GPU, GPU count, GPUs per node and, when given, inter-node bandwidth per
GPU), predict step time and peak memory, and compare with what was measured. Prints one table,
then per source and overall: count, median and worst |error| for step time and peak memory, the
rows the cost model refused ("nothing fits"), and how many rows were approximated; then the
signed median per GPU type and trainer (where the model leans one way).

    python bench/bench_published.py             # the table (about a minute on 2 cores)
    python bench/bench_published.py --free      # + the free search's own plan for each row
    python bench/bench_published.py --fit       # grid-search MATMUL_/MEMORY_EFFICIENCY and OVERLAP_CONTENTION on all rows
    python bench/bench_published.py --loso      # leave one source out: fit on the others, predict it
    python bench/bench_published.py --only megatron_lm,torchtitan   # some sources (or row ids) only

--only takes sources (narayanan2021_t1, narayanan2021_t2, korthikanti2022, megatron_lm,
torchtitan, llm_foundry) or row ids, comma-separated.

This file is the command line; the work is in bench/published/:
- rows.py: the YAML -> rows (model shape, cluster, Fixed configuration, measured figures), the
  source of each row, and what the cost model cannot express yet, approximated and named in the
  note column (Megatron's selective recompute, schedules it lacks, GPUs not in the catalogue),
  and what each row's trainer does (its FP8 recipe, recompute, fused kernels, overlap);
- models.py: the model file of each row's shape (examples/gpt.py with Megatron-LM's 2021-22
  attention or flash attention, examples/llama.py, MPT from gpt.py's blocks), and what each
  approximates;
- predict.py: the profile of each shape (once per run, in worker processes) and the prediction
  of a row's published configuration (and, with --free, the free search's plan, and the free
  search's plan with the row's recompute kept: the trainers' full recompute is most of the gap);
- report.py: the table and the per-source summary;
- fit.py: --fit and --loso, the grid search of MATMUL_EFFICIENCY, MEMORY_EFFICIENCY and
  OVERLAP_CONTENTION (each row's solved assignment re-evaluated under each grid point; mean
  |log(predicted / measured)|).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.published.fit import fit  # noqa: E402
from bench.published.predict import Profiles, predict_all  # noqa: E402
from bench.published.report import print_summary, print_table  # noqa: E402
from bench.published.rows import REFERENCE, load_rows  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--free", action="store_true", help="also run the free search on each row's model, cluster and batch (with its trainer's TP overlap, where it has one)")
    ap.add_argument("--fit", action="store_true", help="grid-search MATMUL_EFFICIENCY, MEMORY_EFFICIENCY and OVERLAP_CONTENTION on all rows")
    ap.add_argument("--loso", action="store_true", help="leave one source out: fit on the others, predict it (implies --fit)")
    ap.add_argument("--only", default=None, help="comma-separated sources (or row ids) to run")
    ap.add_argument("--jobs", type=int, default=2, help="processes that profile the models (default 2)")
    ap.add_argument("--reference", type=Path, default=REFERENCE, metavar="FILE",
                    help="the runs to predict: a YAML file in the reference's schema (default: this repository's copy, "
                         "bench/reference/published_runs.yaml; bench/reference/held_out_runs.yaml holds runs no "
                         "constant was fitted on)")
    args = ap.parse_args(argv)
    if not args.reference.is_file():
        ap.error(f"--reference {args.reference}: no such file")
    start = time.perf_counter()
    unread: list[tuple[str, str]] = []
    try:
        rows = load_rows(args.reference, unread)
    except (yaml.YAMLError, KeyError, TypeError) as exc:  # not YAML, or no list of entries
        ap.error(f"--reference {args.reference}: not a file of runs in the reference's schema "
                 f"({type(exc).__name__}: {str(exc).splitlines()[0]})")
    for row_id, why in unread:
        print(f"not read: {row_id}: {why}")
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if r.source in wanted or r.id in wanted]
    profiles = Profiles()
    profiles.prefetch(rows, workers=max(1, min(args.jobs, os.cpu_count() or 1)))
    unexpressed: list[tuple[str, str]] = []
    results = predict_all(rows, profiles, free=args.free, unexpressed=unexpressed)
    for row_id, why in unexpressed:
        print(f"not expressed: {row_id}: {why}")
    print_table(results)
    print_summary(results)
    predict_s = sum(r.seconds for r in results)
    free_s = sum(r.free_s or 0.0 for r in results)
    print(
        f"\n{len(rows)} rows" + (f" ({len(unread)} not read, named above)" if unread else "")
        + (f" ({len(unexpressed)} whose configuration the planner cannot express, named above)" if unexpressed else "") + f"; {len(profiles.cache)} distinct models profiled in {profiles.seconds:.1f} s; "
        f"published configurations predicted in {predict_s:.1f} s" + (f"; free searches {free_s:.1f} s" if args.free else "")
    )
    if args.fit or args.loso:
        fit(results, profiles, loso=args.loso)
    print(f"bench took {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
