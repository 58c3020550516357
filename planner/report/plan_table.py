"""The terminal rendering of a Plan."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.cost.setup import LOW_PRECISIONS
from planner.plan import Plan
from planner.report.units import fmt_bytes, fmt_count, fmt_seconds, make_console


def _rate(x: float | None, unit: str) -> str:
    if x is None:
        return ""
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:,.2f}{suffix} {unit}"
    return f"{x:,.1f} {unit}"


def render_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or make_console()
    c, t, pr, m = plan.cluster, plan.training, plan.predicted, plan.model
    console.print(
        f"[bold]Plan for {m.name}[/bold] ({fmt_count(m.num_params)} parameters"
        + (f", seq {m.seq_len}" if m.seq_len else "")
        + f") on {c.num_gpus} x {c.display_name}, {t.precision}, {t.optimizer}, global batch {t.global_batch}"
    )
    console.print(f"  [bold cyan]{plan.parallel.one_line()}[/bold cyan]")
    console.print(
        f"  step {fmt_seconds(pr.step_time_s)} · {_rate(pr.samples_per_s, 'samples/s')}"
        + (f" · {_rate(pr.tokens_per_s, 'tokens/s')}" if pr.tokens_per_s else "")
        + f" · {pr.model_tflops_per_gpu:,.1f} model TFLOP/s per GPU · MFU {pr.mfu:.1%}"
        # FP8 and NVFP4 plans quote it against the bf16 peak (ClusterInfo.peak_flops), as torchtitan
        # does: their Linear matmuls run at 2-6x it, so it can pass 100%
        + (" of the bf16 peak" if t.precision in LOW_PRECISIONS else "")
    )
    console.print(f"  binds: {escape(plan.binding)}")

    mem = Table(title=f"Memory per GPU (limit {fmt_bytes(c.memory_limit_bytes)})", title_justify="left")
    for col in ("rank", "layers", "weights", "grads", "optimizer", "activations", "reserve", "total", "time/micro-batch"):
        mem.add_column(col, justify="left" if col == "layers" else "right", no_wrap=True)
    for st in plan.stages:
        b = st.memory_bytes
        layers = f"{st.layers[0]} .. {st.layers[-1]} ({len(st.layers)})" if len(st.layers) > 1 else st.layers[0]
        if st.recompute_layers or st.selective_layers:
            layers += f", recompute {len(st.recompute_layers)} full / {len(st.selective_layers)} selective"
        mem.add_row(
            str(st.rank), layers, fmt_bytes(b.weights), fmt_bytes(b.grads), fmt_bytes(b.optimizer),
            fmt_bytes(b.activations), fmt_bytes(b.reserve), fmt_bytes(b.total), fmt_seconds(st.time_per_microbatch_s),
        )
    console.print(mem)

    alt = Table(title="Alternatives", title_justify="left")
    for col in ("plan", "step", "vs this plan", "peak memory"):
        alt.add_column(col, justify="left" if col == "plan" else "right", no_wrap=col != "plan")
    for a in plan.alternatives:
        alt.add_row(a.plan, fmt_seconds(a.step_time_s), f"{pr.step_time_s / a.step_time_s:.2f}x", fmt_bytes(a.peak_memory_bytes))
    dp = plan.data_parallel
    if dp is not None:
        if dp.fits:
            ratio = dp.step_time_s / pr.step_time_s
            versus = "this plan" if abs(ratio - 1) < 1e-4 else f"{ratio:.2f}x " + ("slower" if ratio > 1 else "the time: faster")
            alt.add_row(f"plain data parallel: {dp.plan}", fmt_seconds(dp.step_time_s), versus, fmt_bytes(dp.peak_memory_bytes))
        elif dp.peak_memory_bytes:
            alt.add_row("plain data parallel", "-", "does not fit", f"needs {fmt_bytes(dp.peak_memory_bytes)}")
        else:
            alt.add_row("plain data parallel", "-", "cannot run", dp.note)
    console.print(alt)

    console.print("[bold]Why[/bold]")
    for line in plan.explanation:
        console.print(f"  - {escape(line)}")
    s = plan.solver
    console.print(
        f"solver: {s.status}, {s.seconds:.2f} s; {s.candidates} candidates, {s.pruned} pruned by bounds, {s.ilps_solved} ILPs (HiGHS)"
        + ("; skipped: " + "; ".join(f"{n} x {why}" for why, n in s.skipped.items()) if s.skipped else "")
    )
    for a in plan.assumptions:
        console.print(f"[dim]assumes: {escape(a)}[/dim]")
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
