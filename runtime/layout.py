"""Where each rank sits and what it holds: the (dp, tp) coordinates and each layer's shard.

Ranks are ordered tp fastest, then dp (then pp), as the planner's cost model assumes and as
``init_device_mesh(..., (dp, tp), mesh_dim_names=("dp", "tp"))`` lays them out: rank = dp_index *
tp + tp_index, so a tensor-parallel group is consecutive ranks (one node on GPUs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.plan import Plan
from runtime.preflight import LayerSplit

DP_STYLE = {
    0: "ZeRO-0: DDP over the dp axis (gradients all-reduced)",
    1: "ZeRO-1: FSDP2 fully_shard over the dp axis, reshard_after_forward=False (runs as ZeRO-2)",
    2: "ZeRO-2: FSDP2 fully_shard over the dp axis, reshard_after_forward=False",
    3: "ZeRO-3: FSDP2 fully_shard over the dp axis, reshard_after_forward=True",
}


@dataclass(frozen=True)
class RankCoords:
    rank: int
    dp_index: int
    tp_index: int
    pp_index: int = 0


def coords(rank: int, dp: int, tp: int, pp: int = 1) -> RankCoords:
    """rank = (pp_index * dp + dp_index) * tp + tp_index, as ``init_device_mesh(..., (pp, dp, tp))``."""
    assert 0 <= rank < dp * tp * pp, f"rank {rank} outside pp({pp}) * dp({dp}) * tp({tp})"
    return RankCoords(rank, (rank // tp) % dp, rank % tp, rank // (dp * tp))


def tp_layers(layers: tuple[LayerSplit, ...], tp: int) -> list[LayerSplit]:
    """The layers tensor parallelism splits in this slice: blocks with a required Linear pair.

    Vocabulary-parallel embeddings and heads (TPInfo.required False) stay replicated for now."""
    if tp == 1:
        return []
    return [l for l in layers if l.tp is not None and l.tp.required and l.tp.colwise and l.tp.rowwise]


def _pattern(name: str) -> str:
    """``blocks.3`` -> ``blocks.*``: the numbered blocks of a stack share one line."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def _join(prefix: str, sub: str) -> str:
    return f"{prefix}.{sub}" if sub else prefix


def shard_lines(layers: tuple[LayerSplit, ...], tp: int, tp_index: int) -> list[str]:
    """One line per group of identically split layers, e.g.
    ``tp shard 0/2 of blocks.*.attn.q, blocks.*.mlp.up (colwise); blocks.*.mlp.down (rowwise)``."""
    split = tp_layers(layers, tp)
    groups: dict[tuple, list[str]] = {}
    for layer in split:
        assert layer.tp is not None
        key = (_pattern(layer.name), layer.tp.colwise, layer.tp.rowwise)
        groups.setdefault(key, []).append(layer.name)
    lines = []
    for (pattern, col, row), _names in groups.items():
        cols = ", ".join(_join(pattern, c) for c in col)
        rows = ", ".join(_join(pattern, r) for r in row)
        lines.append(f"tp shard {tp_index}/{tp} of {cols} (colwise); {rows} (rowwise)")
    sharded = {l.name for l in split}
    rest = [l.name for l in layers if l.name not in sharded]
    if rest:
        lines.append("replicated: " + ", ".join(dict.fromkeys(_pattern(n) for n in rest)))
    return lines


def describe(plan: Plan, layers: tuple[LayerSplit, ...]) -> list[str]:
    """The per-rank layout, as printed by ``plan run --dry-run``."""
    p = plan.parallel
    stage = plan.stages[0]
    out = [f"plan: {p.one_line()}", f"data parallel: {DP_STYLE[p.zero]}"]
    if stage.recompute_layers or stage.selective_layers:
        full = list(dict.fromkeys(_pattern(n) for n in stage.recompute_layers))
        sel = list(dict.fromkeys(_pattern(n) for n in stage.selective_layers))
        out.append(
            "recompute (torch.utils.checkpoint): "
            + ", ".join(full + [f"{n} (selective, run as full)" for n in sel])
        )
    if p.pp > 1:
        out.append(f"pipeline: {p.pp} stages, {p.num_microbatches} micro-batches of {p.micro_batch}, schedule {p.schedule}")
    for rank in range(p.dp * p.tp * p.pp):
        c = coords(rank, p.dp, p.tp, p.pp)
        if p.pp > 1:
            stage = plan.stages[c.pp_index]
            mine = tuple(l for l in layers if l.name in set(stage.layers))
            chunks = " | ".join(f"{ch[0]}..{ch[-1]}" if len(ch) > 1 else ch[0] for ch in stage.chunks if ch)
            head = f"rank {rank}: pp {c.pp_index}/{p.pp}, dp {c.dp_index}/{p.dp}, tp {c.tp_index}/{p.tp}; layers {chunks} ({len(mine)})"
        else:
            mine = layers
            head = f"rank {rank}: dp {c.dp_index}/{p.dp}, tp {c.tp_index}/{p.tp}; layers {layers[0].name}..{layers[-1].name} ({len(layers)})"
        out.append(head)
        out += [f"    {line}" for line in shard_lines(mine, p.tp, c.tp_index)]
    return out


def runtime_warnings(plan: Plan, layers: tuple[LayerSplit, ...]) -> list[str]:
    """Where this runtime executes something other than what the plan's cost model assumed."""
    p = plan.parallel
    stage = plan.stages[0]
    out = []
    if p.pp > 1 and p.zero == 0 and p.dp > 1:
        out.append("ZeRO-0 within a pipeline stage runs as one gradient all-reduce over dp after the schedule, not DDP")
    if p.tp > 1:
        vocab = [l.name for l in layers if l.tp is not None and not l.tp.required]
        if vocab:
            out.append(f"embeddings and head ({', '.join(vocab)}) are replicated, not vocabulary-parallel")
        if p.sequence_parallel:
            out.append("tensor parallelism runs without sequence parallelism (norms and dropout replicated)")
    if stage.selective_layers:
        out.append(f"selective recompute of {len(stage.selective_layers)} layer(s) runs as full recompute")
    if p.zero == 1:
        out.append("ZeRO-1 runs as FSDP2 with reshard_after_forward=False (gradients sharded too: ZeRO-2)")
    return out
