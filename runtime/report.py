"""RunReport: what a run measured against what its plan predicted. Versioned JSON (planner.RunReport).

Written by rank 0 into the run directory, then by ``plan run`` next to the plan
(``plan.json`` -> ``plan.run.json``). Ratios are measured / predicted; a note in plain words
explains a disagreement of more than 25%.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner import schema
from planner.cost.constants import FRAGMENTATION_GPU
from planner.plan import Plan
from planner.report.units import fmt_bytes, fmt_seconds, make_console

DISAGREE = 0.25
"""A ratio outside [1 - DISAGREE, 1 + DISAGREE] gets a note."""


@dataclass(frozen=True)
class PredictedRun:
    step_time_s: float
    peak_memory_bytes: int
    breakdown_s: dict[str, float] = field(default_factory=dict)
    """The plan's: where the bottleneck rank's step goes (compute, recompute, tp_comm, cp_comm, ep_comm,
    pp_comm, dp_comm, optimizer, bubble)."""
    phase_factors: dict[str, float] = field(default_factory=dict)
    """The plan's calibration factors, included in those figures ({} when none)."""
    tp: int = 1
    """The plan's tensor-parallel degree (its compute carries the "tp_compute" factor when > 1)."""
    zero: int = 0
    pp: int = 1
    """The plan's ZeRO stage and pipeline degree: with ZeRO-2/3 and no pipeline, its data-parallel
    traffic runs every micro-batch and carries the "zero_comm" factor."""

    tensor_bytes: int = 0
    """The plan's fullest rank without its reserve: weights, gradients, optimizer state and
    activations (what a CUDA run's max_memory_allocated measures); 0 in a report from before the field."""
    allocator_bytes: int = 0
    """Those tensors with the allocator's fragmentation (plan.predicted.fragmentation): what the
    caching allocator holds (a CUDA run's max_memory_reserved); the rest of the plan's peak
    (CUDA context, communication buffers) is outside it."""

    @property
    def every_microbatch_dp(self) -> bool:
        """Whether the plan's data-parallel traffic (dp_comm) is ZeRO-2/3's every micro-batch."""
        return self.zero >= 2 and self.pp == 1


@dataclass(frozen=True)
class PhaseRun:
    """One phase of the step, predicted against measured (the slowest rank's median)."""

    name: str
    predicted_s: float
    measured_s: float


@dataclass(frozen=True)
class ProfiledStep:
    """The last step of the run, under torch.profiler, on the rank where it took longest."""

    rank: int
    step_time_s: float
    phases_s: dict[str, float]
    """Seconds per measured phase (runtime.phases.PHASES)."""


PHASE_ROWS = (  # (row, predicted breakdown keys, measured phases)
    ("forward and backward compute", ("compute",), ("forward", "backward", "host")),
    ("recompute", ("recompute",), ("recompute",)),
    ("TP communication", ("tp_comm",), ("tp_comm",)),
    ("CP communication", ("cp_comm",), ("cp_comm",)),
    ("EP communication", ("ep_comm",), ("ep_comm",)),
    ("DP communication (exposed)", ("dp_comm",), ("dp_comm",)),
    ("pipeline communication and bubble", ("pp_comm", "bubble"), ("pp_comm",)),
)
"""The report's phases: the cost model's breakdown keys and the profiled step's phases each row
sums (a stage's wait for its neighbour is pipeline transfer and bubble at once)."""
HOST_ROW = "of which host time between operators"
"""Measured only, inside the compute row: the cost model counts it in the compute it times on a CPU
(and a GPU's kernels hide it)."""
OPTIMIZER_ROW = "optimizer step"


@dataclass(frozen=True)
class MeasuredRun:
    step_time_s: float
    """The slowest rank's median step over the later half of the steps after the first (without the
    profiled last step): runtime.train.timed_steps."""
    step_times_s: tuple[float, ...]
    """Every step on rank 0, warm-up included."""
    peak_memory_bytes: tuple[int, ...]
    """Per rank: CUDA max_memory_reserved (what the caching allocator held, what trainers report),
    or the process's peak RSS on CPU."""
    losses: tuple[float, ...]
    """Per step, the global batch's mean loss."""
    peak_allocated_bytes: tuple[int, ...] = ()
    """Per rank on CUDA: max_memory_allocated (the tensors' peak); () on CPU."""


