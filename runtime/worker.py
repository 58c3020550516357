"""The per-rank entry point, started by torchrun: ``python -m runtime.worker --plan plan.json ...``.

One process group for the whole launch; each ``--plan`` (several share one launch, as the parity
tests do: a launch costs seconds) gets its own (dp, cp, tp) DeviceMesh, a fresh model built from
the same seed on every rank, TP -> recompute -> data parallel applied (context parallel around each
micro-batch), and ``--steps`` steps of training. A plan with pp > 1 gets a (pp, dp, cp, tp) mesh
and runs its pipeline stages (``runtime.pipeline``). Outputs go to ``RUN_DIR/plan<i>/``:
``rank<r>.json`` per rank, ``report.json`` (the
RunReport, rank 0) and, with ``--save-params``, ``params.pt`` (every parameter gathered whole).
A model too large for every rank to build it whole (or ``PLAN_RUNTIME_META=1``) is built on the
meta device and only this rank's part materialised (``runtime.meta_init``).

A rank that fails writes ``RUN_DIR/error.rank<r>.json`` (time, one-line error, traceback) and
exits 1; torchrun then stops the other ranks, and the process group's timeout bounds any wait on
a rank that hangs instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from planner.errors import BadInput
from planner.plan import Plan
from runtime.checkpoint import Checkpointer, plan_sha256, sha256_file
from runtime.layout import coords, runtime_warnings
from runtime.meta_init import WARNING as META_WARNING, BuildInfo, materialize_sharded, use_meta
from runtime.context_parallel import ContextParallel
from runtime.data_parallel import autocast_dtype, data_mesh, full_parameters
from runtime.expert_parallel import META_REFUSAL as META_EP_REFUSAL, expert_parallel_of
from runtime.parallelize import parallelize
from runtime.recompute import recompute_of
from runtime.preflight import Prepared, load_for_worker
from runtime.report import MeshRank, build_report
from runtime.train import MODEL_SEED, RankResult, make_optimizer, median_step_time, train, with_step1_hash

log = logging.getLogger("runtime.worker")
DEFAULT_PG_TIMEOUT_S = 60
NODE_RANK_ENV = "PLAN_NODE_RANK"
"""The --node-rank of `plan run` on this node (multi-node runs), checked against torchrun's GROUP_RANK."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runtime.worker", description=__doc__)
    p.add_argument("--plan", action="append", required=True, help="a plan JSON (repeat to run several in turn)")
    p.add_argument("--model", help="the model file (default: each plan's model.path)")
    p.add_argument("--run-dir", required=True, help="where ranks write results and errors")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout-s", type=float, default=DEFAULT_PG_TIMEOUT_S, help="process-group timeout")
    p.add_argument("--save-params", action="store_true", help="rank 0 saves every parameter gathered whole")
    p.add_argument("--checkpoint-dir", help="DCP checkpoints go here (DIR/plan<i> when several plans share a launch)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    return p


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def run_plan(index: int, prepared: Prepared, args: argparse.Namespace, rank: int, world_size: int) -> None:
    """Build, parallelise and train one plan; rank 0 writes its RunReport."""
    started = time.perf_counter()
    plan, p = prepared.plan, prepared.plan.parallel
    assert prepared.world_size == world_size, (
        f"dp({p.dp}) * tp({p.tp}) * pp({p.pp}) != world size({world_size})"
    )
    device_type = prepared.device_type
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", 0))) if device_type == "cuda" else torch.device("cpu")
    out = Path(args.run_dir) / f"plan{index}"
    out.mkdir(parents=True, exist_ok=True)
    if p.pp > 1:
        _run_pipeline_plan(index, out, prepared, args, rank, world_size, device, started)
        return
    mesh = init_device_mesh(device_type, (p.dp, p.cp, p.tp), mesh_dim_names=("dp", "cp", "tp"))
    c = coords(rank, p.dp, p.tp, cp=p.cp)
    found = tuple(mesh[d].get_local_rank() for d in ("dp", "cp", "tp"))
    assert found == (c.dp_index, c.cp_index, c.tp_index), f"rank {rank}: mesh coordinates {found} != layout {c}"

    meta = prepared.handle.build_model("meta")
    on_meta = use_meta(meta, device)
    if on_meta and p.ep > 1:
        raise BadInput(META_EP_REFUSAL)
    if on_meta:
        # Too large for every rank to build it whole (or PLAN_RUNTIME_META=1): TP, recompute and
        # FSDP2 apply on the meta device, then only this rank's shards are allocated and filled.
        model = meta.to(dtype=torch.float32)
        pristine = prepared.handle.build_model("meta").to(dtype=torch.float32)
    else:
        del meta
        torch.manual_seed(MODEL_SEED)  # identical initial weights on every rank
        model = prepared.handle.build_model().to(device=device, dtype=torch.float32)
        build = BuildInfo(materialized_parameters=sum(q.numel() for q in model.parameters()))
    layer_names = [layer.name for layer in prepared.layers]

    def materialize() -> None:
        nonlocal build
        build = materialize_sharded(model, pristine, device, layer_names)

    wrapped = parallelize(model, plan, prepared.layers, mesh, device, recompute_of(plan.stages[0]),
                          materialize=materialize if on_meta else None)
    cp = ContextParallel.setup([model], plan, mesh) if p.cp > 1 else None
    data = data_mesh(mesh, plan)
    dp_group = data.get_group() if data.size() > 1 else None  # gradients (and the loss) average over dp x cp
    params = dict(model.named_parameters())  # the trained parameters, by their original names
    experts = expert_parallel_of(model)

    optimizer = make_optimizer(plan, model, dp_group, experts)
    ctx = _CheckpointContext(index, prepared, args, rank)
    start_step, after_step = ctx.setup(model, optimizer) if ctx.enabled else (0, None)
    after_step = with_step1_hash(after_step, build, params, start_step)
    result = train(
        prepared.handle, plan, wrapped, model, c.dp_index, dp_group, args.steps, device, rank,
        autocast_dtype(plan), optimizer=optimizer, start_step=start_step, after_step=after_step, cp=cp, experts=experts,
    )
    gathered = full_parameters(params) if args.save_params else None
    if gathered is not None and experts is not None:
        gathered = experts.gather(gathered)
    _finish(out, prepared, args, rank, world_size, result, gathered, started, ctx, build)


class _CheckpointContext:
    """--checkpoint-dir/--checkpoint-every/--resume for one plan of the launch."""

    def __init__(self, index: int, prepared: Prepared, args: argparse.Namespace, rank: int):
        self.prepared, self.args, self.rank = prepared, args, rank
        self.enabled = bool(args.checkpoint_dir)
        self.start_step = 0
        self.notes: list[str] = []
        if self.enabled:
            root = Path(args.checkpoint_dir)
            self.root = root if len(args.plan) == 1 else root / f"plan{index}"

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, Callable[[int], None] | None]:
        """Load the newest verified checkpoint (with --resume); (first step, after-step hook)."""
        args = self.args
        ck = Checkpointer(
            self.root, args.checkpoint_every, plan_sha256(self.prepared.plan_path),
            sha256_file(Path(self.prepared.handle.path)), model, optimizer, self.rank,
        )
        if args.resume:
            found = ck.load_latest()
            if found is None:
                self.notes.append(f"--resume: no checkpoint in {self.root}; started from step 0")
            else:
                self.notes.extend(f"skipped {line}" for line in found.skipped)
                if found.step >= args.steps:
                    raise BadInput(f"{found.path} is at step {found.step}: --steps {args.steps} leaves nothing to run")
                self.start_step = found.step
                self.notes.append(
                    f"resumed from {found.path} (step {found.step}); the losses are steps {found.step + 1}-{args.steps}"
                )
        if self.rank == 0:
            for note in self.notes:
                log.info("%s", note)
        return self.start_step, (ck.maybe_save if args.checkpoint_every > 0 else None)


