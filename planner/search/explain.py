"""Turn a search result into a Plan: figures, the binding constraint, and plain-word reasons."""

from __future__ import annotations

from planner.cost.evaluate import DeviceFigures
from planner.cost.setup import RECOMPUTE, tensor_dtype
from planner.cost.stage_costs import ALTERNATE, FULL, SELECTIVE
from planner.hardware import Cluster
from planner.plan import (
    Alternative,
    ClusterInfo,
    MemoryBytes,
    ModelInfo,
    Parallel,
    Plan,
    Predicted,
    SolverInfo,
    Stage,
    TrainingInfo,
    plan_layers,
)
from planner.profile.types import ModelProfile
from planner.report.units import fmt_bytes, fmt_seconds
from planner.search.search import Scored, SearchResult, margin

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}


def recompute_label(choice: tuple[int, ...]) -> str:
    kinds = set(choice)
    return RECOMPUTE[kinds.pop()] if len(kinds) == 1 else "mixed"


def parallel_of(s: Scored) -> Parallel:
    c = s.cand
    return Parallel(
        dp=c.dp, tp=c.tp, pp=c.pp, micro_batch=c.micro_batch, num_microbatches=c.num_microbatches,
        zero=c.zero, schedule=c.schedule, virtual_stages=c.virtual_stages,
        recompute=recompute_label(s.partition.choice), sequence_parallel=c.sequence_parallel, dp_replicate=c.dp_replicate,
        tp_overlap=c.tp_overlap, cp=c.cp, ep=c.ep, ep_overlap=c.ep_overlap,
    )


def breakdown(s: Scored) -> dict[str, float]:
    """Seconds per step on the slowest rank, by cause."""
    ev, m = s.evaluation, s.cand.num_microbatches
    d = max(ev.devices, key=lambda x: x.time_per_microbatch_s)
    busy = d.compute_s + d.recompute_s + d.tp_comm_s + d.cp_comm_s + d.ep_comm_s + d.p2p_s
    return {
        "compute": m * d.compute_s,
        "recompute": m * d.recompute_s,
        "tp_comm": m * d.tp_comm_s,
        "cp_comm": m * d.cp_comm_s,
        "ep_comm": m * d.ep_comm_s,
        "pp_comm": m * d.p2p_s,
        "dp_comm": m * max(0.0, d.time_per_microbatch_s - busy) + max(x.sync_s for x in ev.devices) - _optimizer_s(s),
        "optimizer": _optimizer_s(s),
        "bubble": ev.pipeline_s - m * d.time_per_microbatch_s,
    }


def _recompute_line(s: Scored, label: str) -> str:
    """What recompute costs the step: its time on the slowest rank, which is nothing where only the
    other pipeline stages recompute (they wait for the slowest one anyway)."""
    cost = breakdown(s)["recompute"]
    if cost > 0:
        return f"Recompute ({label}) trades {fmt_seconds(cost)} per step for activation memory."
    ranks = [str(d.rank) for d in s.evaluation.devices if d.recompute_s > 0]
    many = len(ranks) > 1
    return (f"Recompute ({label}) runs on rank{'s' if many else ''} {', '.join(ranks)}, for {'their' if many else 'its'} "
            "activation memory, and costs the step nothing: the slowest stage does not recompute.")


def _optimizer_s(s: Scored) -> float:
    return max(s.optimizer_s())


def _stages(s: Scored, profile: ModelProfile) -> tuple[Stage, ...]:
    names = [l.name for l in profile.layers]
    atoms, bounds, choice = s.costs.atoms, s.partition.bounds, s.partition.choice
    p = s.cand.pp
    stages = []
    for d in s.evaluation.devices:
        chunks, full, sel, alt = [], [], [], []
        for st in range(d.rank, s.cand.num_stages, p):
            chunk = []
            for a in range(bounds[st], bounds[st + 1]):
                layer_names = names[atoms[a].first : atoms[a].last + 1]
                chunk += layer_names
                {FULL: full, SELECTIVE: sel, ALTERNATE: alt}.get(choice[a], []).extend(layer_names)
            chunks.append(tuple(chunk))
        stages.append(
            Stage(
                rank=d.rank,
                layers=tuple(n for c in chunks for n in c),
                chunks=tuple(chunks),
                recompute_layers=tuple(full),
                selective_layers=tuple(sel),
                alternate_layers=tuple(alt),
                memory_bytes=_memory(d),
                time_per_microbatch_s=d.time_per_microbatch_s,
            )
        )
    return tuple(stages)