@dataclass(frozen=True)
class Ratios:
    step_time: float
    memory: float
    """The largest rank's peak against the plan's: on CUDA what the allocator held against the
    plan's tensors with fragmentation (PredictedRun.allocator_bytes), on CPU the peak RSS against
    the plan's whole peak per device."""


@dataclass(frozen=True)
class MeshRank:
    """Where one rank ran: its node (torchrun's group rank) and host, and its mesh coordinates."""

    rank: int
    node: int
    host: str
    local_rank: int
    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class RunReport(schema.Versioned):
    SCHEMA = "planner.RunReport"
    VERSION = 1

    plan: str
    """The plan in one line."""
    plan_path: str
    model_name: str
    device: str
    world_size: int
    steps: int
    predicted: PredictedRun
    measured: MeasuredRun
    ratios: Ratios
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    """Where the runtime departs from the plan (e.g. embeddings replicated under TP)."""
    phases: tuple[PhaseRun, ...] = ()
    """The step phase by phase, predicted against measured: from the profiled step (`profiled`),
    each phase of the cost model's breakdown (PHASE_ROWS) and the optimizer step; without one (a
    run of under 3 steps), the optimizer step (the timed steps' median) and the rest of the step."""
    profiled: Optional[ProfiledStep] = None
    wall_s: Optional[float] = None
    mesh: tuple[MeshRank, ...] = ()
    """Every rank's node, host and (pp, dp, cp, tp) coordinates, as the run placed them."""
    schema: str = field(default="planner.RunReport")
    version: int = field(default=1)


def _notes(device: str, world_size: int, ratios: Ratios, steps: int) -> list[str]:
    notes = []
    if abs(ratios.step_time - 1) > DISAGREE:
        slower = ratios.step_time > 1
        causes = []
        if device == "cpu":
            cores = os.cpu_count() or 1
            causes.append("CPU timings are noisy (8-10% per block with two threads)")
            if slower and world_size > cores:
                causes.append(f"{world_size} processes share {cores} cores, so threads are oversubscribed")
            causes.append(
                "gloo collectives on CPU are slower than the link the cost model assumes" if slower
                else "the cost model's CPU link and per-collective latency are pessimistic for a model this small"
            )
        if slower and steps < 6:
            causes.append("with so few steps the first steps' warm-up (allocation, kernel choice) weighs in: "
                          "the step time is the median of the later half of the steps after the first")
        notes.append(
            f"the step took {ratios.step_time:.2f}x the predicted time ({'slower' if slower else 'faster'}); likely: "
            + "; ".join(causes or ["the cost model's efficiencies do not match this machine"]) + "."
        )
    if abs(ratios.memory - 1) > DISAGREE:
        if device == "cpu":
            notes.append(
                f"peak memory is {ratios.memory:.2f}x the prediction: on CPU it is the process's peak RSS, "
                "which includes the Python and torch runtime (hundreds of MB) the plan does not count."
            )
        else:
            notes.append(
                f"peak memory is {ratios.memory:.2f}x the prediction: allocator fragmentation or activations the "
                "profile did not see."
            )
    return notes


def build_report(
    plan: Plan,
    plan_path: str,
    device: str,
    steps: int,
    step_time_s: float,
    step_times_s: Sequence[float],
    peak_memory_bytes: Sequence[int],
    losses: Sequence[float],
    peak_allocated_bytes: Sequence[int] = (),
    warnings: Sequence[str] = (),
    optimizer_s: float | None = None,
    mesh: Sequence[MeshRank] = (),
    phases_s: dict[str, float] | None = None,
    profiled_step_s: float = 0.0,
    profiled_rank: int = 0,
) -> RunReport:
    world_size = plan.parallel.world_size
    tensors, allocator = _allocator_bytes(plan)
    predicted = PredictedRun(plan.predicted.step_time_s, plan.predicted.peak_memory_bytes, dict(plan.predicted.breakdown_s),
                             dict(plan.predicted.phase_factors), plan.parallel.tp, plan.parallel.zero, plan.parallel.pp,
                             tensors, allocator)
    allocated = tuple(b for b in peak_allocated_bytes if b)
    against = allocator if allocated and allocator else predicted.peak_memory_bytes
    profiled = ProfiledStep(profiled_rank, profiled_step_s, dict(phases_s)) if phases_s else None
    phases = _phases(predicted, step_time_s, optimizer_s, profiled)
    ratios = Ratios(
        step_time=step_time_s / predicted.step_time_s if predicted.step_time_s else float("inf"),
        memory=max(peak_memory_bytes) / against if against else float("inf"),
    )
    return RunReport(
        plan=plan.parallel.one_line(),
        plan_path=plan_path,
        model_name=plan.model.name,
        device=device,
        world_size=world_size,
        steps=steps,
        predicted=predicted,
        measured=MeasuredRun(step_time_s, tuple(step_times_s), tuple(peak_memory_bytes), tuple(losses), allocated),
        ratios=ratios,
        notes=tuple(_notes(device, world_size, ratios, steps) + _phase_notes(phases)),
        warnings=tuple(warnings),
        phases=phases,
        profiled=profiled,
        mesh=tuple(mesh),
    )


