"""`plan whatif`: parse the command line, run the sweep with a progress bar, and print it as a rich
table (or CSV / JSON), with the derived answers below it. The sweep itself is `whatif.run_sweep`.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import math
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from planner.errors import BadInput
from planner.report.units import fmt_count, fmt_seconds, make_console, short
from planner.report.whatif import Point, Sweep, SweepSpec, run_sweep
from planner.report.whatif_text import compact_plan, fmt_cost, fmt_days, fmt_memory, summary_lines  # noqa: F401 (re-exported)

# -- parsing ------------------------------------------------------------------------------------
def _items(flag: str, text: str, example: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip():
        raise BadInput(f"{flag}: empty list; expected a comma-separated list like {example}")
    if any(not t for t in items):
        raise BadInput(f"{flag}: {text!r} has an empty entry; expected a comma-separated list like {example}")
    return items


def parse_counts(text: str) -> tuple[int, ...]:
    counts = []
    for item in _items("--gpus", text, "8,16,32"):
        if not item.isdigit() or int(item) < 1:
            raise BadInput(f"--gpus: {item!r} is not a whole number of GPUs of at least 1 (expected a list like 8,16,32)")
        if int(item) in counts:
            raise BadInput(f"--gpus: {int(item)} is listed twice")
        counts.append(int(item))
    return tuple(sorted(counts))


def parse_types(text: str) -> tuple[str, ...]:
    """GPU names as given (validated: an unknown name gets the closest names suggested)."""
    from planner.hardware import get_gpu

    names: list[str] = []
    seen: set[str] = set()
    for item in _items("--gpu", text, "a100-80gb,h100-sxm-80gb"):
        try:
            spec = get_gpu(item)
        except BadInput as exc:
            raise BadInput(f"--gpu: {exc}") from None
        if spec.name in seen:
            raise BadInput(f"--gpu: {spec.name} is listed twice")
        seen.add(spec.name)
        names.append(item if item.endswith((".yaml", ".yml")) or "/" in item else spec.name)
    return tuple(names)


def _number(flag: str, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"{flag}: {text!r} is not a number ({what})") from None
    if not math.isfinite(value) or value <= 0:
        raise BadInput(f"{flag}: must be a positive number ({what}), got {text!r}")
    return value


def parse_prices(text: str, types: Sequence[str], names: Sequence[str]) -> tuple[tuple[str, float], ...]:
    """`a100-80gb=1.8,...` -> ((name, $/GPU-hour), ...) for every swept type (`names`)."""
    prices: dict[str, float] = {}
    for item in _items("--price", text, "a100-80gb=1.8,h100-sxm-80gb=3.5"):
        gpu, eq, value = item.partition("=")
        gpu = gpu.strip().lower()
        if not eq or not gpu:
            raise BadInput(f"--price: {item!r} is not TYPE=DOLLARS_PER_GPU_HOUR (like a100-80gb=1.8)")
        if gpu not in names:
            close = difflib.get_close_matches(gpu, names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]}? " if close else ""
            raise BadInput(f"--price: {gpu!r} is not in the sweep; {hint}the sweep has: {', '.join(names)}")
        prices[gpu] = _number("--price", value.strip(), f"dollars per GPU-hour for {gpu}")
    missing = [n for n in names if n not in prices]
    if missing:
        raise BadInput(f"--price: no price for {', '.join(missing)}; give one for every --gpu type (or none)")
    return tuple((n, prices[n]) for n in names)


def _parser() -> argparse.ArgumentParser:
    from planner.cli_args import _Parser, _positive_int
    from planner.cost.setup import OPTIMIZERS, PRECISIONS, TRAINERS
    from planner.planning import DEFAULT_GPU

    p = _Parser(prog="plan whatif", description="Plan a model over GPU types x counts: speed, memory, time and cost.")
    p.add_argument("model", help="the model file (defines build_model() and sample_batch())")
    p.add_argument("--gpus", required=True, help="GPU counts, comma-separated: 8,16,32,64")
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU types from `plan gpus`, comma-separated (default {DEFAULT_GPU})")
    p.add_argument("--global-batch", type=_positive_int,
                   help="samples per step at every count (default: `plan`'s default, computed once for the sweep)")
    p.add_argument("--scale-batch", action="store_true",
                   help="grow the global batch with the GPU count (the smallest count's samples per GPU) instead of holding it")
    p.add_argument("--tokens", help="training length in tokens (300e9), for the time and cost to train")
    p.add_argument("--steps", type=_positive_int, help="training length in steps (instead of --tokens)")
    p.add_argument("--price", help="dollars per GPU-hour per type: a100-80gb=1.8,h100-sxm-80gb=3.5")
    p.add_argument("--deadline-days", help="pick the cheapest configuration that trains within this many days")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="default bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw")
    p.add_argument("--trainer", choices=TRAINERS, default="this",
                   help="the trainer that will run the plans: this (plan run's runtime, the default), torchtitan, megatron, "
                        "deepspeed")
    p.add_argument("--compile", action="store_true",
                   help="with --trainer torchtitan: it runs under torch.compile (its --compile), as plan --compile")
    p.add_argument("--gpus-per-node", type=_positive_int, help="GPUs per node (default: each type's usual node)")
    p.add_argument("--memory-limit", type=float, metavar="GiB", help="usable memory per GPU (default: all of it)")
    p.add_argument("--inter-node-gbps", type=float, metavar="Gb/s",
                   help="network between nodes per GPU for every type, e.g. 400 (default: each type's figure)")
    p.add_argument("--report", metavar="FILE.html", help="write a self-contained HTML report with charts")
    p.add_argument("--csv", metavar="FILE.csv", help="write one row per configuration as CSV")
    p.add_argument("--json", action="store_true", help="print the sweep as JSON on stdout")
    p.add_argument("--force", action="store_true", help="overwrite the --report / --csv files if they exist")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before the sweep runs, to replace a file the user has (unless --force)."""
    for flag, path in (("--report", args.report), ("--csv", args.csv)):
        if not path:
            continue
        target = Path(path).expanduser()
        if target.exists() and not args.force:
            raise BadInput(f"{path}: already exists ({flag}); pass --force to overwrite it")
        if not target.parent.exists():
            raise BadInput(f"{target.parent}: no such directory ({flag})")


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    from planner.hardware import get_gpu

    counts, types = parse_counts(args.gpus), parse_types(args.gpu)
    names = [get_gpu(t).name for t in types]
    if args.tokens is not None and args.steps is not None:
        raise BadInput("plan whatif: give --tokens or --steps, not both")
    tokens = _number("--tokens", args.tokens, "tokens to train on, like 300e9") if args.tokens is not None else None
    deadline = _number("--deadline-days", args.deadline_days, "days") if args.deadline_days is not None else None
    from planner.planning import check_compile

    check_compile(args.trainer, args.compile)
    if deadline is not None and tokens is None and args.steps is None:
        raise BadInput("--deadline-days needs the training length: --tokens or --steps")
    for flag, path in (("--report", args.report), ("--csv", args.csv)):
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise BadInput(f"{flag} {path}: no such directory")
    return SweepSpec(
        gpu_types=types, gpu_counts=counts, global_batch=args.global_batch, tokens=tokens, steps=args.steps,
        prices_per_gpu_hour=parse_prices(args.price, types, names) if args.price is not None else (),
        deadline_days=deadline, precision=args.precision, optimizer=args.optimizer,
        gpus_per_node=args.gpus_per_node, memory_limit_gib=args.memory_limit, scale_batch=args.scale_batch,
        inter_node_gbps=args.inter_node_gbps, trainer=args.trainer, compile=args.compile,
    )


