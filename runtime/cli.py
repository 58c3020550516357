"""`plan run`: execute a saved plan with torch.distributed and report measured against predicted.

The command's code lives in the runtime (profile -> plan -> run: the runtime may import the
planner, never the reverse); ``planner.cli`` dispatches ``plan run`` here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from planner.cli_args import _Parser, _positive_float, _positive_int
from planner.errors import BadInput
from planner.gpu_spec import COLLECTIVE_KINDS


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan run", description="Execute a saved plan with torch.distributed and report measured against predicted.")
    p.add_argument("plan", help="a plan JSON written by `plan MODEL.py ... -o plan.json`")
    p.add_argument("--model", help="the model file (default: the plan's model.path)")
    p.add_argument("--steps", type=_positive_int, default=10, help="training steps (default 10): the step time is the median of "
                   "the later half after the first; the last (of 3 or more) is profiled into phases")
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
    g = p.add_argument_group("several nodes", "run the same command on every node; node 0 hosts the rendezvous "
                             "and writes the report")
    g.add_argument("--nnodes", type=_positive_int, metavar="K", help="the nodes of the run: the plan's GPUs over its GPUs per node")
    g.add_argument("--node-rank", type=int, metavar="I", help="this node, 0 to K-1: it runs global ranks I*P to I*P+P-1 "
                   "(P: the plan's GPUs per node)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and a free port there, the same on every node")
    g.add_argument("--rdzv-id", metavar="ID", help="the run's rendezvous id (default: from the plan file's sha256)")
    g.add_argument("--rdzv-timeout-s", type=_positive_float, metavar="T",
                   help="how long a node waits for the others to join (default 300, at most --timeout-s)")
    j = p.add_argument_group("cluster jobs", "write (and submit) a job that runs the plan on a scheduler's nodes, "
                             "each running the command above with its node rank; nothing runs here")
    j.add_argument("--slurm", action="store_true", help="write an sbatch script (PLAN.sbatch, or -o FILE)")
    j.add_argument("--submit", action="store_true", help="with --slurm: submit it with sbatch and print the job id")
    j.add_argument("--partition", help="with --slurm: #SBATCH --partition")
    j.add_argument("--account", help="with --slurm: #SBATCH --account")
    j.add_argument("--time", help="with --slurm: #SBATCH --time (e.g. 04:00:00)")
    j.add_argument("--k8s", action="store_true", help="print a Kubeflow PyTorchJob manifest (and a ConfigMap with the "
                   "plan and model files), or write it with -o FILE")
    j.add_argument("--image", help="with --k8s: the container image (torch and this planner installed)")
    j.add_argument("--namespace", help="with --k8s: the Kubernetes namespace")
    j.add_argument("--k8s-volume", metavar="CLAIM:PATH", help="with --k8s: a PersistentVolumeClaim mounted at PATH that holds "
                   "the plan and model files (instead of a ConfigMap)")
    j.add_argument("--job-name", help="the job's name (default: the plan file's name)")
    j.add_argument("-o", "--output", metavar="FILE", help="with --slurm or --k8s: where to write the job file")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _job_file(args: argparse.Namespace) -> int:
    """`plan run --slurm` / `--k8s`: the job file for a scheduler (runtime/jobs.py), written or printed;
    with --submit, handed to sbatch."""
    import shutil
    import subprocess

    from planner.files import atomic_write_text, check_output_path
    from runtime.jobs import dump_yaml, pytorchjob, slurm_script
    from runtime.preflight import prepare

    if args.slurm and args.k8s:
        raise BadInput("plan run: --slurm or --k8s, not both")
    for flag in ("partition", "account", "time", "submit"):
        if getattr(args, flag) and not args.slurm:
            raise BadInput(f"plan run: --{flag} goes with --slurm")
    for flag in ("image", "namespace", "k8s_volume"):
        if getattr(args, flag) and not args.k8s:
            raise BadInput(f"plan run: --{flag.replace('_', '-')} goes with --k8s")
    if args.dry_run or args.nnodes is not None or args.node_rank is not None or args.rdzv_endpoint is not None:
        raise BadInput("plan run: --slurm and --k8s write a job whose nodes get their rank from the scheduler: "
                       "leave out --dry-run, --nnodes, --node-rank and --rdzv-endpoint")
    sbatch = shutil.which("sbatch") if args.submit else None
    if args.submit and sbatch is None:  # before anything is written
        raise BadInput("plan run --submit: sbatch is not on PATH (submit the script from a Slurm login node)")
    prepared = prepare(args.plan, args.model, on_launcher=False)  # the plan and model load, as on the nodes
    ckpt = dict(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    if args.slurm:
        text = slurm_script(prepared.plan, args.plan, prepared.handle.path, name=args.job_name, partition=args.partition,
                            account=args.account, time=args.time, steps=args.steps, **ckpt)
        out = Path(args.output) if args.output else Path(args.plan).with_suffix(".sbatch")
    else:
        text = dump_yaml(pytorchjob(prepared.plan, args.plan, prepared.handle.path, image=args.image or "",
                                    name=args.job_name, namespace=args.namespace, volume=args.k8s_volume,
                                    steps=args.steps, **ckpt))
        out = Path(args.output) if args.output else None
        if out is None:
            sys.stdout.write(text)
            return 0
    check_output_path(out, force=args.force, flag="-o")
    atomic_write_text(out, text)
    print(f"{out}: {'sbatch script' if args.slurm else 'Kubernetes manifest'} for {prepared.plan.parallel.one_line()}")
    if sbatch is not None:
        done = subprocess.run([sbatch, str(out)], capture_output=True, text=True)
        said = (done.stderr or done.stdout).strip().splitlines()
        if done.returncode != 0:
            raise BadInput(f"sbatch {out}: {said[-1] if said else f'exit {done.returncode}'}")
        print(done.stdout.strip())
    return 0


def cmd_run(argv: Sequence[str]) -> int:
    args = _run_parser().parse_args(argv)
    from runtime.launch import format_command, launch, run_dir_for, torchrun_command
    from runtime.layout import describe, runtime_warnings
    from runtime.preflight import check_checkpointing, prepare, work_timeout_s
    from runtime.worker import DEFAULT_PG_TIMEOUT_S
    from runtime.report import render_report, report_path

    from runtime.multinode import check_rendezvous, node_lines, node_spec

    if args.checkpoint_every and not args.checkpoint_dir:
        raise BadInput("plan run: --checkpoint-every needs --checkpoint-dir DIR")
    if args.slurm or args.k8s or any(getattr(args, f) for f in ("submit", "partition", "account", "time", "image",
                                                                  "namespace", "k8s_volume", "job_name", "output")):
        if not (args.slurm or args.k8s):
            raise BadInput("plan run: --submit, --partition, --account, --time, --image, --namespace, --k8s-volume, "
                           "--job-name and -o go with --slurm or --k8s")
        return _job_file(args)
    multi = any(v is not None for v in (args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id, args.rdzv_timeout_s))
    # several nodes: this machine hosts one node's share of the devices (checked below)
    prepared = prepare(args.plan, args.model, on_launcher=not multi)
    node = node_spec(prepared.plan, args.plan, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id,
                     args.timeout_s, args.rdzv_timeout_s) if multi else None
    if node is not None:
        from runtime.preflight import check_devices

        check_devices(prepared.plan, prepared.plan_path, prepared.world_size, per_node=node.nproc_per_node)
    nproc = prepared.world_size if node is None else node.nproc_per_node
    out = report_path(args.plan)
    run_dir = run_dir_for(args.plan) if node is None else run_dir_for(args.plan) / f"node{node.node_rank}"
    ckpt = dict(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0, resume=args.resume)
    pg_timeout_s = args.pg_timeout_s or work_timeout_s(prepared.plan, bool(args.checkpoint_dir), DEFAULT_PG_TIMEOUT_S)
    for line in check_checkpointing(prepared, args.checkpoint_dir, args.resume, args.steps):
        print(line, file=sys.stderr)
    if args.dry_run:
        cmd = torchrun_command([args.plan], nproc, run_dir, model=prepared.handle.path, steps=args.steps,
                               pg_timeout_s=pg_timeout_s, node=node, **ckpt)
        print(format_command(cmd))
        for line in describe(prepared.plan, prepared.layers) + [f"warning: {w}" for w in runtime_warnings(prepared.plan, prepared.layers)]:
            print(line)
        if node is not None:
            for line in node_lines(prepared.plan, node.nproc_per_node):
                print(line)
        return 0
    from planner.files import check_output_path

    if node is None or node.node_rank == 0:
        check_output_path(out, force=args.force)  # the run report, next to the plan: before the launch
    if node is not None:
        check_rendezvous(node)  # node 0: the port is free; the others: node 0 answers
    result = launch([args.plan], nproc, model=prepared.handle.path, steps=args.steps,
                    timeout_s=args.timeout_s, pg_timeout_s=pg_timeout_s, run_dir=run_dir, node=node, **ckpt)
    if node is not None and node.node_rank != 0:
        print(f"node {node.node_rank} of {node.num_nodes}: ranks {node.ranks.start}-{node.ranks.stop - 1} finished; "
              f"node 0 has the run report ({out.name} next to its plan)")
        return 0
    report = result.reports[0]
    from planner import schema

    schema.write_new_file(out, report.to_json(), force=True)
    if args.json:
        print(report.to_json())
    else:
        render_report(report)
        print(f"run report written to {out}")
    return 0


def _calibrate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan calibrate", description=(
        "Measure this machine as plans will run on it (torchrun, every process at once) and keep the "
        "figures: for --gpu cpu where every later --gpu cpu plan finds them; for a GPU, in a catalogue "
        "file (-o) that --gpu accepts."))
    p.add_argument("--gpu", default="cpu", help="cpu (the local CPU, default) or the catalogue GPU this node has")
    p.add_argument("--gpus", type=_positive_int, metavar="N",
                   help="the most processes to measure with (cpu: 1, 2, 4, ... up to N, default 8; a GPU: "
                        "the node's GPUs)")
    p.add_argument("--from-run", nargs="+", metavar="REPORT",
                   help="refit the phase factors (compute, communication, optimizer) from run reports (PLAN.run.json) "
                        "instead of measuring: --gpu cpu, or --gpu FILE.yaml with -o")
    p.add_argument("-o", "--output", metavar="FILE", help="write the figures (cpu: JSON; a GPU: a catalogue YAML)")
    p.add_argument("--force", action="store_true", help="overwrite FILE")
    p.add_argument("--timeout-s", type=_positive_float, default=300.0, help="per launch (default 300)")
    g = p.add_argument_group("several nodes (a GPU)", "the same command on every node measures across them "
                             "(torchrun's rendezvous, as plan run); node 0 writes -o")
    g.add_argument("--nnodes", type=_positive_int, metavar="K", help="the nodes to measure across")
    g.add_argument("--node-rank", type=int, metavar="I", help="this node, 0 to K-1")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and a free port there")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_calibrate(argv: Sequence[str]) -> int:
    args = _calibrate_parser().parse_args(argv)
    import json

    from planner.files import check_output_path
    from runtime.calibrate import run_counts

    if args.output:
        check_output_path(args.output, force=args.force, flag="-o")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.from_run:
        if args.nnodes is not None or args.rdzv_endpoint is not None:
            raise BadInput("plan calibrate --from-run refits from reports: --nnodes and --rdzv-endpoint measure nodes")
        return _refit(args)
    if args.gpu.lower() == "cpu":
        if args.nnodes is not None or args.rdzv_endpoint is not None or args.node_rank is not None:
            raise BadInput("plan calibrate --gpu cpu measures this machine's processes: --nnodes and --rdzv-endpoint "
                           "measure GPU nodes (--gpu NAME)")
        from planner.local_device import calibration_path, store_calibration

        top = args.gpus or 8
        counts = [1]
        while counts[-1] * 2 <= top:
            counts.append(counts[-1] * 2)
        if counts[-1] != top:
            counts.append(top)
        results = run_counts(counts, "cpu", args.timeout_s, progress)
        spec = store_calibration(results)
        print(f"local CPU ({spec.display_name}), {len(results)} process counts; kept in {calibration_path()}:")
        print(f"{'processes':>9s} {'step s':>8s} {'slowdown':>9s} {'assumed':>8s}   "
              + "  ".join(f"{k.replace('_', '-').replace('p2p', 'send/recv'):>22s}" for k in COLLECTIVE_KINDS))
        for r in results:
            n = r["processes"]
            cells = []
            for kind in COLLECTIVE_KINDS:
                f = r.get(kind)
                cells.append(f"{'-':>22s}" if f is None else f"{f['latency_s'] * 1e6:7.0f} us {f['busbw_Bps'] / 1e9:6.2f} GB/s")
            print(f"{n:9d} {r['step_s']:8.3f} {spec.slowdown(n):9.2f} {float(n):8.2f}   " + "  ".join(cells))
        print("slowdown: one process's step time among N, over one process with every core (assumed: N); "
              "collectives: latency and bus bandwidth fitted over 4 KiB-16 MiB")
        if spec.tp_forward_overhead_s or spec.tp_backward_overhead_s:
            print(f"tensor parallelism (DTensor) on the host: {spec.tp_forward_overhead_s * 1e6:.0f} us forward, "
                  f"{spec.tp_backward_overhead_s * 1e6:.0f} us backward per sharded Linear (one process)")
        for n in sorted({n for n, _, _ in spec.loss_parallel_steps}):
            f, b = spec.loss_parallel_s_per_element(n)
            print(f"loss_parallel (vocabulary-split head) beyond a fused cross-entropy, {n} process{'es' * (n > 1)}: "
                  f"{f * 1e9:.1f} ns forward, {b * 1e9:.1f} ns backward per logit element")
        if args.output:
            from planner.files import atomic_write_text

            atomic_write_text(args.output, json.dumps({"gpu": "cpu", "results": results}, indent=2) + "\n")
            print(f"figures written to {args.output}")
        return 0
    return _calibrate_gpu(args, progress)


def _calibrate_gpu(args: argparse.Namespace, progress: Any) -> int:
    """A node of catalogue GPUs (or, with --nnodes, this node's share of a measurement across
    nodes): the bf16 matmul and attention ceilings and the collectives, as a catalogue file (the
    base GPU's other fields and sources kept), written by node 0."""
    import datetime
    import socket

    import torch
    import yaml

    from planner.hardware import get_gpu
    from runtime.calibrate import run_counts
    from runtime.multinode import calibration_node

    base = get_gpu(args.gpu)
    if not args.output:
        raise BadInput("plan calibrate: a GPU's figures go to a catalogue file: give -o FILE.yaml")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available == 0:
        raise BadInput(f"plan calibrate --gpu {args.gpu}: this machine has no GPU; run it on a node of them")
    n = min(args.gpus or available, available)
    node = calibration_node(args.nnodes, args.node_rank, args.rdzv_endpoint, n, args.timeout_s)
    results = run_counts([n], "cuda", args.timeout_s, progress, node=node)
    if not results:  # a node other than 0: node 0 writes the file
        print(f"node {node.node_rank} of {node.num_nodes}: measured; node 0 writes {args.output}")
        return 0
    at = f"plan calibrate on {socket.gethostname()} at {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
    data = gpu_catalogue(base, results[0], Path(args.output).stem.lower(), at)
    from planner.files import atomic_write_text

    atomic_write_text(args.output, yaml.safe_dump(data, sort_keys=False))
    result = results[0]
    print(f"{args.output}: {base.name} calibrated on this node ({n} GPUs): matmul {result['matmul_bf16_flops'] / 1e12:.0f} "
          f"TFLOP/s bf16 ({data['matmul_efficiency']:.0%} of peak), attention {result['attention_bf16_flops'] / 1e12:.0f} "
          f"({data['attention_efficiency']:.0%}); use it with --gpu {args.output}")
    return 0


def gpu_catalogue(base: Any, result: dict[str, Any], name: str, at: str) -> dict[str, Any]:
    """A catalogue file's fields from one calibrate launch's figures (runtime.calibrate): `base`'s,
    with the ceilings measured, the all-reduce inside a node, and across nodes when the launch
    spanned several: there a group with P members in each node moves P NICs' worth (the cost
    model's topology.py), so the per-GPU inter-node figure is the group's bus bandwidth over P."""
    per_node, world = result.get("processes_per_node", result["processes"]), result["processes"]
    peak = base.peak("bf16")
    data: dict[str, Any] = {
        "name": name,
        "display_name": f"{base.display_name} (calibrated)",
        "vendor": base.vendor,
        "peak_tflops": {k: v / 1e12 for k, v in base.peak_flops.items()},
        "memory_gb": base.memory_bytes / 1e9,
        "hbm_bandwidth_GBps": base.hbm_bandwidth_Bps / 1e9,
        "intra_node_bandwidth_GBps": base.intra_node_bandwidth_Bps / 1e9,
        "intra_node_latency_us": base.intra_node_latency_s * 1e6,
        "inter_node_bandwidth_GBps": base.inter_node_bandwidth_Bps / 1e9,
        "inter_node_latency_us": base.inter_node_latency_s * 1e6,
        "gpus_per_node": base.gpus_per_node,
        "matmul_efficiency": min(1.0, result["matmul_bf16_flops"] / peak),
        "attention_efficiency": min(1.0, result["attention_bf16_flops"] / peak),
        "sources": {
            "matmul_efficiency": f"{at}: best median bf16 torch.mm 4096/8192, slowest of {world} GPUs at once, over the bf16 peak",
            "attention_efficiency": f"{at}: best median causal bf16 SDPA forward + backward, 16 heads of 128, 4096/8192 "
                                    f"tokens, slowest of {world} GPUs at once, over the bf16 peak",
        },
    }
    # what the launch did not measure stays the base part's, with its source: the FP8 and cuDNN
    # shares, the matmul-by-shape table, the power and the NVLink domain's hosts (a calibrated
    # H200 lost its GEMM shape table; the compute capability is left out: the measured SDPA figure
    # is what this node's torch runs, whichever kernels it picks)
    for key, attr, scale in (("intra_node_peer_bandwidth_GBps", "intra_node_peer_bandwidth_Bps", 1e-9),
                             ("gpus_per_host", "gpus_per_host", 1), ("tdp_w", "tdp_w", 1),
                             ("fp8_matmul_efficiency", "fp8_matmul_efficiency", 1),
                             ("cudnn_attention_efficiency", "cudnn_attention_efficiency", 1),
                             ("matmul_shapes", "matmul_shapes", None)):
        value = getattr(base, attr, None)
        if value is None:
            continue
        data[key] = value if scale is None else value * scale
        if attr in base.sources:
            data["sources"][key] = f"{base.name}'s: {base.sources[attr]}"
    if "optimizer_s_per_param" in result:
        data["optimizer_ns_per_param"] = {k: v * 1e9 for k, v in result["optimizer_s_per_param"].items()}
        data["sources"]["optimizer_ns_per_param"] = (f"{at}: median torch.optim AdamW / SGD step over 4.2 M fp32 "
                                                     f"parameters, median of {world} GPUs at once")
    if "loss_parallel_s_per_element" in result:
        data["loss_parallel_ns_per_element"] = {k: v * 1e9 for k, v in result["loss_parallel_s_per_element"].items()}
        data["sources"]["loss_parallel_ns_per_element"] = (f"{at}: loss_parallel's seconds per fp32 logit element beyond a "
                                                           f"fused cross-entropy, median of {world} GPUs at once")
    for phase in ("forward", "backward"):
        if f"tp_{phase}_overhead_s" in result:
            data[f"tp_{phase}_overhead_us"] = result[f"tp_{phase}_overhead_s"] * 1e6
            data["sources"][f"tp_{phase}_overhead_us"] = (f"{at}: DTensor's host seconds per tensor-parallel Linear "
                                                          f"{phase}, median of {world} GPUs at once")
    inside = result.get("intra_node_all_reduce") or (result.get("all_reduce") if per_node == world else None)
    if inside is not None:
        data["intra_node_bandwidth_GBps"] = inside["busbw_Bps"] / 1e9
        data["intra_node_latency_us"] = inside["latency_s"] * 1e6
        data["sources"]["intra_node_bandwidth_GBps"] = f"{at}: NCCL all-reduce among {per_node} GPUs of a node, 4 KiB-16 MiB, bus bandwidth fitted"
        data["sources"]["intra_node_latency_us"] = f"{at}: NCCL all-reduce among {per_node} GPUs of a node, latency fitted"
    if per_node < world and "all_reduce" in result:
        across = result["all_reduce"]
        data["inter_node_bandwidth_GBps"] = across["busbw_Bps"] / per_node / 1e9
        data["inter_node_latency_us"] = across["latency_s"] * 1e6
        data["gpus_per_node"] = per_node
        nodes = world // per_node
        data["sources"]["inter_node_bandwidth_GBps"] = (f"{at}: NCCL all-reduce over {nodes} nodes x {per_node} GPUs, "
                                                        f"bus bandwidth fitted, over the {per_node} GPUs of a node")
        data["sources"]["inter_node_latency_us"] = f"{at}: NCCL all-reduce over {nodes} nodes x {per_node} GPUs, latency fitted"
    return data


def _refit(args: argparse.Namespace) -> int:
    """`plan calibrate --from-run R.json ...`: the phase factors refit from measured runs, kept for
    the local CPU or written into a GPU catalogue file."""
    from planner.hardware import get_gpu
    from runtime.calibrate import refit
    from runtime.report import RunReport

    reports = [RunReport.load(path) for path in args.from_run]
    spec = get_gpu(args.gpu)
    on_cpu = args.gpu.lower() == "cpu"
    if not on_cpu and not args.output:
        raise BadInput("plan calibrate --from-run: a GPU file's refit goes to a catalogue file: give -o FILE.yaml")
    old = dict(spec.phase_factors)
    new, fitted = refit(reports, old)
    print(f"{'run':60s} {'measured':>9s} {'predicted':>10s} {'refit':>8s}")
    for plan, before, after, measured in fitted:
        print(f"{plan[:60]:60s} {measured:8.3f}s {before:9.3f}s {after:7.3f}s")
    print("phase factors: " + ", ".join(f"{k} {old.get(k, 1.0):.2f} -> {v:.2f}" for k, v in new.items()))
    note = f"refit from {len(reports)} run report(s): {', '.join(Path(p).name for p in args.from_run)}"
    if on_cpu:
        from planner.local_device import calibration_path, store_phase_factors

        store_phase_factors(new, note)
        print(f"kept in {calibration_path()}: every later --gpu cpu plan uses them")
        return 0
    import yaml

    from planner.files import atomic_write_text

    data = yaml.safe_load(Path(args.gpu).read_text()) if Path(args.gpu).is_file() else None
    if not isinstance(data, dict):
        raise BadInput(f"plan calibrate --from-run: --gpu {args.gpu} is not a catalogue file to refit (give FILE.yaml)")
    data["phase_factors"] = {k: round(v, 4) for k, v in new.items()}
    data.setdefault("sources", {})["phase_factors"] = f"plan calibrate --from-run: {note}"
    atomic_write_text(args.output, yaml.safe_dump(data, sort_keys=False))
    print(f"{args.output}: phase factors written; use it with --gpu {args.output}")
    return 0
