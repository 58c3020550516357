"""`plan calibrate`: measure the machines the plans will run on, with the processes they will run.

One torchrun launch per process count (``--nproc-per-node N``; the worker is ``python -m
runtime.calibrate``), every rank measuring at once, so that what the ranks share (a CPU's cores,
a node's power and memory system) is measured as training meets it:

- one training step (forward, backward) of a fixed model (a ``torch.nn.TransformerEncoderLayer``,
  d_model 256, 4 heads, 1,024 wide, batch 8 x 128 tokens, fp32): 9 steps on every rank at once,
  a barrier after each (training's ranks run in lockstep), the fastest of 3 such rounds
  (other load on the machine comes in bursts), the median over the ranks. Calibrate an otherwise idle machine. On
  the CPU, the step's time with N processes over its time in one process with every core is
  ``GPUSpec.process_slowdown``, which the planner uses instead of assuming that N processes on C
  cores each run at C/N of the whole (they do not: two threads are not twice one);
- all-reduce, all-gather and reduce-scatter among all N ranks, and a message each way between pairs
  of ranks, at sizes from 4 KiB to 16 MiB, each after a matmul (as training calls them, between
  computations: `_after_compute_s`): a least-squares fit of seconds = latency + bytes x
  volume / bus bandwidth (nccl-tests' bus bandwidth: volume 2(N-1)/N for all-reduce, (N-1)/N for
  the others): ``collectives``, each group of the plan costed with what was measured for its
  size and kind.

Rank 0 writes the figures as JSON. On the local CPU (`--gpu cpu`) the launcher stores them with the
CPU's other measured figures (planner.local_device's cache), where every later ``--gpu cpu`` plan
finds them; ``-o FILE.json`` also writes them out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from planner.cost.stage_costs import attention_run_flops
from planner.errors import BadInput, PlanError

SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB .. 16 MiB
STEP_SHAPE = (8, 128, 256)  # batch, tokens, width of the fixed training step
REPEATS = 9


def _times_s(fn: Callable[[], Any], repeats: int = REPEATS, sync: Callable[[], None] = lambda: None) -> list[float]:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _median_s(fn: Callable[[], Any], repeats: int = REPEATS, sync: Callable[[], None] = lambda: None) -> float:
    return statistics.median(_times_s(fn, repeats, sync))


def step_seconds(device: torch.device, sync: Callable[[], None]) -> float:
    """Seconds of one forward and backward of the fixed model while every rank runs them: the
    ranks start together and run REPEATS steps in lockstep, a barrier after each, as training's
    ranks wait for each other at every step's gradient all-reduce. The fastest of 3 such rounds
    (other load on the machine comes in bursts). Timing steps one by one, each rank on its own,
    measured less sharing than training meets: a rank's fastest step was one where others
    happened to wait (4 processes on 2 cores measured 1.2x the time of 2, where lockstep training
    takes 2x); so did rounds without the barriers (ranks that finished early left the cores to
    the rest: 1.79x and 2.05x in two calibrations six minutes apart)."""
    torch.manual_seed(0)
    b, t, d = STEP_SHAPE
    layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True).to(device)
    x = torch.randn(b, t, d, device=device)

    def step() -> None:
        layer(x).square().mean().backward()

    step()
    rounds = []
    for _ in range(3):
        if dist.is_initialized():
            dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(REPEATS):
            step()
            sync()
            if dist.is_initialized():
                dist.barrier()
        rounds.append((time.perf_counter() - start) / REPEATS)
    return min(rounds)


def fit_alpha_beta(sizes: tuple[int, ...], seconds: list[float], volume: float) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of seconds = latency + size x volume / bandwidth, least squares;
    the latency at least 0 and the bandwidth from the largest message when the fit is degenerate."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx if sxx else 0.0
    latency = my - slope * mx
    if slope <= 0 or latency < 0:
        latency = max(0.0, min(seconds))
        slope = max(seconds[-1] - latency, 1e-12) / sizes[-1]
    return latency, volume / slope


def matmul_flops(device: torch.device, sync: Callable[[], None]) -> float:
    """Best median FLOP/s of square bf16 matmuls (4096, 8192) on a GPU."""
    best = 0.0
    for n in (4096, 8192):
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        best = max(best, 2 * n**3 / _median_s(lambda: torch.mm(a, b), sync=sync))
    return best


def attention_flops(device: torch.device, sync: Callable[[], None], seqs: tuple[int, ...] = (4096, 8192),
                    heads: int = 16, head_dim: int = 128) -> float:
    """Best median FLOP/s of causal bf16 scaled_dot_product_attention (the kernels torch's SDPA
    picks here), forward and backward, in the FLOPs its kernels run at their plateau rate, as the
    cost model counts them (planner.cost.stage_costs.attention_run_flops: half of 4 s^2 h d
    forward, 2.5 x that backward, plus each query row's fixed work and half a diagonal tile), so
    that it reads as the catalogue's attention_efficiency (a long sequence's share)."""
    best = 0.0
    for s in seqs:
        q, k, v = (torch.randn(1, heads, s, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, heads, s, head_dim, device=device, dtype=torch.bfloat16)

        def step():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        counted = 3.5 * 4 * heads * s**2 * head_dim
        best = max(best, attention_run_flops(counted, counted, s) / _median_s(step, sync=sync))
    return best


TP_OVERHEAD_SHAPE = (1, 16, 64)  # batch, tokens, width: kernels negligible beside the host's work
TP_OVERHEAD_CALLS = 10


def tp_overhead_s(device: torch.device, sync: Callable[[], None]) -> tuple[float, float]:
    """Host seconds DTensor adds to one tensor-parallel Linear, (forward, backward): a LayerNorm ->
    column-wise Linear -> GELU -> row-wise Linear block run as this runtime runs it with sequence
    parallelism (SequenceParallel norm, ColwiseParallel from the sequence shards, RowwiseParallel
    back to them), on a mesh of this rank alone (no traffic: the collectives are costed apart), at a
    size where the kernels take next to nothing, against the same block plain; half the difference
    (two Linears). Medians of REPEATS runs of TP_OVERHEAD_CALLS calls, every rank at once."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mesh = DeviceMesh.from_group(groups[rank], device.type)
    b, t, d = TP_OVERHEAD_SHAPE
    torch.manual_seed(0)

    def block() -> torch.nn.Module:
        return torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(d), "up": torch.nn.Linear(d, 4 * d),
                                    "down": torch.nn.Linear(4 * d, d)}).to(device)

    plain, sharded = block(), block()
    parallelize_module(sharded, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                       "down": RowwiseParallel(output_layouts=Shard(1))})
    x = torch.randn(b, t, d, device=device, requires_grad=True)

    def forward(m: torch.nn.Module) -> torch.Tensor:
        return m["down"](torch.nn.functional.gelu(m["up"](m["norm"](x))))

    def timed(m: torch.nn.Module, backward: bool) -> float:
        def calls() -> None:
            for _ in range(TP_OVERHEAD_CALLS):
                y = forward(m)
                if backward:
                    y.sum().backward()
        return _median_s(calls, sync=sync) / TP_OVERHEAD_CALLS

    fwd = timed(sharded, False) - timed(plain, False)
    both = timed(sharded, True) - timed(plain, True)
    for g in groups:
        dist.destroy_process_group(g)
    return max(0.0, fwd / 2), max(0.0, (both - fwd) / 2)


