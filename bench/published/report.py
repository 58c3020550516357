"""The printed table of rows and the per-source summary of errors."""

from __future__ import annotations

import statistics

from planner.search.explain import recompute_label
from planner.search.search import margin

from .predict import Result
from .rows import GIB


def _pct(x: float | None) -> str:
    return f"{x:+.0%}" if x is not None else "-"


def _gib(x: float | None) -> str:
    return f"{x / GIB:.1f}" if x else "-"


def plan_label(scored) -> str:
    c = scored.cand
    out = f"tp{c.tp} pp{c.pp} dp{c.dp}" + (f" cp{c.cp}" if c.cp > 1 else "") + (f" ep{c.ep}" if c.ep > 1 else "") + f" mb{c.micro_batch} z{c.zero}"
    if c.pp > 1:
        out += f" {c.schedule}" + (f"x{c.virtual_stages}" if c.schedule == "interleaved" else "")
    return out + f" rc={recompute_label(scored.partition.choice)}"


def print_table(results: list[Result]) -> None:
    head = (
        f"{'id':44s} {'source':20s} {'GPU x count':20s} {'config (as predicted)':42s} {'meas s':>8s} "
        f"{'pred s':>8s} {'err':>6s} {'meas GiB':>8s} {'pred GiB':>8s} {'err':>6s}  note"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        row = r.row
        gpu = f"{row.gpu.name} x{row.num_gpus}"
        if r.scored is None:
            config, pred, err = row.config(), "refused", f"(needs {r.need_bytes / GIB:.0f} GiB)" if r.need_bytes else ""
        else:
            config, pred, err = plan_label(r.scored), f"{r.step_s:8.2f}", _pct(r.error)
        mem_pred = ("≥" if r.scored is None and r.need_bytes else "") + _gib(r.peak_bytes)
        note = "; ".join(("tight: fits without the allocator's fragmentation",) * r.tight + row.notes
                         + tuple(f"[{a}]" for a in row.assumed))
        print(
            f"{row.id:44s} {row.source:20s} {gpu:20s} {config:42s} {row.measured_step_s:8.2f} {pred:>8s} "
            f"{err:>6s} {_gib(row.measured_peak_bytes):>8s} {mem_pred:>8s} {_pct(r.memory_error):>6s}  {note}"
        )
        if r.free_s is not None:
            if r.free is None:
                print(f"{'':44s}   free search: nothing found in {r.free_s:.1f} s")
            elif r.step_s is None:
                print(f"{'':44s}   free search: {plan_label(r.free)}  {r.free.step_time_s:.2f} s in {r.free_s:.1f} s")
            else:
                ratio = r.free.step_time_s / r.step_s
                print(
                    f"{'':44s}   free search: {plan_label(r.free)}  {r.free.step_time_s:.2f} s "
                    f"({ratio:.2f}x the published config's prediction) in {r.free_s:.1f} s{_simpler(r, r.free)}"
                )
                if r.free_same_recompute is not None:
                    same = r.free_same_recompute.step_time_s / r.step_s
                    flag = "  <- over 1.3x faster than the published config: a symptom" if same < 1 / 1.3 else ""
                    print(f"{'':44s}   ... with its recompute: {plan_label(r.free_same_recompute)}  "
                          f"{r.free_same_recompute.step_time_s:.2f} s ({same:.2f}x){flag}{_simpler(r, r.free_same_recompute)}")


def _simpler(r: Result, found) -> str:
    """Why a plan the free search `found`, predicted slower than the published one, was chosen:
    the search ranks plans by step time plus the margin each split, ZeRO stage and pipeline chunk
    must save (search.margin), and the published configuration's margin is the larger."""
    if found.step_time_s <= r.step_s:
        return ""
    if r.tight:  # the search keeps the allocator's fragmentation: the published plan is not a candidate
        return "  (the published configuration fits only without the allocator's fragmentation)"
    if found.score > r.scored.score:  # otherwise its margin is the smaller: slower, yet ranked first
        return "  <- the search missed a faster plan"
    more = margin(r.scored.cand) - margin(found.cand)
    return f"  (simpler: the published config's splits, ZeRO stage and chunks must save {more:.1%} more)"


def error_stats(errors: list[float]) -> str:
    """Count, median and worst |error| of the errors given (None skipped), as table columns."""
    errors = [abs(e) for e in errors if e is not None]
    if not errors:
        return f"{'-':>3s} {'-':>7s} {'-':>7s}"
    return f"{len(errors):3d} {statistics.median(errors):7.1%} {max(errors):7.1%}"


def features(r: Result) -> list[str]:
    """The plan features of a row's predicted configuration, each a group of the feature table:
    what the model, the precision, the parallelism and the cluster's size make of it."""
    c, row = r.scored.cand, r.row
    out = ["mixture of experts" if row.shape.experts else "dense"]
    if c.tp == c.pp == c.cp == 1 and c.ep <= 1:
        out.append("data parallel alone")
    out += [name for name, on in (("tensor parallel", c.tp > 1), ("pipeline", c.pp > 1), ("context parallel", c.cp > 1),
                                  ("expert parallel", c.ep > 1), ("ZeRO-3 / FSDP", c.zero == 3),
                                  ("HSDP", c.dp_replicate > 1)) if on]
    out.append({"fp8": "FP8", "fp4": "FP4"}.get(row.precision, "16-bit"))
    out.append("one NVLink domain" if row.num_gpus <= row.cluster().gpus_per_node else "across NVLink domains")
    return out


def print_features(results: list[Result]) -> None:
    """|error| and signed error per plan feature (a row in each of its features' groups): which
    parts of the cost model the published runs trust, and which lean one way."""
    groups: dict[str, list[float]] = {}
    for r in results:
        if r.error is not None:
            for name in features(r):
                groups.setdefault(name, []).append(r.error)
    if not groups:
        return
    print(f"\n{'by plan feature':22s} {'rows':>4s} {'median':>7s} {'signed':>7s} {'worst':>7s}")
    for name, errs in sorted(groups.items(), key=lambda g: -len(g[1])):
        print(f"{name:22s} {len(errs):4d} {statistics.median(map(abs, errs)):7.1%} {statistics.median(errs):+7.1%} "
              f"{max(errs, key=abs):+7.1%}")


def print_summary(results: list[Result]) -> None:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.row.source, []).append(r)
    groups["overall"] = results
    print(
        f"\n{'source':20s} {'rows':>4s} {'refused':>7s} {'tight':>5s} {'approx':>6s} {'assumed':>7s} | "
        f"{'step: n':>7s} {'median':>7s} {'worst':>7s} | {'exact: n':>8s} {'median':>7s} {'worst':>7s} | "
        f"{'memory: n':>9s} {'median':>7s} {'worst':>7s}"
    )
    for name, rs in groups.items():
        exact = [r.error for r in rs if not r.row.notes]
        print(
            f"{name:20s} {len(rs):4d} {sum(r.scored is None for r in rs):7d} {sum(r.tight for r in rs):5d} "
            f"{sum(bool(r.row.notes) for r in rs):6d} "
            f"{sum(bool(r.row.assumed) for r in rs):7d} | {error_stats([r.error for r in rs]):>23s} | "
            f"{error_stats(exact):>24s} | {error_stats([r.memory_error for r in rs]):>25s}"
        )
    print_bias(results)
    print_features(results)
    print(
        "\nstep/memory: |predicted / measured - 1| over the rows predicted (refused rows have no step time;"
        "\ntheir memory error uses the least memory they need); tight: rows that fit only without the"
        "\nallocator's fragmentation (predicted, with that warning); exact: rows without an approximation note;"
        "\napprox: rows with a note (what the cost model cannot express); assumed: rows with figures"
        "\nnot published ([...] in the note: left to the search or assumed)."
    )


def print_bias(results: list[Result]) -> None:
    """The signed step-time error's median per GPU type and trainer: where the cost model leans one
    way (a GPU generation's rows all slow, one trainer's all fast), which |error| hides."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if r.error is not None:
            groups.setdefault((r.row.gpu.name, r.row.trainer), []).append(r.error)
    if not groups:
        return
    print(f"\n{'lean (signed)':20s} {'trainer':>10s} {'rows':>4s} {'median':>7s} {'slowest':>8s} {'fastest':>8s}")
    for (gpu, trainer), errs in sorted(groups.items()):
        print(f"{gpu:20s} {trainer:>10s} {len(errs):4d} {statistics.median(errs):+7.1%} {max(errs):+8.1%} {min(errs):+8.1%}")
