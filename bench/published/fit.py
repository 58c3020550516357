"""Fitting the cost model's three shares (--fit) and leaving one source out (--loso).

Each row's solved assignment (stages, recompute) is re-evaluated under each grid point of
MATMUL_EFFICIENCY x MEMORY_EFFICIENCY x OVERLAP_CONTENTION, as the planner's constants are read at
evaluation time (planner/cost/compute.py, planner/cost/comm.py); the objective is the mean
|log(predicted / measured)| over the rows fitted.
"""

from __future__ import annotations

import math
import time

from planner.cost import comm as comm_mod
from planner.cost import compute as compute_mod
from planner.cost.evaluate import evaluate
from planner.cost.stage_costs import stage_costs

from .predict import Profiles, Result
from .report import error_stats


MATMUL_GRID = [round(0.70 + 0.02 * i, 2) for i in range(16)]
MEMORY_GRID = [round(0.50 + 0.05 * i, 2) for i in range(9)]
CONTENTION_GRID = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0]
Point = tuple[float, float, float]


def grid_errors(results: list[Result], profiles: Profiles) -> dict[Point, list[float]]:
    """(matmul, memory, contention) -> log(predicted / measured) per predicted row, each row's
    assignment (stages, recompute) re-evaluated under the grid point's constants (the costs built
    again at each point: a context-parallel ring's contention is priced when they are built)."""
    saved = compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY, comm_mod.OVERLAP_CONTENTION
    setups = [(r, r.row.cluster(), r.row.training(), profiles.get(r.row)) for r in results if r.scored]
    out = {}
    try:
        for mm in MATMUL_GRID:
            for mem in MEMORY_GRID:
                for ov in CONTENTION_GRID:
                    compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY, comm_mod.OVERLAP_CONTENTION = mm, mem, ov
                    tables = [stage_costs(profile, cluster, training, r.scored.cand) for r, cluster, training, profile in setups]
                    errs = []
                    for (r, *_), costs in zip(setups, tables):
                        b = r.scored
                        ev = evaluate(costs, list(b.partition.bounds), list(b.partition.choice))
                        errs.append(math.log(ev.step_time_s / r.row.measured_step_s))
                    out[mm, mem, ov] = errs
    finally:
        compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY, comm_mod.OVERLAP_CONTENTION = saved
    return out


def best_point(grid: dict[Point, list[float]], keep: list[bool]) -> Point | None:
    """The grid point with the least mean |log error| over the kept rows (None: no row kept)."""
    if not any(keep):
        return None

    def score(point):
        errs = [abs(e) for e, k in zip(grid[point], keep) if k]
        return sum(errs) / len(errs)

    return min(grid, key=score)


def _rel(log_errors: list[float]) -> list[float]:
    return [math.exp(e) - 1 for e in log_errors]


def fit(results: list[Result], profiles: Profiles, loso: bool) -> None:
    predicted = [r for r in results if r.scored]
    start = time.perf_counter()
    grid = grid_errors(predicted, profiles)
    print(f"\ngrid of {len(grid)} points x {len(predicted)} rows evaluated in {time.perf_counter() - start:.1f} s")
    current = (compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY, comm_mod.OVERLAP_CONTENTION)
    now = [math.log(r.step_s / r.row.measured_step_s) for r in predicted]
    best = best_point(grid, [True] * len(predicted))
    exact = [not r.row.notes for r in predicted]
    print(
        f"\n{'step time, constants':34s} {'matmul':>6s} {'memory':>6s} {'contention':>10s} | {'all rows: n':>11s} {'median':>7s} {'worst':>7s} | "
        f"{'exact rows: n':>13s} {'median':>7s} {'worst':>7s}"
    )
    fits = [("current (planner/cost/constants)", current, now), ("fitted on all rows", best, grid[best])]
    best_exact = best_point(grid, exact)
    if best_exact is not None:
        fits.append(("fitted on exact rows (no note)", best_exact, grid[best_exact]))
    for label, point, errs in fits:
        ex = [e for e, k in zip(errs, exact) if k]
        print(f"{label:34s} {point[0]:6.2f} {point[1]:6.2f} {point[2]:10.2f} | {error_stats(_rel(errs)):>27s} | {error_stats(_rel(ex)):>29s}")
    if loso:
        leave_one_source_out(predicted, grid, best)


def leave_one_source_out(predicted: list[Result], grid: dict, best: Point) -> None:
    """For each source: fit on the other sources' rows, predict the held-out source's rows."""
    print(
        f"\nleave one source out: fit on the other sources, predict the held-out one\n"
        f"{'held out':20s} {'matmul':>6s} {'memory':>6s} {'contention':>10s} | {'held out: n':>11s} {'median':>7s} {'worst':>7s} | "
        f"{'in the all-rows fit: n':>22s} {'median':>7s} {'worst':>7s}"
    )
    held_all: list[float] = []
    for source in sorted({r.row.source for r in predicted}):
        keep = [r.row.source != source for r in predicted]
        point = best_point(grid, keep)
        if point is None:
            print(f"{source:20s} (no other source to fit on)")
            continue
        held = [e for e, k in zip(grid[point], keep) if not k]
        held_all += held
        inside = [e for e, k in zip(grid[best], keep) if not k]
        print(f"{source:20s} {point[0]:6.2f} {point[1]:6.2f} {point[2]:10.2f} | {error_stats(_rel(held)):>27s} | {error_stats(_rel(inside)):>38s}")
    print(f"{'every row held out':42s} | {error_stats(_rel(held_all)):>27s} | {error_stats(_rel(grid[best])):>38s}")