def _run_pipeline_plan(
    index: int, out: Path, prepared: Prepared, args: argparse.Namespace, rank: int, world_size: int,
    device: torch.device, started: float,
) -> None:
    """A plan with pp > 1: mesh (pp, dp, cp, tp), the model split into pipeline stages (runtime.pipeline)."""
    from runtime.pipeline import run_pipeline

    plan, p = prepared.plan, prepared.plan.parallel
    mesh = init_device_mesh(prepared.device_type, (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    c = coords(rank, p.dp, p.tp, p.pp, p.cp)
    found = tuple(mesh[d].get_local_rank() for d in ("pp", "dp", "cp", "tp"))
    assert found == (c.pp_index, c.dp_index, c.cp_index, c.tp_index), f"rank {rank}: mesh coordinates {found} != layout {c}"
    ctx = _CheckpointContext(index, prepared, args, rank)
    run = run_pipeline(
        prepared.handle, plan, prepared.layers, mesh, c.pp_index, c.dp_index, args.steps, device, rank,
        autocast_dtype(plan), args.save_params, ctx.setup if ctx.enabled else None,
    )
    _finish(out, prepared, args, rank, world_size, run.result, run.params, started, ctx, run.build)


def _finish(
    out: Path, prepared: Prepared, args: argparse.Namespace, rank: int, world_size: int,
    result: RankResult, gathered: dict | None, started: float, ctx: _CheckpointContext, build: BuildInfo,
) -> None:
    """Per-rank JSON (with how the model was built), the gathered parameters and (rank 0) the RunReport."""
    plan = prepared.plan
    device_type = prepared.device_type
    _write_json(out / f"rank{rank}.json", {**asdict(result), "build": asdict(build)})
    results: list[RankResult | None] = [None] * world_size
    dist.all_gather_object(results, result)
    places: list[tuple[int, int, str, int] | None] = [None] * world_size
    dist.all_gather_object(places, _placement(rank))
    if gathered is not None and rank == 0:
        torch.save(gathered, out / "params.pt")
    if rank == 0:
        done = [r for r in results if r is not None]
        profiled = bool(done[0].phases_s)
        slowest = max(done, key=lambda r: r.profiled_step_s)  # the profiled step's bottleneck rank
        report = build_report(
            plan, str(prepared.plan_path), device_type, args.steps - ctx.start_step,
            step_time_s=max(median_step_time(r.step_times_s, profiled) for r in done),
            optimizer_s=max(median_step_time(r.optimizer_times_s, profiled) for r in done) if done[0].optimizer_times_s else None,
            phases_s=slowest.phases_s, profiled_step_s=slowest.profiled_step_s, profiled_rank=slowest.rank,
            step_times_s=done[0].step_times_s,
            peak_memory_bytes=[r.peak_memory_bytes for r in done],
            peak_allocated_bytes=[r.peak_allocated_bytes for r in done],
            losses=done[0].losses,
            warnings=[*runtime_warnings(plan, prepared.layers), *ctx.notes, *([META_WARNING] if build.path == "meta" else [])],
            mesh=_mesh(plan, places),
        )
        report = replace(report, wall_s=round(time.perf_counter() - started, 3))
        (out / "report.json").write_text(report.to_json())
    dist.barrier()


def _placement(rank: int) -> tuple[int, int, str, int]:
    """(rank, node, host, local rank) of this process, from torchrun's environment. The plan's
    placement is global rank = node * ranks per node + local rank, node the --node-rank the user
    gave (PLAN_NODE_RANK, set by the launcher of a multi-node run: runtime.multinode)."""
    node = int(os.environ.get("GROUP_RANK", 0))
    asked = int(os.environ.get(NODE_RANK_ENV, node))
    assert node == asked, f"rank {rank}: torchrun made this node {node}, not --node-rank {asked}"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    assert rank == node * per_node + local_rank, (
        f"rank {rank} != node({node}) * per node({per_node}) + local rank({local_rank})"
    )
    return rank, node, socket.gethostname(), local_rank


def _mesh(plan: Plan, places: list) -> list[MeshRank]:
    p = plan.parallel
    out = []
    for rank, node, host, local_rank in places:
        c = coords(rank, p.dp, p.tp, p.pp, p.cp)
        out.append(MeshRank(rank, node, host, local_rank, c.pp_index, c.dp_index, c.cp_index, c.tp_index))
    return out


def _record_error(run_dir: str, rank: int, exc: BaseException) -> None:
    lines = str(exc).strip().splitlines()
    one_line = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    data = {"rank": rank, "time": time.time(), "error": one_line, "traceback": traceback.format_exc()}
    try:
        _write_json(Path(run_dir) / f"error.rank{rank}.json", data)
    except OSError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(message)s")
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        prepared = [load_for_worker(plan, args.model) for plan in args.plan]
        # The backend follows the first plan (all plans of one launch share the device type).
        backend = "nccl" if prepared[0].device_type == "cuda" else "gloo"
        if prepared[0].device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=args.pg_timeout_s))
        _placement(rank)  # where torchrun put this rank is the plan's, before any work
        for index, one in enumerate(prepared):
            run_plan(index, one, args, rank, world_size)
        dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded for the launcher
        _record_error(args.run_dir, rank, exc)
        print(f"[rank{rank}] {traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
