"""`plan whatif --report FILE.html`: one self-contained HTML file (inline SVG charts, inline CSS, no
URLs) with the sweep's answers, its table, four charts and the assumptions.

Charts (matplotlib, Agg): throughput against GPU count per type with ideal linear scaling from the
type's smallest fitting count; days and cost to train; memory per GPU of each chosen plan (its
fullest pipeline rank) as stacked bars against the limit; the featured plan's pipeline schedule.

The pipeline timeline is a simulation, not a measurement: each rank's forward and backward of
one micro-batch take its stage's `time_per_microbatch_s` split by the stage's FLOPs (forward :
backward, with a fully recomputed layer's forward added to the backward; about 1 : 2), divided by
the chunks per rank when interleaved. Ranks run their ops in the schedule's order (GPipe: all
forwards, then all backwards; 1F1B: p - rank - 1 warm-up forwards, then one forward one backward;
interleaved: Megatron-LM's order, 2(p - rank - 1) + (v - 1)p warm-up chunk forwards), each op as
soon as its input from the neighbouring stage is done; p2p sends take no time. Gaps are idle time.
"""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from planner.plan import Plan  # noqa: E402
from planner.profile.types import ModelProfile  # noqa: E402
from planner.report.units import fmt_count, fmt_seconds, short  # noqa: E402
from planner.report.whatif import Point, Sweep  # noqa: E402
from planner.report.whatif_text import compact_plan, fmt_cost, fmt_days, fmt_memory, summary_lines  # noqa: E402

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
MEMORY_PARTS = (("weights", "#4c72b0"), ("grads", "#55a868"), ("optimizer", "#c44e52"),
                ("activations", "#dd8452"), ("reserve", "#8c8c8c"))
Op = tuple[str, int, int]  # ("F" | "B", micro-batch, chunk)