# -- output -------------------------------------------------------------------------------------
def _tags(sweep: Sweep, p: Point) -> str:
    tags = [("fastest", sweep.fastest), ("cheapest", sweep.cheapest), ("deadline", sweep.deadline_pick)]
    return " ".join(name for name, q in tags if q is p)


def fmt_money(p: Point) -> str:
    if p.cost_usd is not None and p.cost_usd >= 10_000:
        return "$" + short(p.cost_usd)
    return fmt_cost(p)


def render_sweep(sweep: Sweep, console: Console | None = None) -> None:
    console = console or make_console()
    seq = f", seq {sweep.seq_len:,}" if sweep.seq_len else ""
    console.print(f"[bold]What if: {sweep.model_name}[/bold] ({fmt_count(sweep.num_params)} parameters{seq}), "
                  f"{sweep.spec.precision}, {sweep.spec.optimizer}"
                  + (f", for --trainer {sweep.spec.trainer}" + (" --compile" if sweep.spec.compile else "")
                     if sweep.spec.trainer != "this" else ""))
    table = Table(title_justify="left")
    rate = "tokens/s" if sweep.seq_len else "samples/s"  # both are in --csv / --json
    cols = ("GPU", "GPUs", "best plan", "batch", "step", rate, "MFU", "memory/GPU", "time", "cost", "scaling", "")
    for col in cols:
        table.add_column(col, justify="left" if col in ("GPU", "best plan", "") else "right", no_wrap=col not in ("best plan", ""),
                         min_width=34 if col == "best plan" else None)
    for p in sweep.points:
        if not p.fits:
            table.add_row(p.gpu, str(p.num_gpus), f"[red]{p.plan.replace(' per GPU', '/GPU')}[/red]", "-", "-", "-", "-", fmt_memory(p), "-", "-", "-", "")
            continue
        table.add_row(
            p.gpu, str(p.num_gpus), compact_plan(p), f"{p.global_batch:,}" + ("*" if p.batch_note else ""), fmt_seconds(p.step_time_s),
            short(p.tokens_per_s if sweep.seq_len else p.samples_per_s), f"{p.mfu:.1%}", fmt_memory(p),
            fmt_days(p.days_to_train), fmt_money(p),
            f"{p.scaling_efficiency:.0%}" if p.scaling_efficiency is not None else "-", f"[bold green]{_tags(sweep, p)}[/]",
        )
    console.print(table)
    console.print("[dim]mb BxM: micro-batches of B samples, M per step per replica; batch: global batch (samples per step); "
                  "memory: the fullest GPU against the limit; scaling: speed-up per GPU against the type's smallest "
                  "fitting count (100% is linear)[/dim]")
    for p in sweep.points:  # text, not markup: a source may read "[uncertain: ...]"
        if p.batch_note:
            console.print(f"[dim]* {escape(p.label)}: global batch {escape(p.batch_note)}[/dim]")
    for line in summary_lines(sweep):
        console.print(f"  {escape(line)}")
    for a in sweep.assumptions:
        console.print(f"[dim]assumes: {escape(a)}[/dim]")
    n = len(sweep.points)
    console.print(f"[dim]profiled once in {sweep.profile_s:.1f} s; {n} configuration{'s' if n != 1 else ''} in {sweep.sweep_s:.1f} s[/dim]")


