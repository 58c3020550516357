"""Where each rank sits and what it holds: the (pp, dp, cp, tp) coordinates and each layer's shard.

Ranks are ordered tp fastest, then cp, then dp (then pp), as the planner's cost model assumes and
as ``init_device_mesh(..., (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))`` lays them out:
rank = (dp_index * cp + cp_index) * tp + tp_index, so a tensor-parallel group is consecutive ranks
(one node on GPUs) and a context-parallel group strides by tp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from planner.plan import Plan
from planner.profile.types import moe_sp_blocker
from runtime.data_parallel import SIXTEEN_BIT
from runtime.types import LayerSplit
from runtime.types import NO_BLOCK

DP_STYLE = {
    0: "ZeRO-0: DDP over the dp axis (gradients all-reduced)",
    1: "ZeRO-1: DDP over the dp axis + ZeroRedundancyOptimizer (optimizer state sharded over dp, updated parameters broadcast)",
    2: "ZeRO-2: FSDP2 fully_shard over the dp axis, reshard_after_forward=False",
    3: "ZeRO-3: FSDP2 fully_shard over the dp axis, reshard_after_forward=True",
}


@dataclass(frozen=True)
class RankCoords:
    rank: int
    dp_index: int
    tp_index: int
    pp_index: int = 0
    cp_index: int = 0


def coords(rank: int, dp: int, tp: int, pp: int = 1, cp: int = 1) -> RankCoords:
    """rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index, as
    ``init_device_mesh(..., (pp, dp, cp, tp))``."""
    assert 0 <= rank < dp * tp * pp * cp, f"rank {rank} outside pp({pp}) * dp({dp}) * cp({cp}) * tp({tp})"
    return RankCoords(rank, (rank // (tp * cp)) % dp, rank % tp, rank // (dp * cp * tp), (rank // tp) % cp)


def tp_layers(layers: tuple[LayerSplit, ...], tp: int) -> list[LayerSplit]:
    """The blocks whose column/row-wise Linear pairs tensor parallelism splits (TPInfo.required)."""
    if tp == 1:
        return []
    return [l for l in layers if l.tp is not None and l.tp.required and l.tp.colwise and l.tp.rowwise]


def under_ep(layers: tuple[LayerSplit, ...], ep: int) -> tuple[LayerSplit, ...]:
    """`layers` as tensor parallelism splits them with expert parallelism of degree `ep`: with ep > 1
    each layer's mixture-of-experts blocks stay whole (TPInfo.under_ep: EP splits their experts, TP
    does not; torchtitan's ETP = 1)."""
    if ep == 1:
        return layers
    return tuple(replace(l, tp=l.tp.under_ep()) if l.tp is not None and l.tp.moe else l for l in layers)


def sequence_parallel_blocker(layers: tuple[LayerSplit, ...], tp: int, ep: int = 1) -> str:
    """Why sequence parallelism cannot run on `layers` (the whole model) at degrees `tp` and `ep` (""
    when it can; NO_BLOCK when nothing splits): the profile's verdict (each layer's TPRole, the MoE
    blocks as expert parallelism runs them), the MoE blocks without EP (moe_sp_blocker), the
    sequence length not a multiple of tp, or no roles at all (the fake trace failed)."""
    known = [l for l in layers if l.role is not None]
    if len(known) != len(layers) or not known:
        return "the model could not be traced on fake tensors"
    seq_len = known[0].role.seq_len
    blocker = next((l.role.sp_blocker for l in known if l.role.sp_blocker), "")
    blocker = blocker or moe_sp_blocker(((l.name, l.tp) for l in layers), ep)
    if not blocker and seq_len and seq_len % tp:
        blocker = f"the sequence length {seq_len} is not a multiple of tp={tp}"
    return blocker


@dataclass(frozen=True)
class TPLayout:
    """What tensor parallelism runs, for the whole model at one TP degree (every pipeline stage
    derives the same from its own layers, since each layer's TPRole carries the model's verdict)."""

    blocks: tuple[LayerSplit, ...]
    """Blocks with their Linear pairs split (column-wise, then row-wise)."""
    vocab: tuple[LayerSplit, ...]
    """Embeddings and the head split over the vocabulary (their weights' rows)."""
    sequence_parallel: bool
    """Hidden states between the Linear pairs sharded over the sequence (norms, dropout, residuals)."""
    loss_parallel: bool
    """The head's logits stay sharded over the vocabulary into the (default cross-entropy) loss."""
    seq_len: int | None
    warnings: tuple[str, ...]
    """Where this departs from the plan's cost model (Megatron TP + SP, vocabulary-parallel)."""


