"""The `plan` command: argv -> request -> pipeline -> render. No planning logic lives here.

Exit codes: 0 ok, 2 bad input (one line on stderr), 3 nothing fits. ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from planner.cli_args import _Parser, _positive_float, _positive_int  # noqa: F401 (re-exported)
from planner.errors import EXIT_BAD_INPUT, BadInput, PlanError

DTYPES = ("bf16", "fp16", "fp32")


def _profile_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan profile", description="Profile a model file layer by layer.")
    p.add_argument("model", help="the model file (defines build_model() and sample_batch())")
    p.add_argument("--batch-size", type=_positive_int, default=1, help="samples in the profiled batch (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of parameters and activations (default bf16)")
    p.add_argument("--meta", action="store_true", help="profile on fake tensors even if the model fits in memory (no timings)")
    p.add_argument("--no-time", action="store_true", help="skip measuring forward/backward seconds")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed iterations; the median is kept (default 3)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    p.add_argument("-o", "--output", help="also write the profile JSON to this file")
    p.add_argument("--force", action="store_true", help="overwrite the -o file if it exists")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_profile(argv: Sequence[str]) -> int:
    args = _profile_parser().parse_args(argv)
    from planner import schema
    from planner.files import check_output_path
    from planner.model_file import load_model_file
    from planner.profile import profile_model
    from planner.report.profile_table import render_profile

    if args.output:  # before profiling: a path that cannot be written is refused at once
        check_output_path(args.output, force=args.force, flag="-o")
    handle = load_model_file(args.model)
    profile = profile_model(
        handle,
        batch_size=args.batch_size,
        dtype=args.dtype,
        force_meta=args.meta,
        measure=not args.no_time,
        repeats=args.repeats,
    )
    if args.output:
        schema.write_new_file(args.output, profile.to_json(), force=args.force, flag="-o")
    if args.json:
        print(profile.to_json())
    else:
        render_profile(profile)
    return 0


def _gpus_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan gpus", description="List the hardware catalogue.")
    p.add_argument("--json", action="store_true", help="print the catalogue as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_gpus(argv: Sequence[str]) -> int:
    args = _gpus_parser().parse_args(argv)
    from planner.report.gpus_table import render_gpus

    render_gpus(as_json=args.json)
    return 0


def _plan_parser() -> argparse.ArgumentParser:
    from planner.cost.setup import OPTIMIZERS, PRECISIONS, RECOMPUTE, SCHEDULES, TRAINERS
    from planner.planning import DEFAULT_GPU

    p = _Parser(prog="plan", description="Plan how to parallelise a model's training over a cluster.")
    p.add_argument("model", help="the model file (defines build_model() and sample_batch())")
    p.add_argument("--gpus", type=_positive_int, required=True, help="number of GPUs (or CPU processes with --gpu cpu)")
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU type from `plan gpus`, a GPU .yaml file, or cpu (default {DEFAULT_GPU})")
    p.add_argument("--gpus-per-node", type=_positive_int, help="GPUs per node (default: the GPU type's usual node)")
    p.add_argument("--global-batch", type=_positive_int, help="samples per step (default: a token budget by model size for sequence models, 32 samples "
                   "per GPU otherwise, 8 per process on the CPU; the micro-batch is searched either way)")
    p.add_argument("--micro-batch", type=_positive_int, help="fix the micro-batch size")
    p.add_argument("--precision", choices=PRECISIONS, help="bf16/fp16 mixed precision, fp32, fp8 (Float8 Linear matmuls) or fp4 (NVFP4 ones, "
                   "Transformer Engine's: --trainer megatron) (default bf16; fp32 with --gpu cpu)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw")
    p.add_argument("--memory-limit", type=_positive_float, metavar="GiB", help="usable memory per GPU (default: all of it)")
    p.add_argument("--inter-node-gbps", type=_positive_float, metavar="Gb/s",
                   help="network between nodes per GPU, e.g. 400 for one NDR NIC per GPU (default: the GPU type's figure)")
    p.add_argument("--tp", type=_positive_int, help="fix the tensor-parallel degree")
    p.add_argument("--pp", type=_positive_int, help="fix the pipeline-parallel degree")
    p.add_argument("--dp", type=_positive_int, help="fix the data-parallel degree")
    p.add_argument("--cp", type=_positive_int, help="fix the context-parallel degree: each sequence split over this many GPUs, "
                   "attention as a ring (default: searched where the model allows it; 1: none)")
    p.add_argument("--ep", type=_positive_int, help="fix the expert-parallel degree of a mixture-of-experts model: each "
                   "block's experts split over this many data-parallel GPUs, tokens sent by all-to-all "
                   "(default: searched on MoE models; 1: none)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="fix the ZeRO stage (3 = FSDP)")
    p.add_argument("--recompute", choices=RECOMPUTE, help="fix activation recompute for every layer")
    p.add_argument("--sequence-parallel", choices=("on", "off"),
                   help="with tensor parallelism: split norms, residuals and dropout along the sequence too (default: searched)")
    p.add_argument("--trainer", choices=TRAINERS, default="this",
                   help="the trainer that will run the plan, for its kernels and overlaps: this (plan run's runtime, "
                        "the default), torchtitan, megatron (Megatron-LM, NeMo, Megatron-Bridge on Transformer Engine), "
                        "deepspeed (DeepSpeed's ZeRO) or automodel (NeMo AutoModel: FSDP2 on TE kernels, bf16 parameters "
                        "and optimizer state)")
    p.add_argument("--compile", action="store_true",
                   help="with --trainer torchtitan: it runs under torch.compile (its --compile): fused memory-bound "
                        "kernels, and the loss compiled, keeping the logits in their dtype")
    p.add_argument("--tp-overlap", choices=("on", "off"),
                   help="plan for a trainer that overlaps TP collectives with the GEMMs (Megatron-LM --tp-comm-overlap, "
                        "torchtitan async TP; default off: plan run does not)")
    p.add_argument("--ep-overlap", choices=("on", "off"),
                   help="plan for a trainer that runs the expert all-to-alls beside another micro-batch's compute "
                        "(Megatron-Core --overlap-moe-expert-parallel-comm, DeepSeek's DualPipe; default off: plan run "
                        "does not)")
    p.add_argument("--ep-dispatch", choices=("all-to-all", "deepep"),
                   help="how expert-parallel tokens cross nodes: all-to-all (a row for each of a token's experts on "
                        "another node; plan run, torchtitan, Megatron's alltoall dispatcher) or deepep (DeepEP: once "
                        "to each node of its experts, forwarded over NVLink; Megatron's flex dispatcher, NeMo "
                        "AutoModel) (default: the trainer's)")
    p.add_argument("--expert-node-limit", type=_positive_int, metavar="M",
                   help="a token's experts come from at most M nodes of its expert-parallel group (DeepSeek-V3's "
                        "node-limited routing: 4) (default: any)")
    p.add_argument("--hsdp", choices=("on", "off"),
                   help="with ZeRO-2/3 over several nodes: shard inside each node, replicate across nodes (default: searched)")
    p.add_argument("--schedule", choices=SCHEDULES, help="fix the pipeline schedule")
    p.add_argument("--virtual-stages", type=_positive_int, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--top", type=_positive_int, default=3, help="alternatives to show (default 3)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    p.add_argument("-o", "--output", help="write the plan JSON to this file")
    p.add_argument("--force", action="store_true", help="overwrite the -o file if it exists")
    p.add_argument("--run", action="store_true", help="then execute the plan here (torchrun), as `plan run` does")
    p.add_argument("--steps", type=_positive_int, default=10, help="with --run: training steps (default 10)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_plan(argv: Sequence[str]) -> int:
    args = _plan_parser().parse_args(argv)
    from planner.files import check_output_path
    from planner.model_file import load_model_file
    from planner.planning import PlanRequest, make_plan
    from planner.report.plan_table import render_plan
    from planner.search.space import Fixed

    if args.output:  # before planning: a path that cannot be written is refused at once
        check_output_path(args.output, force=args.force, flag="-o")
        if args.run:  # and the run report that goes next to it
            from runtime.report import report_path

            check_output_path(report_path(args.output), force=args.force)
    request = PlanRequest(
        gpus=args.gpus,
        gpu=args.gpu,
        gpus_per_node=args.gpus_per_node,
        global_batch=args.global_batch,
        precision=args.precision or ("fp32" if args.gpu.lower() == "cpu" else "bf16"),
        optimizer=args.optimizer,
        memory_limit_gib=args.memory_limit,
        inter_node_gbps=args.inter_node_gbps,
        trainer=args.trainer,
        compile=args.compile,
        ep_dispatch=None if args.ep_dispatch is None else args.ep_dispatch.replace("-", "_"),
        expert_node_limit=args.expert_node_limit,
        fixed=Fixed(
            tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep, micro_batch=args.micro_batch, zero=args.zero,
            schedule=args.schedule, virtual_stages=args.virtual_stages, recompute=args.recompute,
            sequence_parallel=None if args.sequence_parallel is None else args.sequence_parallel == "on",
            hsdp=None if args.hsdp is None else args.hsdp == "on",
            tp_overlap=args.tp_overlap == "on", ep_overlap=args.ep_overlap == "on",
        ),
        top_k=args.top,
    )
    if args.run and args.json:
        raise BadInput("plan: --run prints tables; for JSON write the plan with -o and use `plan run PLAN --json`")
    plan = make_plan(load_model_file(args.model), request)
    output = args.output
    if args.run and not output:  # the run report is written next to the plan: a fresh folder
        import tempfile

        output = str(Path(tempfile.mkdtemp(prefix="plan-")) / "plan.json")
    if output:
        from planner import schema

        schema.write_new_file(output, plan.to_json(), force=args.force, flag="-o" if args.output else None)
    if args.json:
        print(plan.to_json())
    else:
        render_plan(plan)
        if output:
            print(f"plan written to {output}")
    if args.run:
        return cmd_run([output, "--model", args.model, "--steps", str(args.steps)] + (["--force"] if args.force else []))
    return 0


def cmd_run(argv: Sequence[str]) -> int:
    # `plan run` executes a plan: its code lives in the runtime (runtime/cli.py), which may import
    # the planner; the planner imports the runtime only here, lazily, to dispatch the command.
    from runtime.cli import cmd_run as run_plan

    return run_plan(argv)


def cmd_calibrate(argv: Sequence[str]) -> int:
    from runtime.cli import cmd_calibrate as calibrate  # measured with torchrun: the runtime's

    return calibrate(argv)


def cmd_whatif(argv: Sequence[str]) -> int:
    from planner.files import check_output_path
    from planner.report.whatif_table import _parser as whatif_parser
    from planner.report.whatif_table import cmd_whatif as run_whatif

    args = whatif_parser().parse_args(argv)
    for flag, path in (("--report", args.report), ("--csv", args.csv)):
        if path:  # before the sweep: a path that cannot be written is refused at once
            check_output_path(path, force=args.force, flag=flag)
    return run_whatif(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "profile": cmd_profile,
    "gpus": cmd_gpus,
    "run": cmd_run,
    "calibrate": cmd_calibrate,
    "whatif": cmd_whatif,
}

USAGE = """usage: plan MODEL.py --gpus N [options]   or   plan COMMAND ...

  plan MODEL.py --gpus N [--gpu TYPE] ...          the best parallel plan, with reasons (plan MODEL.py --help)
  plan profile MODEL.py [--batch-size B] [--json]  per-layer parameters, FLOPs, memory and time
  plan gpus                                        the hardware catalogue (--gpu names)
  plan run plan.json [--steps S] [--dry-run]       execute a saved plan (torchrun), measured against predicted
  plan calibrate [--gpu cpu|NAME] [-o FILE]        measure this machine with the processes plans run (torchrun)
  plan whatif MODEL.py --gpus 8,16 --gpu a,b ...   plans over GPU types x counts: speed, time, cost, HTML report

Run `plan COMMAND --help` for the options of each."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else EXIT_BAD_INPUT
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            if argv[0].startswith("-"):
                return cmd_plan(argv)
            if not argv[0].endswith(".py") and "/" not in argv[0]:
                raise BadInput(f"plan: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}, or a model file")
            return cmd_plan(argv)
        return command(argv[1:])
    except PlanError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `plan` console script: main(), the exit handlers, the streams flushed, then the process
    ends without tearing the interpreter down: freeing torch's modules one by one took 0.5-1 s
    of every command here (`python -c "import torch, torch._dynamo"`: 5.5 s, 4.8 s so ended)."""
    code = main()
    atexit._run_exitfuncs()  # what libraries registered (logging's flush among them) still runs
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader that went away (`plan ... | head`), a closed stream
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