def _memory(d: DeviceFigures) -> MemoryBytes:
    parts = [d.weights_bytes, d.grads_bytes, d.optimizer_bytes, d.activations_bytes, d.reserve_bytes]
    ints = [int(round(x)) for x in parts]
    return MemoryBytes(*ints, total=sum(ints))


def predicted_of(s: Scored, profile: ModelProfile, cluster: Cluster, global_batch: int, precision: str) -> Predicted:
    ev = s.evaluation
    step = ev.step_time_s
    samples = global_batch / step
    model_flops = s.costs.model_flops_per_step
    peak = cluster.gpu.peak(tensor_dtype(precision))
    b = breakdown(s)
    return Predicted(
        step_time_s=step,
        samples_per_s=samples,
        tokens_per_s=samples * profile.seq_len if profile.seq_len else None,
        model_tflops_per_gpu=model_flops / step / cluster.num_gpus / 1e12,
        mfu=model_flops / (step * cluster.num_gpus * peak),
        peak_memory_bytes=int(ev.peak_bytes),
        fragmentation=s.costs.fragmentation,
        bubble_s=b["bubble"],
        breakdown_s=b,
        phase_factors=dict(cluster.gpu.phase_factors),
    )


def binding_of(s: Scored, limit: int) -> str:
    ev = s.evaluation
    d = max(ev.devices, key=lambda x: x.total_bytes)
    b = breakdown(s)
    step = ev.step_time_s
    comm = b["tp_comm"] + b["cp_comm"] + b["ep_comm"] + b["pp_comm"] + b["dp_comm"]
    if d.total_bytes > 0.9 * limit:
        where = f"rank {d.rank}" if s.cand.pp > 1 else "each GPU"
        return f"memory: {where} holds {fmt_bytes(d.total_bytes)} of {fmt_bytes(limit)}"
    if b["bubble"] > 0.15 * step:
        return f"the pipeline bubble: {b['bubble'] / step:.0%} of the step idle"
    if comm > 0.25 * step:
        parts = ", ".join(f"{k} {fmt_seconds(b[key])}" for k, key in (("TP", "tp_comm"), ("CP", "cp_comm"), ("EP", "ep_comm"), ("PP", "pp_comm"), ("DP", "dp_comm")) if b[key] > 0)
        return f"communication: {comm / step:.0%} of the step ({parts})"
    return f"compute: {(b['compute'] + b['recompute']) / step:.0%} of the step is math"


def _why_slower(alt: Scored, best: Scored) -> str:
    a, b = breakdown(alt), breakdown(best)
    deltas = {k: a[k] - b[k] for k in a}
    cause = max(deltas, key=lambda k: deltas[k])
    words = {
        "compute": "more math per GPU (less efficient shards or replicated layers)",
        "recompute": "recomputing activations to fit",
        "tp_comm": "tensor-parallel all-reduces",
        "cp_comm": "context-parallel key/value exchanges",
        "ep_comm": "expert-parallel token all-to-alls",
        "pp_comm": "pipeline sends",
        "dp_comm": "data-parallel gradient and parameter traffic",
        "optimizer": "a larger optimizer step per GPU",
        "bubble": "pipeline bubble",
    }
    return f"{words[cause]} (+{fmt_seconds(deltas[cause])})"


def _alternative(s: Scored, best: Scored | None) -> Alternative:
    note = ""
    if best is not None and s is not best:
        if s.step_time_s < best.step_time_s:
            note = (f"{1 - s.step_time_s / best.step_time_s:.1%} faster, less than the margin a more complex plan "
                    f"must gain ({margin(s.cand) - margin(best.cand):.1%}, below what the cost model resolves): "
                    "the simpler plan is preferred")
        else:
            note = f"{s.step_time_s / best.step_time_s - 1:+.0%}: {_why_slower(s, best)}"
    return Alternative(
        plan=parallel_of(s).one_line(), step_time_s=s.step_time_s,
        peak_memory_bytes=int(s.evaluation.peak_bytes), fits=True, note=note,
    )