SP_GATHER_WARNING = (
    "sequence parallelism saves the all-gathered input of each column-wise Linear group (attention, MLP) "
    "whole for backward, where Megatron-LM keeps the sequence shard and gathers again: about one "
    "[batch, seq, hidden] per group per block above the plan's activations"
)


def tp_layout(layers: tuple[LayerSplit, ...], tp: int, sequence_parallel: bool = True, ep: int = 1) -> TPLayout:
    """The TP layout of `layers` at degree `tp` (`sequence_parallel`: the plan's flag; `ep`: its
    expert-parallel degree, with which the mixture-of-experts blocks stay whole: `under_ep`)."""
    if tp == 1:
        return TPLayout((), (), False, False, None, ())
    layers = under_ep(layers, ep)
    blocks = tuple(tp_layers(layers, tp))
    vocab_like = [l for l in layers if l.tp is not None and not l.tp.required]
    warnings: list[str] = []
    known = [l for l in layers if l.role is not None]
    if len(known) != len(layers):  # no roles (the trace failed): the Linear pairs only
        if vocab_like:
            warnings.append(
                f"embeddings and head ({', '.join(l.name for l in vocab_like)}) are replicated, not "
                "vocabulary-parallel (the model could not be traced on fake tensors to check how)"
            )
        if sequence_parallel:
            warnings.append("tensor parallelism runs without sequence parallelism (the model could not be traced on "
                            "fake tensors); norms, dropout and residuals run replicated on every tp rank")
        return TPLayout(blocks, (), False, False, None, tuple(warnings))
    seq_len = known[0].role.seq_len if known else None
    sp_blocker = sequence_parallel_blocker(layers, tp, ep)
    sp = sequence_parallel and not sp_blocker
    if sequence_parallel and sp_blocker and sp_blocker != NO_BLOCK:
        warnings.append(
            f"tensor parallelism runs without sequence parallelism: {sp_blocker}; norms, dropout and residuals "
            "run replicated on every tp rank (the plan divides their activations by tp)"
        )
    vocab: list[LayerSplit] = []
    tied_to: list[str] = []  # parameters named in a tied warning already (its partner says nothing more)
    for l in vocab_like:
        assert l.tp is not None and l.role is not None
        if l.role.kind not in ("embedding", "head") or not l.tp.legal(tp):
            continue  # the plan keeps it replicated too (a vocabulary that tp does not divide)
        if l.role.tied:
            if not any(t == l.name or t.startswith(l.name + ".") for t in tied_to):
                warnings.append(
                    f"{l.name} shares its weight with {l.role.tied} (tied): both stay replicated, not "
                    "vocabulary-parallel as planned"
                )
                tied_to.append(l.role.tied)
            continue
        vocab.append(l)
    head = next((l for l in vocab if l.role is not None and l.role.kind == "head"), None)
    loss_parallel = head is not None and not head.role.loss_blocker
    if head is not None and head.role.loss_blocker:
        warnings.append(
            f"{head.name}'s logits are all-gathered over tp before the loss ({head.role.loss_blocker}): every "
            "rank holds the whole logits, where the plan counts 1/tp of them"
        )
    if sp and blocks:
        warnings.append(SP_GATHER_WARNING)
    return TPLayout(blocks, tuple(vocab), sp, loss_parallel, seq_len, tuple(warnings))