def _allocator_bytes(plan: Plan) -> tuple[int, int]:
    """(tensors, tensors with the allocator's fragmentation) of the plan's fullest rank."""
    if not plan.stages:
        return 0, 0
    m = max((s.memory_bytes for s in plan.stages), key=lambda m: m.total)
    tensors = m.weights + m.grads + m.optimizer + m.activations
    fragmentation = plan.predicted.fragmentation
    if fragmentation is None:  # a plan from before the field: the reserve is fixed + fragmentation x tensors
        fragmentation = FRAGMENTATION_GPU
    return tensors, int(tensors * (1 + fragmentation))


def _phases(predicted: PredictedRun, step_time_s: float, optimizer_s: float | None,
            profiled: ProfiledStep | None) -> tuple[PhaseRun, ...]:
    """The report's phase rows: each row of PHASE_ROWS the plan predicts or the profiled step
    measured (the compute's host time between operators also on a line of its own), the optimizer
    step."""
    if optimizer_s is None:
        return ()
    b = predicted.breakdown_s
    opt = b.get("optimizer", 0.0)
    if profiled is None:
        return (PhaseRun("forward, backward, communication, bubble", predicted.step_time_s - opt, step_time_s - optimizer_s),
                PhaseRun(OPTIMIZER_ROW, opt, optimizer_s))
    rows = []
    for name, keys, measured in PHASE_ROWS:
        pred = sum(b.get(k, 0.0) for k in keys)
        meas = sum(profiled.phases_s.get(k, 0.0) for k in measured)
        if pred > 0 or meas > 1e-3 * profiled.step_time_s:
            rows.append(PhaseRun(name, pred, meas))
        if keys == ("compute",):
            rows.append(PhaseRun(HOST_ROW, 0.0, profiled.phases_s.get("host", 0.0)))
    # the profiled step's: a ZeRO-1 step's broadcast of the updated shards is DP communication there
    rows.append(PhaseRun(OPTIMIZER_ROW, opt, profiled.phases_s.get("optimizer", optimizer_s)))
    return tuple(rows)


def _phase_notes(phases: Sequence[PhaseRun], most: int = 2) -> list[str]:
    """The (at most `most`) phases furthest from their prediction by the time they are off, among
    those off by more than DISAGREE: a phase predicted as none and measured at more than a tenth of
    the step counts too."""
    total = sum(p.measured_s for p in phases if p.name != HOST_ROW)
    off = [p for p in phases if p.name != HOST_ROW and (
        abs(p.measured_s / p.predicted_s - 1) > DISAGREE if p.predicted_s > 0 else p.measured_s > 0.1 * total)]
    off = sorted(off, key=lambda p: -abs(p.measured_s - p.predicted_s))[:most]
    if not off:
        return []
    parts = [f"{p.name}, {fmt_seconds(p.measured_s)} measured against {fmt_seconds(p.predicted_s)} predicted"
             + (f" ({p.measured_s / p.predicted_s:.2f}x)" if p.predicted_s > 0 else "") for p in off]
    return [f"the largest departure{'s' * (len(parts) > 1)}: " + "; ".join(parts)]


def tp_groups_across_nodes(mesh: Sequence[MeshRank]) -> list[tuple[int, ...]]:
    """The tensor-parallel groups (ranks sharing pp, dp, cp) whose ranks ran on more than one node."""
    groups: dict[tuple[int, int, int], list[MeshRank]] = {}
    for r in mesh:
        groups.setdefault((r.pp, r.dp, r.cp), []).append(r)
    return [tuple(r.rank for r in g) for g in groups.values() if len({r.node for r in g}) > 1]