# -- pipeline schedule simulation ---------------------------------------------------------------
def schedule_order(p: int, m: int, v: int, schedule: str) -> list[list[Op]]:
    """Each rank's ops in the order it runs them."""
    out = []
    for rank in range(p):
        if schedule == "gpipe":
            out.append([("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)])
            continue
        total = m * v

        def fwd(k: int) -> Op:
            return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

        def bwd(k: int) -> Op:
            return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

        warm = min(p - rank - 1 if v == 1 else 2 * (p - rank - 1) + (v - 1) * p, total)
        ops = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            ops += [fwd(warm + k), bwd(k)]
        ops += [bwd(k) for k in range(total - warm, total)]
        out.append(ops)
    return out


def simulate(fwd_s: list[float], bwd_s: list[float], m: int, v: int, schedule: str) -> list[list[tuple[float, float, Op]]]:
    """(start, duration, op) per rank; fwd_s/bwd_s per rank for one micro-batch over all its chunks."""
    p = len(fwd_s)
    order = schedule_order(p, m, v, schedule)
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> end
    free, pos = [0.0] * p, [0] * p
    out: list[list[tuple[float, float, Op]]] = [[] for _ in range(p)]
    while any(pos[r] < len(order[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(order[r]):
                kind, j, c = order[r][pos[r]]
                s = c * p + r
                dep = ("F", j, s - 1) if kind == "F" else (("B", j, s + 1) if s < last else ("F", j, s))
                if kind == "F" and s == 0:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep]
                else:
                    break
                dur = (fwd_s[r] if kind == "F" else bwd_s[r]) / v
                start = max(free[r], ready)
                free[r] = done[(kind, j, s)] = start + dur
                out[r].append((start, dur, (kind, j, c)))
                pos[r] += 1
                moved = True
        assert moved, "schedule deadlocked"
    return out


def stage_split(plan: Plan, profile: ModelProfile) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per micro-batch of each rank (module docstring)."""
    by_name = {l.name: l for l in profile.layers}
    fwd, bwd = [], []
    for st in plan.stages:
        f = sum(by_name[n].fwd_flops for n in st.layers if n in by_name)
        b = sum(by_name[n].bwd_flops for n in st.layers if n in by_name)
        b += sum(by_name[n].fwd_flops for n in st.recompute_layers if n in by_name)
        share = f / (f + b) if f + b > 0 else 1 / 3
        fwd.append(st.time_per_microbatch_s * share)
        bwd.append(st.time_per_microbatch_s * (1 - share))
    return fwd, bwd


# -- charts -------------------------------------------------------------------------------------
def _svg(fig, salt: str) -> str:
    buf = io.StringIO()
    with plt.rc_context({"svg.hashsalt": salt}):  # distinct ids across the inline SVGs
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _by_type(sweep: Sweep) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in sweep.points:
        out.setdefault(p.gpu, []).append(p)
    return out


def _y_axis(ax, values: list[float], fmt) -> None:
    """Log scale when the values span more than a decade, else linear; ticks in plain figures (`fmt`)."""
    values = [v for v in values if v]
    if values and max(values) / min(values) > 10:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: fmt(y) if f"{y:.0e}"[0] in "25" else ""))
    else:
        ax.set_ylim(0, max(values or [1]) * 1.1)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: fmt(y)))


def _gpu_axis(ax, counts: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.grid(True, alpha=0.3)


def throughput_chart(sweep: Sweep) -> str:
    tokens = sweep.seq_len is not None
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ys: list[float] = []
    for i, (gpu, pts) in enumerate(_by_type(sweep).items()):
        bad = [p.num_gpus for p in pts if not p.fits]
        if bad:  # counts where nothing fits: crosses on the axis
            ax.plot(bad, [0.03 + 0.05 * i] * len(bad), "x", color=COLORS[i % 8], ms=9, mew=2, transform=ax.get_xaxis_transform(),
                    clip_on=False, label=f"{gpu}: does not fit")
        ok = [p for p in pts if p.fits]
        if not ok:
            continue
        y = [(p.tokens_per_s if tokens else p.samples_per_s) for p in ok]
        ys += y + [y[0] * ok[-1].num_gpus / ok[0].num_gpus]
        ax.plot([p.num_gpus for p in ok], y, "o-", color=COLORS[i % 8], label=gpu)
        ax.plot([p.num_gpus for p in ok], [y[0] * p.num_gpus / ok[0].num_gpus for p in ok], "--", color=COLORS[i % 8],
                alpha=0.5, label=f"{gpu}, linear from {ok[0].num_gpus}")
    _gpu_axis(ax, list(sweep.spec.gpu_counts))
    _y_axis(ax, ys, short)
    ax.set_ylabel("tokens/s" if tokens else "samples/s")
    ax.set_title("Throughput against GPU count (dashed: ideal linear scaling)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _svg(fig, "throughput")


def train_chart(sweep: Sweep) -> Optional[str]:
    if not any(p.days_to_train for p in sweep.points):
        return None
    priced = bool(sweep.spec.prices_per_gpu_hour)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (gpu, pts) in enumerate(_by_type(sweep).items()):
        ok = [p for p in pts if p.fits]
        left.plot([p.num_gpus for p in ok], [p.days_to_train for p in ok], "o-", color=COLORS[i % 8], label=gpu)
        right.plot([p.num_gpus for p in ok], [p.cost_usd if priced else p.gpu_hours for p in ok], "o-", color=COLORS[i % 8], label=gpu)
    if sweep.spec.deadline_days:
        left.axhline(sweep.spec.deadline_days, color="k", ls=":", label=f"deadline {sweep.spec.deadline_days:g} days")
    for name, p, marker in (("fastest", sweep.fastest, "*"), ("cheapest", sweep.cheapest, "D"), ("deadline pick", sweep.deadline_pick, "s")):
        if p is not None and p.days_to_train is not None:
            left.plot(p.num_gpus, p.days_to_train, marker, ms=13, mfc="none", mec="k", mew=1.5, label=name)
            right.plot(p.num_gpus, p.cost_usd if priced else p.gpu_hours, marker, ms=13, mfc="none", mec="k", mew=1.5, label=name)
    for ax in (left, right):
        _gpu_axis(ax, list(sweep.spec.gpu_counts))
        ax.legend(fontsize=8, markerscale=0.6)
    ok = [p for p in sweep.points if p.fits]
    _y_axis(left, [p.days_to_train for p in ok] + [sweep.spec.deadline_days or 0], lambda d: f"{d:.3g}")
    _y_axis(right, [(p.cost_usd if priced else p.gpu_hours) for p in ok], (lambda c: "$" + short(c)) if priced else (lambda h: short(h) if h >= 1000 else f"{h:.3g}"))
    left.set_ylabel("days")
    left.set_title("Time to train")
    right.set_ylabel("US dollars" if priced else "GPU-hours")
    right.set_title("Cost to train" + ("" if priced else " (no --price: GPU-hours)"))
    return _svg(fig, "train")


def memory_chart(sweep: Sweep) -> str:
    groups = _by_type(sweep)
    top_bytes = max(p.memory_limit_bytes for p in sweep.points) * 1.15  # one y axis for all types
    fig, axes = plt.subplots(1, len(groups), figsize=(max(5.0, 3.2 * len(groups)), 4.4), sharey=True, squeeze=False)
    for ax, (gpu, pts) in zip(axes[0], groups.items()):
        xs = range(len(pts))
        for x, p in zip(xs, pts):
            if p.fits and p.detail is not None:
                mem = max(p.detail.stages, key=lambda st: st.memory_bytes.total).memory_bytes
                bottom = 0.0
                for part, color in MEMORY_PARTS:
                    value = getattr(mem, part) / 1e9
                    ax.bar(x, value, bottom=bottom, color=color, width=0.7, label=part if x == 0 or bottom == 0 else None)
                    bottom += value
            elif p.peak_memory_bytes:  # drawn to the top of the axis; the label says how much
                ax.bar(x, min(p.peak_memory_bytes, top_bytes) / 1e9, color="white", edgecolor="#c44e52", hatch="//", width=0.7)
                ax.text(x, p.memory_limit_bytes / 2e9, f"needs\n{p.peak_memory_bytes / 1e9:.3g} GB", ha="center", va="center",
                        fontsize=7, color="#c44e52", bbox={"fc": "white", "ec": "none", "pad": 1})
            ax.hlines(p.memory_limit_bytes / 1e9, x - 0.45, x + 0.45, colors="k", linestyles="--")
        ax.set_xticks(list(xs), [str(p.num_gpus) for p in pts], rotation=90 if len(pts) > 5 else 0)
        ax.set_xlabel("GPUs")
        ax.set_title(gpu, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(0, top_bytes / 1e9)
    axes[0][0].set_ylabel("GB on the fullest GPU")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in MEMORY_PARTS]
    handles += [plt.Line2D([0], [0], color="k", ls="--"), plt.Rectangle((0, 0), 1, 1, fc="white", ec="#c44e52", hatch="//")]
    labels = [n for n, _ in MEMORY_PARTS] + ["limit", "least needed (no fit)"]
    fig.legend(handles, labels, loc="lower center", ncol=7, fontsize=8, bbox_to_anchor=(0.5, -0.08))
    fig.suptitle("Memory per GPU of each chosen plan (its fullest pipeline rank) against the limit")
    return _svg(fig, "memory")


def featured_pipeline(sweep: Sweep) -> tuple[Optional[Point], str]:
    """The chosen configuration if it pipelines, else the fastest one that does."""
    chosen = sweep.chosen()
    if chosen is not None and chosen.detail is not None and chosen.detail.parallel.pp > 1:
        return chosen, "the chosen configuration"
    piped = [p for p in sweep.points if p.fits and p.detail is not None and p.detail.parallel.pp > 1]
    if not piped:
        return chosen, "the chosen configuration (no swept plan uses a pipeline)"
    best = max(piped, key=lambda p: p.samples_per_s)
    return best, f"the fastest plan with a pipeline ({chosen.label if chosen else 'the chosen one'} has none)"


def pipeline_chart(sweep: Sweep, point: Point) -> tuple[str, str]:
    plan = point.detail
    assert plan is not None
    par = plan.parallel
    v = par.virtual_stages if par.schedule == "interleaved" and par.pp > 1 else 1
    fwd, bwd = stage_split(plan, sweep.profile)
    ops = simulate(fwd, bwd, par.num_microbatches, v, par.schedule if par.pp > 1 else "1f1b")
    end = max(s + d for rank in ops for s, d, _ in rank)
    busy = sum(d for rank in ops for _, d, _ in rank)
    idle = 1 - busy / (end * len(ops))
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.45 * len(ops)))
    label_ops = par.num_microbatches * v <= 24
    for r, rank in enumerate(ops):
        ax.broken_barh([(0, end)], (r - 0.4, 0.8), color="#eeeeee")
        for kind, color in (("F", "#4c72b0"), ("B", "#dd8452")):
            ax.broken_barh([(s, d) for s, d, op in rank if op[0] == kind], (r - 0.4, 0.8), color=color, edgecolor="white", linewidth=0.3)
        if label_ops:
            for s, d, (_, j, _) in rank:
                ax.text(s + d / 2, r, str(j + 1), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ops)), [f"rank {r}" for r in range(len(ops))])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: fmt_seconds(x) if x else "0"))
    ax.set_xlabel("time within one step (pipeline part; the gradient sync and optimizer step follow)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4c72b0", "#dd8452", "#eeeeee")]
    ax.legend(handles, ["forward", "backward", "idle"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"{point.label}: {compact_plan(point)}: {idle:.1%} idle", fontsize=10)
    times = [st.time_per_microbatch_s for st in plan.stages]
    model_s = par.num_microbatches * max(times) + (sum(times) - max(times)) / v
    note = (f"Simulated pipeline part: {fmt_seconds(end)} (the cost model's: {fmt_seconds(model_s)}, of a "
            f"{fmt_seconds(plan.predicted.step_time_s)} step); the ranks are idle {idle:.1%} of it: the fill-and-drain "
            f"bubble ({fmt_seconds(plan.predicted.bubble_s)} on the slowest rank) plus waiting for slower stages "
            f"(forward + backward per micro-batch: {fmt_seconds(min(times))} to {fmt_seconds(max(times))} by rank). "
            + ("Numbers are micro-batches. " if label_ops else "")
            + "Forward : backward split by the stage's FLOPs (recomputed forwards count as backward).")
    return _svg(fig, "pipeline"), note


# -- the page -----------------------------------------------------------------------------------
CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1250px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; white-space: normal; } td.nw { white-space: nowrap; }
tr.nofit td { color: #a33; } .tag { color: #175; font-weight: bold; }
.chart svg { max-width: 100%; height: auto; } .note { color: #555; font-size: 0.9em; }
ul.answers li { margin: 0.25em 0; }
"""


def _e(x: object) -> str:
    return html.escape(str(x))


def _table(sweep: Sweep) -> str:
    head = ["GPU", "GPUs", "best plan", "batch", "step", "samples/s", "tokens/s", "MFU", "memory / limit", "time", "cost", "scaling", ""]
    rows = ["<tr>" + "".join(f'<th class="{"l" if h in ("GPU", "best plan") else ""}">{_e(h)}</th>' for h in head) + "</tr>"]
    for p in sweep.points:
        mem = fmt_memory(p)
        tag = ", ".join(n for n, q in (("fastest", sweep.fastest), ("cheapest", sweep.cheapest), ("deadline pick", sweep.deadline_pick)) if q is p)
        if p.fits:
            cells = [f"{p.global_batch:,}" + ("*" if p.batch_note else ""), fmt_seconds(p.step_time_s), short(p.samples_per_s), short(p.tokens_per_s), f"{p.mfu:.1%}", mem,
                     fmt_days(p.days_to_train), fmt_cost(p), f"{p.scaling_efficiency:.0%}" if p.scaling_efficiency is not None else "-"]
        else:
            cells = ["-", "-", "-", "-", "-", mem, "-", "-", "-"]
        rows.append(f'<tr class="{"" if p.fits else "nofit"}"><td class="l nw">{_e(p.gpu)}</td><td>{p.num_gpus}</td>'
                    f'<td class="l nw" title="{_e(p.plan)}">{_e(compact_plan(p))}</td>' + "".join(f"<td>{_e(c)}</td>" for c in cells)
                    + f'<td class="l tag">{_e(tag)}</td></tr>')
    return "<table>" + "".join(rows) + "</table>"


def _hardware(sweep: Sweep) -> str:
    head = "<tr><th class='l'>GPU</th><th>dense TFLOP/s</th><th>memory GB</th><th>HBM GB/s</th><th>in a node GB/s</th>" \
           "<th>across nodes GB/s</th><th>per node</th><th class='l'>sources</th></tr>"
    rows = []
    for g in sweep.gpus.values():
        src = "; ".join(f"{k}: {v}" for k, v in g.sources.items())
        peak = g.peak_flops.get(sweep.spec.precision)
        rows.append(
            f"<tr><td class='l'>{_e(g.name)}<br><span class='note'>{_e(g.display_name)}</span></td>"
            f"<td>{peak / 1e12:,.1f}</td><td>{g.memory_gb:.0f}</td><td>{g.hbm_bandwidth_Bps / 1e9:,.0f}</td>"
            f"<td>{g.intra_node_bandwidth_Bps / 1e9:,.0f}</td><td>{g.inter_node_bandwidth_Bps / 1e9:,.1f}</td>"
            f"<td>{g.gpus_per_node}</td><td class='l note'>{_e(src)}</td></tr>"
            if peak else ""
        )
    return "<table>" + head + "".join(rows) + "</table>"


def _not_hardware(sweep: Sweep) -> list[str]:
    """The assumptions less the per-GPU lines (the hardware table shows those, with sources)."""
    return [a for a in sweep.assumptions if not any(a.startswith(f"{g.name} (") for g in sweep.gpus.values())]


def _batch_note(sweep: Sweep) -> str:
    b = sweep.batching
    if b is None:
        return ""
    if b.scale:
        return (f"--scale-batch: the global batch grows with the GPUs ({b.global_batch / b.smallest_count:g} samples per GPU), "
                "so the speed-up can exceed linear.")
    odd = [f"{p.label}: {p.batch_note}" for p in sweep.points if p.batch_note]
    return (f"Every point trains at one global batch ({b.basis}), so throughput, scaling, days and cost compare like "
            "with like" + (f"; except {'; '.join(odd)}." if odd else "."))


def render_report(sweep: Sweep) -> str:
    s = sweep.spec
    seq = f", sequence {sweep.seq_len:,}" if sweep.seq_len else ""
    length = (f"{fmt_count(s.tokens)} tokens" if s.tokens else f"{s.steps:,} steps" if s.steps else "no training length given (--tokens/--steps)")
    parts = [
        f"<h1>What if: {_e(sweep.model_name)}</h1>",
        f"<p>{_e(fmt_count(sweep.num_params))} parameters{_e(seq)}; {_e(s.precision)}, {_e(s.optimizer)}{_e(', for --trainer ' + s.trainer if s.trainer != 'this' else '')}; "
        f"GPU types {_e(', '.join(sweep.gpus))} at {_e(', '.join(map(str, s.gpu_counts)))} GPUs; {_e(length)}. "
        f"<span class='note'>{_e(sweep.model_path)}</span></p>",
        "<h2>Answers</h2><ul class='answers'>" + "".join(f"<li>{_e(x)}</li>" for x in summary_lines(sweep)) + "</ul>",
        "<h2>Every configuration</h2>", _table(sweep),
        "<p class='note'>Each row is what <code>plan MODEL.py --gpus N --gpu TYPE</code> prints for that cluster "
        "(the plan shortened: mb BxM is micro-batches of B samples, M per step per replica; hover for the full line). "
        "Batch: the global batch, samples per step. "
        "Memory: the fullest GPU (for a configuration that does not fit, the least any candidate needs). Scaling: "
        "speed-up per GPU against the type's smallest fitting count; 100% is linear.</p>",
        "<h2>Throughput</h2>", f"<div class='chart'>{throughput_chart(sweep)}</div>",
        "<p class='note'>" + _e(_batch_note(sweep)) + "</p>",
    ]
    train = train_chart(sweep)
    parts += ["<h2>Time and cost to train</h2>",
              f"<div class='chart'>{train}</div>" if train else "<p class='note'>Give --tokens or --steps for the time and cost to train.</p>"]
    parts += ["<h2>Memory per GPU</h2>", f"<div class='chart'>{memory_chart(sweep)}</div>"]
    point, why = featured_pipeline(sweep)
    if point is not None:
        svg, note = pipeline_chart(sweep, point)
        parts += [f"<h2>Pipeline schedule: {_e(why)}</h2>", f"<div class='chart'>{svg}</div>", f"<p class='note'>{_e(note)}</p>"]
    parts += ["<h2>Assumptions</h2>", _hardware(sweep), "<ul>" + "".join(f"<li>{_e(a)}</li>" for a in _not_hardware(sweep)) + "</ul>",
              f"<p class='note'>Profiled once in {sweep.profile_s:.1f} s; {len(sweep.points)} configurations planned in "
              f"{sweep.sweep_s:.1f} s.</p>"]
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>What if: {_e(sweep.model_name)}</title><style>{CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def write_report(sweep: Sweep, path: str | Path) -> None:
    from planner.files import atomic_write_text

    atomic_write_text(path, render_report(sweep), encoding="utf-8")