def _pattern(name: str) -> str:
    """``blocks.3`` -> ``blocks.*``: the numbered blocks of a stack share one line."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def _join(prefix: str, sub: str) -> str:
    return f"{prefix}.{sub}" if sub else prefix


def _rows(size: int, tp: int, index: int) -> str:
    per = size // tp
    return f"rows {index * per}-{(index + 1) * per - 1} of {size}"


def shard_lines(
    layers: tuple[LayerSplit, ...], tp: int, tp_index: int, sequence_parallel: bool = True,
    all_layers: tuple[LayerSplit, ...] | None = None, ep: int = 1,
) -> list[str]:
    """What rank `tp_index` of a TP group holds of `layers`, one line per kind, e.g.
    ``tp shard 0/2 of blocks.*.attn.q, blocks.*.mlp.up (colwise); blocks.*.mlp.down (rowwise)``,
    ``tp shard 0/2 of the vocabulary: wte rows 0-31 of 64, lm_head rows 0-31 of 64 (...)``,
    ``sequence parallel: positions 0-7 of 16 ...``. `all_layers`: the whole model (a pipeline
    stage's layers decide with it); `ep`: the expert-parallel degree (`tp_layout`)."""
    if tp == 1:
        return ["replicated: " + ", ".join(dict.fromkeys(_pattern(l.name) for l in layers))] if layers else []
    layout = tp_layout(all_layers if all_layers is not None else layers, tp, sequence_parallel, ep)
    mine = {l.name for l in layers}
    split = [l for l in layout.blocks if l.name in mine]
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
    vocab = [l for l in layout.vocab if l.name in mine]
    if vocab:
        parts = []
        for l in vocab:
            assert l.tp is not None and l.role is not None
            part = f"{l.name} {_rows(l.tp.divisors[0], tp, tp_index)}"
            if l.role.kind == "head":
                part += (" (logits stay vocabulary-sharded into the loss)" if layout.loss_parallel
                         else " (logits all-gathered for the loss)")
            parts.append(part)
        lines.append(f"tp shard {tp_index}/{tp} of the vocabulary: " + ", ".join(parts))
    if layout.sequence_parallel and layout.seq_len:
        per = layout.seq_len // tp
        norms: list[str] = []
        for l in layers:
            if l.role is not None and l.role.kind == "block":
                norms += [_join(_pattern(l.name), n) for n in l.role.norms]
            elif l.role is not None and l.role.kind == "norm":
                norms.append(_pattern(l.name))
        norms = list(dict.fromkeys(norms))
        cut = next((l.role.shard_at for l in layers if l.role is not None and l.role.shard_at), "")
        lines.append(
            f"sequence parallel: positions {tp_index * per}-{(tp_index + 1) * per - 1} of {layout.seq_len} of the "
            "hidden states outside the Linear pairs" + (f", from {cut}'s input on" if cut else "")
            + (f" ({', '.join(norms)} run on them)" if norms else "")
        )
    if ep > 1:
        moe = [_join(_pattern(l.name), m) for l in layers if l.name in mine and l.tp is not None for m in l.tp.moe]
        if moe:
            lines.append("not split by tp (mixture-of-experts blocks: experts split by ep, the rest replicated; on this "
                         "rank's sequence shard" + ("" if layout.sequence_parallel else ", which it needs") + "): "
                         + ", ".join(dict.fromkeys(moe)))
    sharded = {l.name for l in split} | {l.name for l in vocab}
    rest = [l.name for l in layers if l.name not in sharded]
    if rest:
        lines.append("replicated: " + ", ".join(dict.fromkeys(_pattern(n) for n in rest)))
    return lines


def describe(plan: Plan, layers: tuple[LayerSplit, ...]) -> list[str]:
    """The per-rank layout, as printed by ``plan run --dry-run``."""
    p = plan.parallel
    style = DP_STYLE[p.zero]
    if p.dp_replicate > 1:
        style += f", as HSDP on a 2-D mesh: {p.dp_replicate} replicas x {p.dp // p.dp_replicate} shards"
    out = [f"plan: {p.one_line()}", f"data parallel: {style}"]
    if plan.training.precision in SIXTEEN_BIT:
        how = ("torch.autocast around the forward (DDP)" if p.dp * p.cp > 1 and p.zero <= 1 else
               "FSDP2 MixedPrecisionPolicy: fp32 parameters cast when gathered, gradients reduced in fp32"
               + (" (FSDP2 over this one rank, nothing sharded)" if p.dp * p.cp == 1 else ""))
        compute = "FP8 Linear matmuls (torchao), bf16" if plan.training.precision == "fp8" else plan.training.precision
        out.append(f"precision: {compute} compute, fp32 master weights and optimizer state; {how}")
    full = list(dict.fromkeys(_pattern(n) for s in plan.stages for n in s.recompute_layers))
    sel = list(dict.fromkeys(_pattern(n) for s in plan.stages for n in s.selective_layers))
    alt = list(dict.fromkeys(_pattern(n) for s in plan.stages for n in s.alternate_layers))
    if full or sel or alt:
        parts = [f"full: {', '.join(full)}"] if full else []
        if sel:
            parts.append(f"selective (matmul outputs saved, the rest recomputed): {', '.join(sel)}")
        if alt:
            parts.append(f"alternate (every other Linear matmul output saved, the rest recomputed): {', '.join(alt)}")
        out.append("recompute (torch.utils.checkpoint): " + "; ".join(parts))
    if p.pp > 1:
        out.append(f"pipeline: {p.pp} stages, {p.num_microbatches} micro-batches of {p.micro_batch}, schedule {p.schedule}")
    if p.cp > 1:
        out.append(f"context parallel: each sequence of {plan.model.seq_len} in 2 x {p.cp} chunks, rank c of a "
                   f"group holding chunks c and {2 * p.cp - 1}-c (torch's context_parallel, load-balanced causal "
                   "attention as a ring); model buffers of seq_len rows sharded alike; gradients averaged over dp x cp")
    if p.ep > 1:
        out.append(f"expert parallel: each mixture-of-experts block's experts split over {p.ep} ranks ({p.ep} consecutive "
                   f"ranks of a pipeline stage, cp and tp ranks included; ep rank j holds the j-th 1/{p.ep} of them), "
                   f"tokens dispatched and combined by all-to-all; {p.stage_ranks // p.ep} replica(s) of each "
                   "expert, their gradients summed and divided by dp x cp")
        if p.tp > 1:
            out.append(f"expert parallel x tensor parallel: the mixture-of-experts blocks are not split by tp (experts whole, "
                       f"router replicated); each tp rank routes its own sequence shard through the all-to-alls of its "
                       f"EP group, and the router's gradients are summed over the {p.tp} tp ranks")
    for rank in range(p.world_size):
        c = coords(rank, p.dp, p.tp, p.pp, p.cp)
        ep = f", ep {rank % p.ep}/{p.ep}" if p.ep > 1 else ""  # a stage's ranks are consecutive, its EP groups too
        if p.pp > 1:
            stage = plan.stages[c.pp_index]
            mine = tuple(l for l in layers if l.name in set(stage.layers))
            chunks = " | ".join(f"{ch[0]}..{ch[-1]}" if len(ch) > 1 else ch[0] for ch in stage.chunks if ch)
            head = f"rank {rank}: pp {c.pp_index}/{p.pp}, dp {c.dp_index}/{p.dp}{ep}, tp {c.tp_index}/{p.tp}; layers {chunks} ({len(mine)})"
        else:
            mine = layers
            cp = f", cp {c.cp_index}/{p.cp}" if p.cp > 1 else ""
            head = (f"rank {rank}: dp {c.dp_index}/{p.dp}{cp}{ep}, tp {c.tp_index}/{p.tp}; "
                    f"layers {layers[0].name}..{layers[-1].name} ({len(layers)})")
        out.append(head)
        out += [f"    {line}" for line in shard_lines(mine, p.tp, c.tp_index, p.sequence_parallel, layers, p.ep)]
    return out


def runtime_warnings(plan: Plan, layers: tuple[LayerSplit, ...]) -> list[str]:
    """Where this runtime executes something other than what the plan's cost model assumed."""
    p = plan.parallel
    out = []
    if p.tp > 1:
        out += tp_layout(layers, p.tp, p.sequence_parallel, p.ep).warnings
    if plan.training.precision in SIXTEEN_BIT and p.dp * p.cp > 1 and p.zero <= 1:
        out.append(
            f"{plan.training.precision} under DDP runs as torch.autocast: the residual stream and norms stay fp32, "
            "so activations exceed the plan's 16-bit figure (about 1.4x on examples/gpt.py); ZeRO-2/3 casts "
            "the parameters instead (FSDP2 MixedPrecisionPolicy)"
        )
    if plan.training.ep_dispatch == "deepep" and p.ep > 1:
        out.append("the plan was made for DeepEP's dispatch (--ep-dispatch deepep); this runtime sends the expert "
                   "tokens with torch's all_to_all_single, a row for every expert on another node")
    if plan.training.trainer != "this":
        out.append(
            f"the plan was made for --trainer {plan.training.trainer}; this runtime runs its own kernels "
            "(eager PyTorch, SDPA, torchao), so its measured step differs from the predicted one (plan again "
            "with --trainer this to compare them)"
        )
    return out
