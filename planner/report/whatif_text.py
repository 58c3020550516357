"""The words of a `plan whatif` sweep that both the terminal table (``whatif_table``) and the
HTML report (``html_report``) print: one module both import, so neither imports the other for them.
"""

from __future__ import annotations

from typing import Optional

from planner.report.units import fmt_bytes, short
from planner.report.whatif import Point, Sweep


def fmt_days(days: Optional[float]) -> str:
    """Days to train as minutes, hours or days."""
    if days is None:
        return "-"
    if days * 24 < 1:
        return f"{days * 1440:.1f} min"
    return f"{days * 24:.1f} h" if days < 1 else f"{days:,.1f} d"


def compact_plan(p: Point) -> str:
    """The plan line shortened for a table cell (legend under the table)."""
    if not p.fits or p.detail is None:
        return p.plan
    par = p.detail.parallel
    cp = (f" cp={par.cp}" if par.cp > 1 else "") + (f" ep={par.ep}" if par.ep > 1 else "")
    text = f"dp={par.dp} tp={par.tp} pp={par.pp}{cp} mb {par.micro_batch}x{par.num_microbatches} ZeRO-{par.zero}"
    if par.pp > 1:
        text += " " + {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": f"interleaved x{par.virtual_stages}"}[par.schedule]
    return text + ("" if par.recompute == "none" else f" recompute {par.recompute}")


def fmt_cost(p: Point) -> str:
    if p.cost_usd is not None:
        return f"${p.cost_usd:,.0f}" if p.cost_usd >= 100 else f"${p.cost_usd:,.2f}"
    if p.gpu_hours is None:
        return "-"
    return f"{p.gpu_hours:,.0f} GPU-h" if p.gpu_hours >= 100 else f"{p.gpu_hours:.3g} GPU-h"


def fmt_memory(p: Point) -> str:
    """`77.6 / 80 GB`: the fullest GPU (or, when nothing fits, the least needed) against the limit."""
    limit = p.memory_limit_bytes / 1e9
    used = "-" if p.peak_memory_bytes is None else f"{p.peak_memory_bytes / 1e9:.1f}"
    return f"{used}/{limit:.0f} GB"


def summary_lines(sweep: Sweep) -> list[str]:
    """The derived answers in words (the terminal and the HTML report print the same lines)."""
    out = []
    for m in sweep.min_gpus:
        where = "" if m.in_sweep else " (beyond the swept counts)"
        out.append(f"fewest {m.gpu} that train it: " + (f"{m.num_gpus}{where}: {m.plan}" if m.num_gpus else m.plan))
    if sweep.fastest:
        p = sweep.fastest
        out.append(f"fastest: {p.label}, {fmt_days(p.days_to_train) if p.days_to_train else short(p.samples_per_s) + ' samples/s'}, {fmt_cost(p)}")
    if sweep.cheapest:
        p = sweep.cheapest
        out.append(f"cheapest ({sweep.cheapest_basis}): {p.label}, {fmt_days(p.days_to_train)}, {fmt_cost(p)}")
    if sweep.spec.deadline_days is not None:
        p = sweep.deadline_pick
        pick = f"{p.label}, {fmt_days(p.days_to_train)}, {fmt_cost(p)}; " if p else ""
        out.append(f"within {sweep.spec.deadline_days:g} days at the lowest cost: {pick}{sweep.deadline_note}")
    h = sweep.headroom
    if h is not None:
        at_least = lambda capped: "at least " if capped else ""  # noqa: E731
        out.append(f"memory headroom: {fmt_bytes(h.memory_free_bytes)} free on the fullest GPU")
        out.append(f"largest micro-batch that fits: {at_least(h.max_micro_batch_capped)}{h.max_micro_batch} (the plan uses {h.micro_batch}); "
                   f"largest global batch: {at_least(h.max_global_batch_capped)}{h.max_global_batch:,} (the plan's {h.global_batch:,}"
                   + ("; more micro-batches per step cost no memory" if h.max_global_batch_capped else "") + ")")
        out.append(f"model could be {at_least(h.model_scale_capped)}{h.model_scale:.2g}x larger ({short(h.max_params)} parameters) "
                   f"at global batch {h.global_batch:,}, with layers of the same shape")
        if h.seq_scale is not None:
            out.append(f"sequence could be {at_least(h.seq_scale_capped)}{h.seq_scale:.2g}x longer ({h.max_seq_len:,} tokens) at global batch {h.global_batch:,}")
    return out
