"""The runtime on this CPU: its overhead against a hand-written DDP loop, and measured against
predicted step time and memory for a handful of plans (gloo, one process per planned device),
with the rank correlation (Kendall tau) of predicted and measured step times. Run
`plan calibrate --gpu cpu` first to plan with this machine's measured figures.

    python bench/bench_runtime.py [--steps 10] [--repeats 3] [--model examples/gpt.py]
    python bench/bench_runtime.py --refit [--calibrate]   # does refitting from run reports converge?

Every plan is made from one profile of the model. Each run is a fresh torchrun launch; its step
time is the runtime's (the median over the later half of the steps after the first, the last
profiled apart: runtime.train.timed_steps), and each plan runs --repeats times (in rounds over all the
plans; its figure is the median). CPU timings on a shared 2-core machine move 5-15% run to run: the
bench prints that spread, and how the prediction orders the pairs of plans measured further apart.

Each plan is predicted three times: before calibration (with the machine's quick benchmark alone:
matmul, copy and one gloo all-reduce), as planned (with `plan calibrate`'s figures), and with the
phase factors `plan calibrate --from-run` refits from the runs of the other plans only (leave one plan
out: no prediction has seen its own plan's runs), as a user's next plan on the machine would be.
"""

from __future__ import annotations

import argparse
import itertools
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
from planner.planning import PlanRequest, make_plan, profile_for  # noqa: E402
from planner.search.space import Fixed  # noqa: E402
from runtime.launch import free_port, launch  # noqa: E402

PLANS = [  # (label, world size, fixed choices)
    ("DDP dp=2", 2, Fixed(dp=2, tp=1, pp=1, zero=0)),
    ("FSDP dp=2 ZeRO-3", 2, Fixed(dp=2, tp=1, pp=1, zero=3)),
    ("FSDP dp=2 ZeRO-3, 4 micro-batches", 2, Fixed(dp=2, tp=1, pp=1, zero=3, micro_batch=1)),
    ("TP tp=2", 2, Fixed(dp=1, tp=2, pp=1)),
    ("DDP dp=2, full recompute", 2, Fixed(dp=2, tp=1, pp=1, zero=0, recompute="full")),
    ("DDP dp=2, selective recompute", 2, Fixed(dp=2, tp=1, pp=1, zero=0, recompute="selective")),
    ("ZeRO-1 dp=2", 2, Fixed(dp=2, tp=1, pp=1, zero=1)),
    ("PP pp=2 1F1B, 4 micro-batches", 2, Fixed(dp=1, tp=1, pp=2, micro_batch=2, schedule="1f1b")),
    ("PP pp=2 GPipe, 1 micro-batch", 2, Fixed(dp=1, tp=1, pp=2, micro_batch=8, schedule="gpipe")),
    ("DDP dp=4", 4, Fixed(dp=4, tp=1, pp=1, zero=0)),
    ("TP tp=2 x dp=2", 4, Fixed(dp=2, tp=2, pp=1, zero=0)),
]