def _tp_split(profile: ModelProfile) -> str:
    """What tensor parallelism splits: every block's matmuls, or less where the profiler found layers
    that cannot run split (TPRole.split_blocker, the reason in the profile's warnings)."""
    whole = [l.name for l in profile.layers if l.tp_role is not None and l.tp_role.split_blocker]
    if not whole:
        return "each block's matmuls"
    split = sum(1 for l in profile.layers if l.tp is not None and l.tp.required)
    what = f"the matmuls of {split} block(s)" if split else "only the embeddings and the head"
    return f"{what} ({', '.join(whole[:3])}{', ...' if len(whole) > 3 else ''} cannot run split: whole on every TP rank)"


def explanation(result: SearchResult, best: Scored, cluster: Cluster, limit: int, profile: ModelProfile) -> list[str]:
    lines = []
    c = best.cand
    dp_plan = result.data_parallel
    split = c.tp > 1 or c.pp > 1 or c.cp > 1 or c.ep > 1
    if dp_plan is None and result.data_parallel_need_bytes is None:
        lines.append(f"Plain data parallelism cannot run: {_no_data_parallel(best, cluster)}; so the model is "
                     "split across GPUs.")
    elif dp_plan is None:
        need = result.data_parallel_need_bytes
        lines.append(
            "Plain data parallelism does not fit: a full replica needs "
            + (f"{fmt_bytes(need)} per GPU " if need else "more ")
            + f"against {fmt_bytes(limit)}, even with full recompute; so the model state is "
            + ("split across GPUs." if split else f"sharded with ZeRO-{c.zero}.")
        )
    elif dp_plan is best:
        lines.append(
            "Data parallelism is enough: a full replica with its gradients, optimizer state and "
            f"activations fits on one GPU ({fmt_bytes(dp_plan.evaluation.peak_bytes)} of {fmt_bytes(limit)}), "
            "so each GPU trains a copy on its share of the batch (the rule of thumb: split the model "
            "only when it does not fit or when splitting is predicted faster)."
        )
    elif dp_plan.step_time_s < best.step_time_s:  # the user's fixed choices cost speed
        lines.append(
            f"Plain data parallelism fits ({fmt_bytes(dp_plan.evaluation.peak_bytes)} per GPU) and is predicted "
            f"{best.step_time_s / dp_plan.step_time_s - 1:.0%} faster than this configuration "
            f"({fmt_seconds(dp_plan.step_time_s)} against {fmt_seconds(best.step_time_s)} per step): the fixed "
            "choices (--tp/--pp/--dp/--zero/...) cost it speed."
        )
    else:
        gain = dp_plan.step_time_s / best.step_time_s - 1
        lines.append(
            f"Plain data parallelism fits ({fmt_bytes(dp_plan.evaluation.peak_bytes)} per GPU) but this plan is "
            f"predicted {gain:.0%} faster ({fmt_seconds(best.step_time_s)} against {fmt_seconds(dp_plan.step_time_s)} "
            f"per step); data parallelism loses on {_why_slower(dp_plan, best)}."
        )
    if c.tp > 1:
        where = "inside a node (NVLink)" if not best.costs.links.tp_spans_nodes else "ACROSS nodes (slow: keep TP inside a node if you can)"
        blocker = profile.sp_blocker_at(c.ep)
        sp = ("with sequence parallelism (norms, residuals and dropout split along the sequence too)" if c.sequence_parallel
              else "without sequence parallelism (norms, residuals and dropout whole on every TP rank"
              + (f": this model cannot run it, {blocker}" if blocker else "") + ")")
        overlap = " (beside the GEMMs: what they do not hide)" if c.tp_overlap else ""
        lines.append(f"Tensor parallelism over {c.tp} GPUs {where} splits {_tp_split(profile)}, {sp}; "
                     f"its collectives cost {fmt_seconds(breakdown(best)['tp_comm'])} per step{overlap}.")
    if c.cp > 1:
        lines.append(_context_parallel_line(best, profile))
    elif profile.cp_blocker and profile.seq_len and split:
        lines.append(f"Context parallelism was not considered: this model cannot run it, {profile.cp_blocker}.")
    if c.ep > 1:
        lines.append(_expert_parallel_line(best, profile))
    elif profile_experts(profile) and c.dp > 1:
        lines.append(_no_expert_parallel_line(result, best))
    if c.pp > 1:
        lines.append(
            f"The pipeline has {c.pp} stages and {c.num_microbatches} micro-batches"
            + (f", {c.virtual_stages} chunks per rank," if c.schedule == "interleaved" else "")
            + f" with {SCHEDULE_NAMES[c.schedule]}: {fmt_seconds(breakdown(best)['bubble'])} of bubble per step."
        )
    if c.zero:
        what = {1: "the optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}[c.zero]
        if c.dp_replicate > 1:
            lines.append(f"ZeRO-{c.zero} as HSDP shards {what} over the {c.dp_shard} data-parallel ranks of a node; "
                         f"the {c.dp_replicate} nodes' groups are replicas whose gradients are all-reduced across "
                         f"the network (1/{c.dp_shard} of them per GPU), so only that crosses nodes.")
        else:
            over = f"the {c.dp} data-parallel replicas" + (f" x {c.cp} context-parallel ranks" if c.cp > 1 else "")
            lines.append(f"ZeRO-{c.zero} shards {what} over {over}.")
    rc = recompute_label(best.partition.choice)
    if rc != "none":
        lines.append(_recompute_line(best, rc))
    lines.append(f"What binds: {binding_of(best, limit)}.")
    for alt in result.ranked[1:]:
        lines.append(f"Runner-up {parallel_of(alt).one_line()}: {fmt_seconds(alt.step_time_s)} ({_alternative(alt, best).note}).")
    lines += _what_would_change(best, limit)
    return lines


def _no_data_parallel(best: Scored, cluster: Cluster) -> str:
    """Why no plain data-parallel candidate exists (none was even tried)."""
    batch = best.cand.dp * best.cand.micro_batch * best.cand.num_microbatches
    return f"a global batch of {batch} does not split over {cluster.num_gpus} GPUs"


def _context_parallel_line(best: Scored, profile: ModelProfile) -> str:
    c = best.cand
    where = "across nodes" if best.costs.links.cp_spans_nodes else "inside a node"
    tokens = f"{profile.seq_len:,}-token " if profile.seq_len else ""
    return (f"Context parallelism over {c.cp} GPUs {where} splits each {tokens}sequence: every GPU holds 1/{c.cp} of "
            f"the tokens and their activations, and attention passes keys and values around a ring; the exchange "
            f"not hidden behind attention costs {fmt_seconds(breakdown(best)['cp_comm'])} per step. Gradients are "
            f"averaged over dp x cp = {c.grad_ranks} GPUs.")


def profile_experts(profile: ModelProfile) -> tuple[int, int, int, int] | None:
    """(MoE layers, experts per block, top-k, expert parameters) of the profile; None without MoE."""
    moe = [l for l in profile.layers if l.moe_experts]
    if not moe:
        return None
    return len(moe), moe[0].moe_experts, max(l.moe_top_k for l in moe), sum(l.expert_params for l in moe)


def _expert_parallel_line(best: Scored, profile: ModelProfile) -> str:
    c = best.cand
    layers, experts, top_k, params = profile_experts(profile)  # type: ignore[misc]
    where = "across nodes" if best.costs.links.ep_spans_nodes else "inside a node"
    share = params / profile.num_params if profile.num_params else 0.0
    k = f"its top {top_k}" if top_k else "the experts it chose"
    line = (f"Expert parallelism over {c.ep} GPUs {where}: each GPU holds {experts // c.ep} of the {experts} experts of "
            f"each of the {layers} mixture-of-experts layers ({share:.0%} of the parameters, 1/{c.ep} of them per GPU), "
            f"and each token goes to {k} and back by two all-to-alls per layer in forward and two in backward, "
            + ("run beside another micro-batch's compute (EP overlap: what it does not hide), " if c.ep_overlap else "")
            + f"{fmt_seconds(breakdown(best)['ep_comm'])} per step. "
            + (f"Each expert's gradients are averaged over the {c.expert_replicas} GPUs that hold it"
               + (f", and ZeRO-{c.zero} shards its state over them" if c.zero else "") + "."
               if c.expert_replicas > 1 else "No other GPU holds the same experts (nothing to average)."))
    if c.tp > 1:
        line += (f" Tensor parallelism leaves the experts whole (expert parallelism splits them, over the "
                 f"tensor-parallel GPUs too: {c.ep} consecutive GPUs): each of the {c.tp} tensor-parallel GPUs routes "
                 f"its own 1/{c.tp} of the sequence (sequence parallelism) through its group's all-to-alls.")
    if c.cp > 1:
        line += (f" Each of the {c.cp} context-parallel GPUs of a sequence routes its own part of it through its "
                 "group's all-to-alls, as a data-parallel GPU routes its own samples.")
    return line


def _no_expert_parallel_line(result: SearchResult, best: Scored) -> str:
    """Why a mixture-of-experts model runs without EP: the best plan with it, and what it loses on."""
    with_ep = [s for s in result.ranked if s.cand.ep > 1]
    if with_ep:
        alt = with_ep[0]
        return (f"Expert parallelism ({parallel_of(alt).one_line()}) is predicted {fmt_seconds(alt.step_time_s)} per "
                f"step: it loses on {_why_slower(alt, best)}" if alt.step_time_s >= best.step_time_s else
                f"Expert parallelism ({parallel_of(alt).one_line()}) would gain {1 - alt.step_time_s / best.step_time_s:.1%}, "
                "less than the margin a more complex plan must gain") + "; every GPU holds all the experts."
    return "Expert parallelism was not chosen: every GPU holds all the experts (no plan with it ranked among the best)."


def _what_would_change(best: Scored, limit: int) -> list[str]:
    b = breakdown(best)
    step = best.evaluation.step_time_s
    out = []
    if b["bubble"] > 0.05 * step:
        out.append("A larger global batch (more micro-batches) would shrink the pipeline bubble.")
    if b["recompute"] > 0.05 * step:
        out.append("GPUs with more memory (or more GPUs) would let recompute go and save its time.")
    if b["dp_comm"] > 0.1 * step:
        out.append("A faster network between nodes, or a larger batch per GPU, would hide the data-parallel traffic.")
    if best.evaluation.peak_bytes < 0.5 * limit and best.cand.tp * best.cand.pp > 1:
        out.append("Memory is far from the limit: a larger micro-batch may be worth fixing with --micro-batch.")
    return out


def build_plan(
    result: SearchResult,
    profile: ModelProfile,
    cluster: Cluster,
    precision: str,
    optimizer: str,
    global_batch: int,
    limit: int,
    model_path: str,
    assumptions: list[str],
    warnings: list[str],
    trainer: str = "this",
    compiled: bool = False,
    ep_dispatch: str = "all_to_all",
    expert_node_limit: int | None = None,
) -> Plan:
    best = result.best
    assert best is not None, "build_plan needs a feasible search result"
    dp = result.data_parallel
    need = result.data_parallel_need_bytes
    dp_alt = _alternative(dp, best) if dp is not None else Alternative(
        plan="data parallel", step_time_s=0.0, peak_memory_bytes=int(need or 0), fits=False,
        note=f"does not fit: needs {fmt_bytes(need)} per GPU" if need else _no_data_parallel(best, cluster),
    )
    return Plan(
        parallel=parallel_of(best),
        stages=_stages(best, profile),
        predicted=predicted_of(best, profile, cluster, global_batch, precision),
        cluster=ClusterInfo(
            gpu=cluster.gpu.name, display_name=cluster.gpu.display_name, num_gpus=cluster.num_gpus,
            gpus_per_node=cluster.gpus_per_node, memory_limit_bytes=limit, peak_flops=cluster.gpu.peak(tensor_dtype(precision)),
        ),
        model=ModelInfo(
            name=profile.model_name, path=model_path, source_sha256=profile.source_sha256,
            num_params=profile.num_params, seq_len=profile.seq_len, layer_names=tuple(l.name for l in profile.layers),
            layers=plan_layers(profile),
            pipeline_split=profile.pipeline_split, pipeline_split_note=profile.pipeline_split_note,
            cp_blocker=profile.cp_blocker,
        ),
        training=TrainingInfo(precision=precision, optimizer=optimizer, global_batch=global_batch, trainer=trainer,
                              compile=compiled, ep_dispatch=ep_dispatch, expert_node_limit=expert_node_limit),
        solver=SolverInfo(
            status=result.status, seconds=round(result.seconds, 3), candidates=result.stats.enumerated,
            pruned=result.pruned_memory + result.pruned_time, ilps_solved=result.ilps,
            skipped=dict(sorted(result.stats.rejected.items())),
        ),
        binding=binding_of(best, limit),
        explanation=tuple(explanation(result, best, cluster, limit, profile)),
        alternatives=tuple(_alternative(s, best) for s in result.ranked[1:]),
        data_parallel=dp_alt,
        assumptions=tuple(assumptions),
        warnings=tuple(warnings),
    )