def mesh_lines(mesh: Sequence[MeshRank]) -> list[str]:
    """The mesh node by node (which global ranks at which coordinates), and where the TP groups ran;
    [] for a run on one node."""
    nodes = sorted({r.node for r in mesh})
    if len(nodes) < 2:
        return []
    lines = []
    for node in nodes:
        mine = sorted((r for r in mesh if r.node == node), key=lambda r: r.rank)
        cells = ", ".join(f"{r.rank} (pp{r.pp} dp{r.dp} cp{r.cp} tp{r.tp})" for r in mine)
        lines.append(f"node {node} ({mine[0].host}): ranks {cells}")
    spanning = tp_groups_across_nodes(mesh)
    tp = max(r.tp for r in mesh) + 1
    if tp == 1:
        lines.append("tensor parallel: none (tp 1)")
    elif spanning:
        lines.append(f"tensor-parallel groups across nodes: {'; '.join(' '.join(map(str, g)) for g in spanning)}")
    else:
        lines.append(f"tensor-parallel groups (tp {tp}) each inside one node")
    return lines


def report_path(plan_path: str | Path) -> Path:
    """``plan.json`` -> ``plan.run.json`` (next to the plan)."""
    p = Path(plan_path)
    stem = p.name[: -len(".json")] if p.name.endswith(".json") else p.name
    return p.with_name(f"{stem}.run.json")


def render_report(report: RunReport, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(f"[bold]{report.model_name}[/] on {report.world_size} x {report.device}: {report.plan}")
    table = Table(show_header=True, header_style="bold")
    table.add_column("")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("measured / predicted", justify="right")
    table.add_row(
        "step time", fmt_seconds(report.predicted.step_time_s), fmt_seconds(report.measured.step_time_s),
        f"{report.ratios.step_time:.2f}x",
    )
    for phase in report.phases:
        ratio = f"{phase.measured_s / phase.predicted_s:.2f}x" if phase.predicted_s > 0 else "-"
        indent = "    " if phase.name == HOST_ROW else "  "
        predicted = "-" if phase.name == HOST_ROW else fmt_seconds(phase.predicted_s)
        table.add_row(f"{indent}{phase.name}", predicted, fmt_seconds(phase.measured_s), ratio)
    held, allocated = report.measured.peak_memory_bytes, report.measured.peak_allocated_bytes
    if allocated and report.predicted.allocator_bytes:  # CUDA: the allocator's peaks, reserved and allocated
        table.add_row("peak memory per rank (allocator reserved)", fmt_bytes(report.predicted.allocator_bytes),
                      fmt_bytes(max(held)), f"{report.ratios.memory:.2f}x")
        table.add_row("  of which tensors (allocated)", fmt_bytes(report.predicted.tensor_bytes), fmt_bytes(max(allocated)),
                      f"{max(allocated) / report.predicted.tensor_bytes:.2f}x")
    else:
        table.add_row("peak memory per rank", fmt_bytes(report.predicted.peak_memory_bytes), fmt_bytes(max(held)),
                      f"{report.ratios.memory:.2f}x")
    console.print(table)
    if allocated and report.predicted.allocator_bytes:
        console.print(f"memory: the plan's peak per device, {fmt_bytes(report.predicted.peak_memory_bytes)}, adds "
                      f"{fmt_bytes(report.predicted.peak_memory_bytes - report.predicted.allocator_bytes)} outside the "
                      "allocator (CUDA context, communication buffers)")
    if report.profiled is not None:
        console.print(f"phases: the last step, under torch.profiler, on rank {report.profiled.rank} (the slowest there: "
                      f"{fmt_seconds(report.profiled.step_time_s)}; left out of the step time)")
    lines = mesh_lines(report.mesh)
    if lines:
        console.print(f"mesh over {len({r.node for r in report.mesh})} nodes:")
        for line in lines:
            console.print(f"  {escape(line)}")
    losses = ", ".join(f"{x:.4f}" for x in report.measured.losses)
    console.print(f"losses over {report.steps} step(s): {losses}")
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    for n in report.notes:
        console.print(f"note: {escape(n)}")