# tokens x vocabulary shard, fp32 logits: 34 MB on the CPU (past a 32 MB last-level cache, as a
# model's logits are), 2 GB on a GPU
LOSS_PARALLEL_SHAPE = {"cpu": (2048, 4096), "cuda": (16384, 32768)}


def loss_parallel_s(device: torch.device, sync: Callable[[], None]) -> tuple[float, float]:
    """Seconds per logit element that the runtime's loss on a head TP splits over the vocabulary
    (planner.model_file.sharded_cross_entropy: torch's ``loss_parallel``, whose max, shift, exp,
    sum, log and target pick run as separate DTensor ops, and whose gradient it takes in forward)
    adds to a fused cross-entropy over the same logits, (forward, backward): fp32 logits sharded
    over the vocabulary on a mesh of this rank alone (the collectives are costed apart), against
    F.cross_entropy on a plain tensor. Medians of REPEATS calls, every rank at once."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from planner.model_file import sharded_cross_entropy

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mesh = DeviceMesh.from_group(groups[rank], device.type)
    n, v = LOSS_PARALLEL_SHAPE["cuda" if device.type == "cuda" else "cpu"]
    torch.manual_seed(0)
    logits = torch.randn(n, v, device=device)
    targets = torch.randint(v, (n,), device=device)
    sharded = distribute_tensor(logits, mesh, [Shard(1)])

    def timed(x: torch.Tensor, parallel: bool, backward: bool) -> float:
        def call() -> None:
            y = x.detach().requires_grad_()
            loss = (sharded_cross_entropy if parallel else torch.nn.functional.cross_entropy)(y, targets)
            if backward:
                loss.backward()
        return _median_s(call, sync=sync) / (n * v)

    fwd = max(0.0, timed(sharded, True, False) - timed(logits, False, False))
    both = max(0.0, timed(sharded, True, True) - timed(logits, False, True))
    for g in groups:
        dist.destroy_process_group(g)
    # backward may come out below 0: the fused loss's backward (timed with the head's, in the
    # profile) does not run there, its gradient having been taken in forward
    return fwd, both - fwd


OPTIMIZER_SHAPES = ((1024, 1024),) * 4 + ((1024,),) * 8  # 4.2 M fp32 parameters in 12 tensors


def optimizer_s_per_param(device: torch.device, sync: Callable[[], None]) -> dict[str, float]:
    """Seconds of one optimizer step per parameter, for each optimizer the runtime builds (plain
    torch.optim.AdamW and SGD over fp32 parameters, as runtime.train.optimizer_class makes them),
    every rank at once (they share the memory system as training's do): median of REPEATS steps."""
    from runtime.train import optimizer_class

    out = {}
    for name in ("adamw", "sgd"):
        params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in OPTIMIZER_SHAPES]
        for p in params:
            p.grad = torch.randn_like(p)
        cls, options = optimizer_class(name, device.type)
        optimizer = cls(params, **options)
        out[name] = _median_s(optimizer.step, sync=sync) / sum(p.numel() for p in params)
    return out