def _request(world: int, fixed: Fixed, global_batch: int) -> PlanRequest:
    if fixed.micro_batch is None:  # one micro-batch per step unless the row says otherwise
        fixed = Fixed(**{**vars(fixed), "micro_batch": global_batch // (fixed.dp or 1)})
    return PlanRequest(gpus=world, gpu="cpu", global_batch=global_batch, precision="fp32", optimizer="adamw", fixed=fixed)


def plan_files(handle, global_batch: int, tmp: Path, tag: str = "") -> list[Path]:
    """Every plan of PLANS from one profile of the model (as the planner ranks its candidates: a
    profile per plan would time each one's layers afresh, and their order would move with that)."""
    profile = profile_for(handle, _request(*PLANS[0][1:], global_batch))
    paths = []
    for label, world, fixed in PLANS:
        path = tmp / ((tag + " " + label).strip().replace(" ", "_").replace(",", "").replace("=", "") + ".json")
        path.write_text(make_plan(handle, _request(world, fixed, global_batch), profile).to_json())
        paths.append(path)
    return paths


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


def summary(what: str, pairs: list[tuple[float, float]], spread: float | None) -> None:
    """Measured over predicted step time and the orders' agreement (Kendall tau) of (predicted,
    measured) `pairs`; with `spread` (the run-to-run noise), also over the pairs of plans measured
    further apart than it (the order the machine itself can tell)."""
    ratios = sorted(m / p for p, m in pairs)
    line = (f"{what}: measured / predicted step time median {statistics.median(ratios):.2f}, range {ratios[0]:.2f}-"
            f"{ratios[-1]:.2f}, within 15%: {sum(abs(r - 1) <= 0.15 for r in ratios)} of {len(ratios)}; Kendall tau "
            f"{kendall_tau(pairs):.2f}")
    if spread is not None:
        apart = [(a, b) for a, b in itertools.combinations(pairs, 2) if max(a[1], b[1]) / min(a[1], b[1]) - 1 > spread]
        concordant = sum((a[0] - b[0]) * (a[1] - b[1]) > 0 for a, b in apart)
        line += (f"; of the {len(apart)} pairs measured further apart than the spread, {concordant} ordered as measured "
                 f"(tau {(2 * concordant - len(apart)) / max(1, len(apart)):.2f})")
    print(line)


def uncalibrated_predictions(handle, global_batch: int, tmp: Path) -> list[float]:
    """Each plan's predicted step time before `plan calibrate`: made with this machine's quick
    benchmark alone (its cached matmul, copy and gloo all-reduce figures, in a temporary cache
    without the calibration), as a user's first plan on the machine is."""
    import os
    import shutil

    from planner.local_device import cache_path

    cache = tmp / "uncalibrated"
    (cache / "parallel-planner").mkdir(parents=True)
    shutil.copy(cache_path(), cache / "parallel-planner" / cache_path().name)
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        return [json.loads(p.read_text())["predicted"]["step_time_s"] for p in plan_files(handle, global_batch, cache)]
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before


def reports_cpu_factors() -> tuple:
    """The phase factors this machine's plans are made with (plan calibrate --from-run's; () none)."""
    from planner.local_device import measure_local_cpu

    return measure_local_cpu().phase_factors


def run_all(handle, args, tmp: Path, tag: str) -> list:
    """Every plan of PLANS made with this machine's current calibration, each run once: the reports."""
    paths = plan_files(handle, args.global_batch, tmp, tag)
    return [launch([path], world, steps=args.steps, run_dir=tmp / path.stem).reports[0]
            for path, (_, world, _) in zip(paths, PLANS)]


def refit_rounds(handle, args, tmp: Path) -> None:
    """Does refitting converge? In a calibration of its own (a copy of this machine's, in a
    temporary cache; with --calibrate, `plan calibrate --gpu cpu` first): round 1 plans and runs
    every plan, `plan calibrate --from-run` refits the phase factors from those reports; round 2
    plans them again with the refit factors, runs them, and refits again from both rounds' reports.
    The second refit's change to round 2's predictions is set against the noise: how much the same
    plan's measured step moved between the two rounds' launches."""
    import os
    import shutil

    cache = tmp / "cache"
    (cache / "parallel-planner").mkdir(parents=True)
    mine = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parallel-planner"
    for name in ("local_cpu.json", "local_cpu_calibration.json"):
        if (mine / name).exists():
            shutil.copy(mine / name, cache / "parallel-planner" / name)
    os.environ["XDG_CACHE_HOME"] = str(cache)  # the launched ranks and this process read it
    from planner.local_device import measure_local_cpu, store_phase_factors
    from runtime.calibrate import refit

    if args.calibrate:
        subprocess.run([sys.executable, "-m", "planner.cli", "calibrate", "--gpu", "cpu", "--gpus", "4"], check=True,
                       capture_output=True, cwd=ROOT)
    factors = dict(measure_local_cpu().phase_factors)
    rounds, pooled = [], []
    for n in (1, 2):
        reports = run_all(handle, args, tmp, f"round{n}")
        pooled += reports  # a refit takes every run made so far (each freed of its plan's factors)
        new, fitted = refit(pooled, factors)
        rounds.append((factors, reports, new, fitted[-len(reports):]))
        store_phase_factors(new, f"bench_runtime round {n}")
        factors = new
    print(f"{'plan':32s} {'round 1: predicted':>18s} {'measured':>9s} | {'round 2: predicted':>18s} {'measured':>9s} "
          f"{'2nd refit':>9s} | {'refit change':>12s} {'run-to-run':>10s}")
    changes, noise = [], []
    for i, (label, _, _) in enumerate(PLANS):
        r1, r2, (_, p1, _, _), (_, p2, q2, _) = rounds[0][1][i], rounds[1][1][i], rounds[0][3][i], rounds[1][3][i]
        m1, m2 = r1.measured.step_time_s, r2.measured.step_time_s
        changes.append(abs(q2 / p2 - 1))
        noise.append(abs(m2 / m1 - 1))
        print(f"{label:32s} {p1:17.3f}s {m1:8.3f}s | {p2:17.3f}s {m2:8.3f}s {q2:8.3f}s | {q2 / p2 - 1:+12.1%} {m2 / m1 - 1:+10.1%}")
    for n, (old, reports, new, _) in enumerate(rounds, 1):
        pairs = [(r.predicted.step_time_s, r.measured.step_time_s) for r in reports]
        ratios = sorted(m / p for p, m in pairs)
        print(f"round {n}: factors {', '.join(f'{k} {v:.2f}' for k, v in sorted(old.items())) or 'none'}; measured / predicted "
              f"median {statistics.median(ratios):.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}, within 15%: "
              f"{sum(abs(r - 1) <= 0.15 for r in ratios)} of {len(ratios)}; Kendall tau {kendall_tau(pairs):.2f}; "
              f"refit to {', '.join(f'{k} {v:.2f}' for k, v in sorted(new.items()))}")
    print(f"second refit's change to the predictions: median {statistics.median(changes):.1%}, largest {max(changes):.1%}; "
          f"run-to-run noise of the same plans' measured steps: median {statistics.median(noise):.1%}, largest {max(noise):.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default=str(ROOT / "examples" / "gpt.py"))
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="launches of each plan (default 3), in rounds over all plans")
    ap.add_argument("--refit", action="store_true", help="instead: two rounds of runs and refits (does refitting converge?)")
    ap.add_argument("--calibrate", action="store_true", help="with --refit: run `plan calibrate --gpu cpu` first (in the copy)")
    args = ap.parse_args()
    handle = load_model_file(args.model)
    start = time.perf_counter()
    if args.refit:
        with tempfile.TemporaryDirectory() as d:
            refit_rounds(handle, args, Path(d))
        print(f"bench total {time.perf_counter() - start:.0f} s")
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"{handle.name}, global batch {args.global_batch}, {args.steps} steps per run, fp32, AdamW, gloo")
        uncalibrated = uncalibrated_predictions(handle, args.global_batch, tmp)
        paths = plan_files(handle, args.global_batch, tmp)
        # each plan launched --repeats times, the rounds one after another (the machine's load
        # drifts over minutes: interleaving spreads it over every plan), each round starting a
        # further share of the list on (the first launches after a pause read slow; no plan is
        # always first): the median of a plan's runs
        runs: list[list] = [[] for _ in PLANS]
        for n in range(args.repeats):
            first = n * -(-len(PLANS) // args.repeats) % len(PLANS)
            for i in [*range(first, len(PLANS)), *range(first)]:
                path, (label, world, _) = paths[i], PLANS[i]
                runs[i].append(launch([path], world, steps=args.steps, run_dir=tmp / f"{path.stem}.{n}").reports[0])
                print(f"  round {n + 1}: {label}: {runs[i][-1].measured.step_time_s:.3f} s", flush=True)
        # after calibration from runs: each plan predicted with the phase factors refit from the
        # other plans' runs alone (plan calibrate --from-run; leave one plan out), so no plan's
        # prediction has seen its own measurement
        from runtime.calibrate import predict_with, refit

        old = dict(reports_cpu_factors())
        refits = []
        for i in range(len(PLANS)):
            others = [r for j, reports in enumerate(runs) if j != i for r in reports]
            refits.append(predict_with(runs[i][0], refit(others, old)[0]))
        print(f"{'plan':34s} {'uncalib.':>8s} {'ratio':>6s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s} {'runs':>15s} "
              f"{'refit':>8s} {'ratio':>6s} {'pred. mem':>10s} {'meas. mem':>10s} {'ratio':>6s}")
        pairs, after, first, noise = [], [], [], []
        for (label, _, _), reports, again, guess in zip(PLANS, runs, refits, uncalibrated):
            pred, steps = reports[0].predicted, [r.measured.step_time_s for r in reports]
            meas = statistics.median(steps)
            pairs.append((pred.step_time_s, meas))
            after.append((again, meas))
            first.append((guess, meas))
            noise.append(max(steps) / min(steps) - 1)
            mem = max(max(r.measured.peak_memory_bytes) for r in reports)
            print(
                f"{label:34s} {guess:7.3f}s {meas / guess:6.2f} {pred.step_time_s:9.3f}s {meas:9.3f}s {meas / pred.step_time_s:6.2f} "
                f"{'/'.join(f'{t:.2f}' for t in steps):>15s} {again:7.3f}s {meas / again:6.2f} "
                f"{pred.peak_memory_bytes / 1e9:9.2f}G {mem / 1e9:9.2f}G {mem / pred.peak_memory_bytes:6.2f}"
            )
            for warning in reports[0].warnings:  # where the run differs from what the plan assumed
                print(f"    warning: {warning}")
        spread = statistics.median(noise)
        if args.repeats > 1:
            print(f"run-to-run spread of a plan's step (max / min of its {args.repeats} runs - 1): median {spread:.1%}, "
                  f"largest {max(noise):.1%}")
        for what, figures in (("before calibration", first), ("plan calibrate", pairs),
                              ("+ refit from the other plans' runs", after)):
            summary(what, figures, spread if args.repeats > 1 else None)
        print("phase factors refit from every run: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(refit([r for rs in runs for r in rs], old)[0].items())))
        ddp2_path = paths[[label for label, _, _ in PLANS].index("DDP dp=2")]
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