def to_jsonable(sweep: Sweep) -> dict:
    """The sweep for --json: rows, the derived answers and the assumptions."""
    ref = lambda p: None if p is None else {"gpu": p.gpu, "num_gpus": p.num_gpus, "plan": p.plan}  # noqa: E731
    s = sweep.spec
    return {
        "schema": "planner.WhatIf", "version": 1,
        "model": {"name": sweep.model_name, "path": sweep.model_path, "num_params": sweep.num_params, "seq_len": sweep.seq_len},
        "request": {
            "gpu_types": list(s.gpu_types), "gpu_counts": list(s.gpu_counts), "global_batch": s.global_batch,
            "tokens": s.tokens, "steps": s.steps, "prices_per_gpu_hour": dict(s.prices_per_gpu_hour),
            "deadline_days": s.deadline_days, "precision": s.precision, "optimizer": s.optimizer,
            "scale_batch": s.scale_batch,
        },
        "global_batch": None if sweep.batching is None else sweep.batching.global_batch,
        "points": [p.row() for p in sweep.points],
        "min_gpus": [vars(m) for m in sweep.min_gpus],
        "fastest": ref(sweep.fastest), "cheapest": ref(sweep.cheapest), "cheapest_basis": sweep.cheapest_basis,
        "deadline_pick": ref(sweep.deadline_pick), "deadline_note": sweep.deadline_note,
        "headroom": None if sweep.headroom is None else vars(sweep.headroom),
        "assumptions": list(sweep.assumptions), "profile_s": sweep.profile_s, "sweep_s": sweep.sweep_s,
    }


def write_csv(sweep: Sweep, path: str) -> None:
    rows = [p.row() for p in sweep.points]
    from planner.files import atomic_open

    with atomic_open(path, newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def cmd_whatif(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    from planner.model_file import load_model_file

    spec = spec_from_args(args)
    _check_outputs(args)
    handle = load_model_file(args.model)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress:
        task = progress.add_task("profiling the model", total=len(spec.gpu_types) * len(spec.gpu_counts))
        sweep = run_sweep(handle, spec, on_point=lambda label: progress.update(task, advance=1, description=f"planned {label}"))
    if args.csv:
        write_csv(sweep, args.csv)
    if args.report:
        from planner.report.html_report import write_report

        write_report(sweep, args.report)
    if args.json:
        print(json.dumps(to_jsonable(sweep), indent=2))
    else:
        render_sweep(sweep)
        for flag, path in (("report", args.report), ("CSV", args.csv)):
            if path:
                print(f"{flag} written to {path}")
    return 0