def measure(device: torch.device) -> dict[str, Any]:
    """What this rank measures (every rank at once); collectives over the whole group."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    world = dist.get_world_size()
    out: dict[str, Any] = {"step_s": step_seconds(device, sync)}
    out["tp_forward_overhead_s"], out["tp_backward_overhead_s"] = tp_overhead_s(device, sync)
    out["optimizer_s_per_param"] = optimizer_s_per_param(device, sync)
    out["loss_parallel_s_per_element"] = dict(zip(("forward", "backward"), loss_parallel_s(device, sync)))
    if device.type == "cuda":
        out["matmul_bf16_flops"] = matmul_flops(device, sync)
        out["attention_bf16_flops"] = attention_flops(device, sync)
    if world > 1:
        rank = dist.get_rank()
        peer = rank ^ 1  # pairs (0, 1), (2, 3), ...: each sends to the other, all pairs at once
        for kind in COLLECTIVES:
            if kind == "p2p" and peer >= world:
                continue
            out[kind] = _collective(kind, device, sync, None, world, rank, peer)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if per_node < world:
            # several nodes: the groups above span them; one node's ranks alone (every rank creates
            # every node's group, as new_group requires) for the figures inside a node
            groups = [dist.new_group(list(range(n, n + per_node))) for n in range(0, world, per_node)]
            mine = groups[rank // per_node]
            if per_node > 1:
                out["intra_node_all_reduce"] = _collective("all_reduce", device, sync, mine, per_node, rank, peer)
    return out


SEGMENT_SHAPE = (128, 1024, 1024)
"""(m, k, n) of the matmul each timed collective follows: a few milliseconds of one CPU core (a
layer's share of a step, as the collectives of TP and FSDP follow), a few microseconds of a GPU."""


def _after_compute_s(op: Callable[[], Any], work: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds `op` (a collective) adds after `work` (compute), every rank at once: the median over
    REPEATS of (work, then op) less work alone, each timed from a barrier. Training calls its
    collectives between computations, never back to back: there a collective also absorbs the ranks'
    skew and wakes gloo's threads from idle. On this 2-core machine that added 1.3-1.4 ms to every
    all-gather, reduce-scatter and all-reduce of 0.75 MB after a 6 ms matmul (2.2x, 1.7x and 1.7x
    their time back to back; 1.0-1.2x at 12 MB), a latency the back-to-back fit had put at 0.4-1 ms."""
    def timed(fn: Callable[[], Any]) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    work(), op(), sync()
    return max(0.0, statistics.median(timed(lambda: (work(), op())) - timed(work) for _ in range(REPEATS)))


def _collective(kind: str, device: torch.device, sync: Callable[[], None], group: Any, n: int, rank: int,
                peer: int) -> dict[str, Any]:
    """Seconds of one collective among the `n` ranks of `group` (None: all) at each of SIZES, each
    after a matmul as training calls it (_after_compute_s), and its fitted latency and bus bandwidth."""
    m, k, n_ = SEGMENT_SHAPE
    a, b = torch.randn(m, k, device=device), torch.randn(k, n_, device=device)
    seconds = []
    for size in SIZES:  # the whole buffer: all-reduce's, all-gather's output, reduce-scatter's input
        elems = max(n, size // 4) // n * n
        whole = torch.ones(elems, device=device)
        part = torch.empty(elems // n, device=device)
        op = {
            "all_reduce": lambda: dist.all_reduce(whole, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(whole, part, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole, group=group),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(whole), whole, group=group),
            "p2p": lambda: _exchange(whole, rank, peer),
        }[kind]
        seconds.append(_after_compute_s(op, lambda: torch.mm(a, b), sync))
    latency, busbw = fit_alpha_beta(SIZES, seconds, COLLECTIVES[kind](n))
    return {"latency_s": latency, "busbw_Bps": busbw, "sizes": list(SIZES), "seconds": seconds}


def _exchange(t: torch.Tensor, rank: int, peer: int) -> None:
    """One message each way between `rank` and `peer` (the lower rank sends first)."""
    if rank < peer:
        dist.send(t, peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(t, peer)


COLLECTIVES: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,  # nccl-tests' bus bandwidth: bytes x this / seconds
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # each rank keeps 1/n of its buffer
    "p2p": lambda n: 2.0,  # a message each way, one after the other
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="runtime.calibrate", description="one rank of plan calibrate")
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", timeout=timedelta(seconds=120))
    try:
        mine = measure(device)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            result = {
                "processes": world,
                "threads_per_process": torch.get_num_threads() if args.device == "cpu" else None,
                "step_s": statistics.median(r["step_s"] for r in everyone),
                "step_s_per_rank": [r["step_s"] for r in everyone],
                **{k: statistics.median(r[k] for r in everyone) for k in ("tp_forward_overhead_s", "tp_backward_overhead_s")},
                **{key: {k: statistics.median(r[key][k] for r in everyone) for k in mine[key]}
                   for key in ("optimizer_s_per_param", "loss_parallel_s_per_element")},
                **{k: mine[k] for k in (*COLLECTIVES, "intra_node_all_reduce") if k in mine},
                "processes_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                **{k: min(r[k] for r in everyone) for k in ("matmul_bf16_flops", "attention_bf16_flops") if k in mine},
            }
            Path(args.out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- refitting from run reports ----------------------------------------------------------------

RIDGE = 0.01
"""Weight of the prior (the current factors) against each run's squared relative error: a run or
two cannot move a factor their phases do not show."""


def _sums(breakdown: dict[str, float]) -> tuple[float, float]:
    """(compute, communication) seconds of a predicted breakdown: compute, recompute and the bubble
    (which scales with them); TP, CP, EP, pipeline and data-parallel traffic."""
    b = breakdown
    return (b.get("compute", 0.0) + b.get("recompute", 0.0) + b.get("bubble", 0.0),
            sum(b.get(k, 0.0) for k in ("tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm")))


def _base(report: Any) -> tuple[float, float, float, float, float, bool]:
    """A report's predicted (compute, comm, ZeRO-2/3's every-micro-batch comm, TP comm, optimizer)
    seconds without the factors its plan applied, and whether its plan has tensor parallelism (its
    compute also carried "tp_compute"). ZeRO-2/3's: its data-parallel traffic where its plan runs
    ZeRO-2/3 without a pipeline (PredictedRun.every_microbatch_dp); comm: the traffic that is
    neither that nor TP's."""
    b, used = report.predicted.breakdown_s, getattr(report.predicted, "phase_factors", None) or {}
    tp = getattr(report.predicted, "tp", 1) > 1
    pc, pm = _sums(b)
    pz = b.get("dp_comm", 0.0) if getattr(report.predicted, "every_microbatch_dp", False) else 0.0
    pt = b.get("tp_comm", 0.0)
    compute = used.get("compute", 1.0) * (used.get("tp_compute", 1.0) if tp else 1.0)
    comm = used.get("comm", 1.0)
    return (pc / compute, (pm - pz - pt) / comm, pz / used.get("zero_comm", comm), pt / used.get("tp_comm", comm),
            b.get("optimizer", 0.0) / used.get("optimizer", 1.0), tp)


def predict_with(report: Any, factors: dict[str, float]) -> float:
    """The report's predicted step time had its plan been made with phase `factors` (its figures
    freed of the factors its plan applied, then multiplied by these)."""
    pc, pm, pz, pt, po, tp = _base(report)
    comm = factors.get("comm", 1.0)
    compute = factors.get("compute", 1.0) * (factors.get("tp_compute", 1.0) if tp else 1.0)
    return (compute * pc + comm * pm + factors.get("zero_comm", comm) * pz + factors.get("tp_comm", comm) * pt
            + factors.get("optimizer", 1.0) * po)


def refit(reports: list[Any], old: dict[str, float]) -> tuple[dict[str, float], list[tuple[str, float, float, float]]]:
    """Phase factors from run reports (runtime.report.RunReport), and per report (plan, predicted s,
    refit predicted s, measured s). Each report's figures are first freed of the factors its plan
    applied (PredictedRun.phase_factors), so reports of plans made with different calibrations
    pool: every run a user has made on the cluster counts. Each report's step, less its measured
    optimizer step, is a x compute (x t in a plan with tensor parallelism) + b x comm + z x FSDP
    comm + c x TP comm of those bare figures (compute: compute, recompute and bubble; FSDP comm:
    the data-parallel traffic of ZeRO-2/3 every micro-batch; TP comm: tensor parallelism's; comm:
    the rest of the traffic, CP, EP, pipeline and data-parallel).

    In stages, each factor from the runs that show its phase, as one least-squares fit of all
    together traded one kind of run's phases against the others' (their columns move together: on
    this CPU it read tp_compute 0.44 from runs whose TP plans took 1.3x their prediction), and the
    runs without TP or FSDP have too little traffic to set a factor for theirs (a DDP step's
    all-reduce is a twentieth of it: the step's noise moved b to 1.9, which then mispredicted TP):
    a and b by least squares on the relative errors of the runs with neither TP nor FSDP (of the
    runs without TP, FSDP's traffic counted in comm, when every one has it; of all runs when every
    one has TP), with a weak pull (RIDGE) to the current factors `old`; c, "tp_comm", the median
    over the TP runs of their profiled TP communication (the report's phase) over its bare
    prediction; z, "zero_comm", the median over the FSDP runs without TP of what their traffic took
    once a x compute and b x comm are taken off; t, "tp_compute", the median over the TP runs of
    what their compute took past a x compute once the traffic is taken off (each kept as it was
    without such a run). TP's and FSDP's traffic have factors of their own because on gloo their
    dozens of collectives a step run between and beside computations and share the rank's cores
    with them: on this 2-core machine (examples/gpt.py) 2.5x and 1.8x their bare seconds with
    collectives calibrated back to back (tp 2, and ZeRO-3 with 4 micro-batches, by phase), and
    still 1.4x and 1.3x calibrated after compute (bench_runtime's 11 plans), where the rest of the
    traffic refit to 1.1x. The optimizer's factor: the median of measured over bare predicted."""
    from runtime.report import OPTIMIZER_ROW, PHASE_ROWS

    tp_row = next(row for row, keys, _ in PHASE_ROWS if keys == ("tp_comm",))
    rows, opt, tp_comm = [], [], []
    for r in reports:
        phases = {p.name: p for p in r.phases}
        if not r.predicted.breakdown_s or OPTIMIZER_ROW not in phases:
            continue
        measured = r.measured.step_time_s - phases[OPTIMIZER_ROW].measured_s
        pc, pm, pz, pt, po, tp = _base(r)
        if measured > 0 and pc + pm + pz + pt > 0:
            rows.append((pc / measured, pm / measured, pz / measured, pt / measured, tp))
        if po > 0:
            opt.append(phases[OPTIMIZER_ROW].measured_s / po)
        if pt > 0 and tp_row in phases and phases[tp_row].measured_s > 0:
            tp_comm.append(phases[tp_row].measured_s / pt)
    if not rows:
        raise BadInput("plan calibrate --from-run: no run report with a predicted breakdown and a measured optimizer "
                       "step (reports of plan run from this version)")
    # minimise sum (a x + b y - 1)^2 + RIDGE |(a, b) - (a0, b0)|^2 over the plain runs
    a0, b0 = old.get("compute", 1.0), old.get("comm", 1.0)
    plain = ([(xc, y) for xc, y, yz, yt, tp in rows if not tp and not yz]
             or [(xc, y + yz) for xc, y, yz, yt, tp in rows if not tp] or [(xc, y + yz + yt) for xc, y, yz, yt, _ in rows])
    x = np.array(plain)
    a, b_ = np.linalg.solve(x.T @ x + RIDGE * np.eye(2), x.T @ np.ones(len(x)) + RIDGE * np.array([a0, b0]))
    a, b_ = max(float(a), 0.05), max(float(b_), 0.05)
    o = statistics.median(opt) if opt else old.get("optimizer", 1.0)
    new = {"compute": a, "comm": b_, "optimizer": o}
    if tp_comm:
        new["tp_comm"] = max(statistics.median(tp_comm), 0.05)
    elif "tp_comm" in old:
        new["tp_comm"] = old["tp_comm"]
    c = new.get("tp_comm", b_)
    zero_runs = [(xc, y, yz) for xc, y, yz, yt, tp in rows if yz and not tp]
    if zero_runs:  # a x compute + b x comm + z x FSDP comm = measured (each divided by measured)
        new["zero_comm"] = max(statistics.median((1 - a * xc - b_ * y) / yz for xc, y, yz in zero_runs), 0.05)
    elif "zero_comm" in old:
        new["zero_comm"] = old["zero_comm"]
    z = new.get("zero_comm", b_)
    tp_runs = [(xc, y, yz, yt) for xc, y, yz, yt, tp in rows if tp]
    if tp_runs:  # a x t x compute + b x comm + z x FSDP comm + c x TP comm = measured
        new["tp_compute"] = max(statistics.median((1 - b_ * y - z * yz - c * yt) / (a * xc) for xc, y, yz, yt in tp_runs),
                                0.05)
    elif "tp_compute" in old:
        new["tp_compute"] = old["tp_compute"]
    fitted = [(r.plan, r.predicted.step_time_s, predict_with(r, new), r.measured.step_time_s)
              for r in reports if r.predicted.breakdown_s]
    return new, fitted


# --- the launcher ------------------------------------------------------------------------------


def run_counts(counts: list[int], device: str, timeout_s: float, progress: Callable[[str], None],
               node: Any = None) -> list[dict[str, Any]]:
    """One torchrun launch per process count; each one's figures (rank 0's JSON). `node`
    (runtime.multinode.NodeSpec): this node's share of one launch over several nodes, as `plan run`
    launches them; its figures come back on node 0 only ([] on the others)."""
    import tempfile

    from runtime.launch import free_port
    from runtime.multinode import torchrun_node_args

    out = []
    with tempfile.TemporaryDirectory(prefix="plan-calibrate-") as tmp:
        for n in counts:
            where = f" on each of {node.num_nodes} nodes" if node is not None else ""
            progress(f"measuring with {n} process{'es' * (n > 1)}{where} ...")
            path = Path(tmp) / f"n{n}.json"
            rendezvous = (torchrun_node_args(node) if node is not None
                          else ["--master-addr", "127.0.0.1", "--master-port", str(free_port())])
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), *rendezvous,
                   "-m", "runtime.calibrate", "--out", str(path), "--device", device]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                                      cwd=str(Path(__file__).resolve().parents[1]))
            except subprocess.TimeoutExpired:
                raise PlanError(f"plan calibrate: the launch with {n} processes did not finish in {timeout_s:g} s") from None
            if proc.returncode != 0 or (node is None or node.node_rank == 0) and not path.exists():
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise PlanError(f"plan calibrate: the launch with {n} processes{where} failed: {tail}")
            if path.exists():
                out.append(json.loads(path.read_text()))
    return out


if __name__ == "__main__":
    main()
