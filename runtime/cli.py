"""`plan run`: execute a saved plan with torch.distributed and report measured against predicted.

The command's code lives in the runtime (profile -> plan -> run: the runtime may import the
planner, never the reverse); ``planner.cli`` dispatches ``plan run`` here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from planner.cli_args import _Parser, _positive_float, _positive_int
from planner.errors import BadInput


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan run", description="Execute a saved plan with torch.distributed and report measured against predicted.")
    p.add_argument("plan", help="a plan JSON written by `plan MODEL.py ... -o plan.json`")
    p.add_argument("--model", help="the model file (default: the plan's model.path)")
    p.add_argument("--steps", type=_positive_int, default=10, help="training steps; the first is a warm-up (default 10)")
    p.add_argument("--dry-run", action="store_true", help="print the launch command and the per-rank layout; start nothing")
    p.add_argument("--json", action="store_true", help="print the run report as JSON instead of a table")
    p.add_argument("--timeout-s", type=_positive_float, default=600.0, help="stop the whole run after this many seconds (default 600)")
    p.add_argument("--pg-timeout-s", type=_positive_float, metavar="T",
                   help="how long a collective waits for a rank before the run fails (default: from the work: "
                        "60 s, 10 predicted steps, and the time to write and hash a checkpoint on a slow disk)")
    p.add_argument("--force", action="store_true", help="overwrite an existing PLAN.run.json")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save signed DCP checkpoints (model, optimizer, step) in DIR/step-NNNNNNNN-<plan>")
    p.add_argument("--checkpoint-every", metavar="K", type=_positive_int, help="save a checkpoint every K steps (needs --checkpoint-dir)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint in --checkpoint-dir")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_run(argv: Sequence[str]) -> int:
    args = _run_parser().parse_args(argv)
    from runtime.launch import format_command, launch, run_dir_for, torchrun_command
    from runtime.layout import describe, runtime_warnings
    from runtime.preflight import check_checkpointing, prepare, work_timeout_s
    from runtime.worker import DEFAULT_PG_TIMEOUT_S
    from runtime.report import render_report, report_path

    if args.checkpoint_every and not args.checkpoint_dir:
        raise BadInput("plan run: --checkpoint-every needs --checkpoint-dir DIR")
    prepared = prepare(args.plan, args.model)
    out = report_path(args.plan)
    run_dir = run_dir_for(args.plan)
    ckpt = dict(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0, resume=args.resume)
    pg_timeout_s = args.pg_timeout_s or work_timeout_s(prepared.plan, bool(args.checkpoint_dir), DEFAULT_PG_TIMEOUT_S)
    for line in check_checkpointing(prepared, args.checkpoint_dir, args.resume, args.steps):
        print(line, file=sys.stderr)
    if args.dry_run:
        cmd = torchrun_command([args.plan], prepared.world_size, run_dir, model=prepared.handle.path, steps=args.steps,
                               pg_timeout_s=pg_timeout_s, **ckpt)
        print(format_command(cmd))
        for line in describe(prepared.plan, prepared.layers) + [f"warning: {w}" for w in runtime_warnings(prepared.plan, prepared.layers)]:
            print(line)
        return 0
    from planner.files import check_output_path

    check_output_path(out, force=args.force)  # the run report, next to the plan: before the launch
    result = launch([args.plan], prepared.world_size, model=prepared.handle.path, steps=args.steps,
                    timeout_s=args.timeout_s, pg_timeout_s=pg_timeout_s, run_dir=run_dir, **ckpt)
    report = result.reports[0]
    from planner import schema

    schema.write_new_file(out, report.to_json(), force=True)
    if args.json:
        print(report.to_json())
    else:
        render_report(report)
        print(f"run report written to {out}")
    return 0
