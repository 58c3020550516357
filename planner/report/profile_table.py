"""The terminal table of `plan profile`."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.profile.types import LayerProfile, ModelProfile
from planner.report.units import fmt_bytes, fmt_count, fmt_seconds, make_console, short

# Runs of identical layers longer than this are folded into one row ("x N").
FOLD_AT = 3


def _rows(profile: ModelProfile) -> list[tuple[LayerProfile, int]]:
    """(layer, repeat count): consecutive layers of one kind are folded when there are many."""
    rows: list[tuple[LayerProfile, int]] = []
    for layer in profile.layers:
        if rows and rows[-1][0].kind == layer.kind and rows[-1][0].cut_after_ok == layer.cut_after_ok:
            rows[-1] = (rows[-1][0], rows[-1][1] + 1)
        else:
            rows.append((layer, 1))
    out: list[tuple[LayerProfile, int]] = []
    for layer, n in rows:
        if n > FOLD_AT:
            out.append((layer, n))
        else:
            out.extend((profile.layers[layer.index + k], 1) for k in range(n))
    return out


def render_profile(profile: ModelProfile, console: Console | None = None) -> None:
    console = console or make_console()
    t = profile.totals
    title = (
        f"{profile.model_name}: {fmt_count(t.num_params)} parameters, batch {profile.batch_size}"
        + (f" x seq {profile.seq_len}" if profile.seq_len else "")
        + f", {profile.dtype}, "
        + ("measured on the local CPU" if profile.mode == "materialized" else "fake tensors (meta)")
    )
    table = Table(title=title, title_justify="left")
    for col, just in (
        ("#", "right"), ("layer", "left"), ("kind", "left"), ("params", "right"),
        ("fwd FLOP", "right"), ("bwd FLOP", "right"), ("saved B", "right"), ("cut B", "right"),
        ("fwd", "right"), ("bwd", "right"),
    ):
        table.add_column(col, justify=just, no_wrap=True)
    for layer, n in _rows(profile):
        idx = str(layer.index) if n == 1 else f"{layer.index}-{layer.index + n - 1}"
        name = layer.name if n == 1 else f"{layer.name} (each of {n})"
        if len(layer.modules) > 1:
            name += f" +{len(layer.modules) - 1}"
        cut = short(layer.output_bytes) if layer.cut_after_ok else ("-" if layer.index == len(profile.layers) - 1 else "no cut")
        table.add_row(
            idx, name, layer.kind, short(layer.num_params), short(layer.fwd_flops),
            short(layer.bwd_flops), short(layer.activation_bytes), cut,
            fmt_seconds(layer.fwd_s), fmt_seconds(layer.bwd_s),
        )
    table.add_section()
    table.add_row(
        "", "total", f"{len(profile.kinds())} kinds", short(t.num_params), short(t.fwd_flops),
        short(t.bwd_flops), short(t.activation_bytes), "", fmt_seconds(t.fwd_s), fmt_seconds(t.bwd_s),
    )
    console.print(table)
    console.print(
        f"weights {fmt_bytes(t.param_bytes)} ({profile.dtype}); FLOPs and bytes (saved for backward; "
        f"sent by a pipeline cut after the layer) are for the whole batch of {profile.batch_size}; "
        f"profiled in {profile.profile_s:.1f} s"
    )
    if profile.pipeline_split == "traced":
        console.print("pipeline cuts: split by torch.distributed.pipelining's tracer (cut B counts every tensor crossing)")
    elif profile.pipeline_split_note:
        console.print(f"pipeline cuts: only where one layer's output is all that crosses; {profile.pipeline_split_note}")
    if profile.cp_blocker:
        console.print(f"context parallelism: cannot run on this model: {profile.cp_blocker}")
    elif profile.cp_blocker == "":
        kv = sum(l.attention_kv_bytes for l in profile.layers)
        console.print(f"context parallelism: can split the sequence ({profile.seq_len}); its ring passes "
                      f"{fmt_bytes(kv)} of keys and values per batch (every attention layer's)")
    moe = [l for l in profile.layers if l.moe_experts]
    if moe:
        experts = sum(l.expert_params for l in moe)
        top_k = max(l.moe_top_k for l in moe)
        per_expert = sum(l.moe_dispatch_bytes for l in moe) / len(moe) / moe[0].moe_experts
        tokens = profile.batch_size * profile.seq_len * top_k / moe[0].moe_experts if profile.seq_len and top_k else None
        console.print(
            f"mixture of experts: {len(moe)} layers of {moe[0].moe_experts} experts"
            + (f", top {top_k} per token" if top_k else "")
            + f"; the experts hold {short(experts)} parameters ({experts / max(t.num_params, 1):.0%}), "
            f"{short(experts / len(moe) / moe[0].moe_experts)} each; each expert receives "
            + (f"{tokens:,.0f} tokens ({fmt_bytes(per_expert)})" if tokens else fmt_bytes(per_expert))
            + " per batch on average (what expert parallelism's all-to-alls move)")
    for w in profile.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
