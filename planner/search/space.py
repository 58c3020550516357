"""The discrete search space and the bounds that prune it before any ILP is solved.

Candidates: tp x cp x pp x dp = GPUs, tp a degree every tensor-parallel block accepts (head counts,
feature sizes) and at most a node (TP's all-reduces want NVLink: Narayanan et al. 2021, Sec. 3.2;
a user may force more), pp at most the number of atoms, micro-batch b any divisor of the
per-replica batch (llm-foundry's MPT-30B runs take 63 samples a GPU a step in micro-batches of 3:
powers of two and their cofactors alone offer 1 and 63), m = global batch / (dp b)
micro-batches, ZeRO 0-3 (0 only without data parallelism), the schedule
(GPipe, 1F1B with m >= pp as torch runs it, interleaved 1F1B with v = 2-4 chunks when m comes in
whole rounds of pp, as torch's ScheduleInterleaved1F1B requires:
m % max(1, m // pp) == 0), with tp > 1 sequence parallelism on
or off (on only where tp divides the sequence, as the runtime needs), and for ZeRO-2/3 over dp ranks in several nodes, HSDP (one
shard group per node, replicas across nodes) or not; cp a degree whose 2 cp load-balanced shards
split the sequence evenly, on models where context parallelism can run (ModelProfile.cp_blocker),
with a micro-batch b coprime to it: with g = gcd(cp, b) > 1, cp / g CP ranks and g times the
data-parallel replicas with micro-batch b / g give every rank the same tokens, FLOPs, activations
and gradient group with a ring over fewer ranks (unless dp, cp or the micro-batch is fixed).

Bounds, per candidate, from the cost tables alone:
- memory: the least the fullest rank can hold (memory_lower_bound); above the limit, no
  partition fits;
- time: perfectly balanced stages without recompute and no exposed sync. Candidates are solved in
  order of this bound, and the search stops when the bound exceeds the K-th best plan found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterator

from planner.cost.comm import exposed_after_s, overlapped_s
from planner.cost.pipeline import interleaved_rounds
from planner.cost.setup import Candidate
from planner.cost.stage_costs import FULL, KIND_OF, KINDS, NONE, StageCosts
from planner.errors import BadInput
from planner.profile.types import NO_BLOCK, ModelProfile


@dataclass(frozen=True)
class Fixed:
    """Choices the user fixed (None: the search chooses)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    micro_batch: int | None = None
    zero: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    hsdp: bool | None = None
    tp_overlap: bool | None = None
    """Only ever on when asked for: the runtime does not overlap TP collectives (plan run refuses)."""
    ep_overlap: bool | None = None
    """Likewise: the runtime does not run one micro-batch's forward beside another's backward."""



# Model chunks per rank tried for interleaved 1F1B: the published Megatron-LM runs use 2-3
# (published_runs.yaml: 3-5 layers per virtual stage); more multiplies the pipeline sends. Beyond
# these, the chunk counts that split a rank's layers evenly (`interleave_options`): NeMo's
# Nemotron-4 340B runs 12 chunks of one layer on each of 8 ranks, its Llama 3.1 405B 7 of two
# (bench/reference/dgxc_runs.yaml), which a search of 2-4 alone could not find.
INTERLEAVE = (2, 3, 4)


def interleave_options(num_atoms: int, pp: int) -> list[int]:
    """Model chunks per rank the search tries with `pp` ranks: INTERLEAVE, and each divisor of the
    atoms a rank holds (num_atoms // pp) above them, while every stage keeps an atom."""
    return sorted({v for v in (*INTERLEAVE, *divisors(max(1, num_atoms // pp))) if v > 1 and pp * v <= num_atoms})


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def legal_tp(profile: ModelProfile, tp: int) -> bool:
    """Every layer that TP must split accepts the degree (vocab-parallel ones may replicate)."""
    return all(l.tp is None or not l.tp.required or l.tp.legal(tp) for l in profile.layers)


def has_tp_blocks(profile: ModelProfile) -> bool:
    """Tensor parallelism pays only with blocks to split (not just an embedding and a head)."""
    return any(l.tp is not None and l.tp.required for l in profile.layers)


@dataclass
class SpaceStats:
    enumerated: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


def candidates(
    profile: ModelProfile,
    num_gpus: int,
    gpus_per_node: int,
    num_atoms: int,
    global_batch: int,
    fixed: Fixed,
    stats: SpaceStats,
    torch_schedules: bool = True,
) -> Iterator[Candidate]:
    """`torch_schedules`: only the micro-batch counts torch's pipeline schedules run (this runtime's,
    torchtitan's); False for a trainer with schedules of its own (Megatron-LM's run 1F1B with fewer
    micro-batches than stages, and interleaving with any count of at least pp)."""
    check_fixed_cp(profile, fixed)
    check_fixed_ep(profile, fixed)
    # --sequence-parallel on where only expert parallelism lets it run (mixture-of-experts blocks):
    # refused in one line only when no candidate runs it
    deferred: list[BadInput] = []
    with_sp = False
    for cand in _enumerate(profile, num_gpus, gpus_per_node, num_atoms, global_batch, fixed, stats, deferred,
                           torch_schedules):
        with_sp = with_sp or cand.sequence_parallel
        yield cand
    if deferred and not with_sp:
        raise deferred[0]


def _enumerate(
    profile: ModelProfile, num_gpus: int, gpus_per_node: int, num_atoms: int, global_batch: int, fixed: Fixed,
    stats: SpaceStats, deferred: list[BadInput], torch_schedules: bool,
) -> Iterator[Candidate]:
    for tp in divisors(num_gpus):
        if fixed.tp is not None and tp != fixed.tp:
            continue
        if fixed.tp is None and (tp > gpus_per_node or (tp > 1 and not has_tp_blocks(profile))):
            continue
        if tp > 1 and not legal_tp(profile, tp):
            stats.reject(f"tp={tp} does not divide the heads or features")
            continue
        num_cuts = len(profile.pipeline_cuts(tp))
        for cp in _context_parallel(profile, num_gpus // tp, fixed):
            for pp in divisors(num_gpus // (tp * cp)):
                if fixed.pp is not None and pp != fixed.pp:
                    continue
                if pp > 1 and cp > 1 and profile.tracer_splits(tp):
                    stats.reject("context parallelism on pipeline stages split by the tracer (the runtime does not run it)")
                    continue
                if pp > 1 and num_cuts < pp - 1:
                    # one reason per tp, whatever the depth, so that the skipped list reads once per cause
                    stats.reject(f"pipelines of more than {num_cuts + 1} stage{'s' if num_cuts else ''}: the model has "
                                 f"{num_cuts} pipeline cut{'' if num_cuts == 1 else 's'}"
                                 + (f" with tp={tp}" if tp > 1 and profile.pipeline_split == "traced" else ""))
                    continue
                dp = num_gpus // (tp * cp * pp)
                if fixed.dp is not None and dp != fixed.dp:
                    continue
                if global_batch % dp:
                    stats.reject(f"global batch not divisible by dp={dp}")
                    continue
                per_replica = global_batch // dp
                sizes = divisors(per_replica)
                if fixed.micro_batch is not None:  # any size the user asked for that divides it
                    sizes = [fixed.micro_batch] if per_replica % fixed.micro_batch == 0 else []
                replicas = _hsdp_replicas(tp, dp, cp, gpus_per_node, fixed, stats)
                eps = _expert_parallel(profile, tp, cp, dp, pp, fixed, stats)
                sp_by_ep = _sequence_parallel_by_ep(profile, tp, fixed, stats, cp, eps, deferred)
                for sp in sorted({sp for choices in sp_by_ep.values() for sp in choices}, reverse=True):
                    for b in sizes:
                        if cp > 1 and math.gcd(cp, b) > 1 and fixed.cp is None and fixed.dp is None and fixed.micro_batch is None:
                            # dominated: with g = gcd(cp, b), cp / g CP ranks and dp x g replicas of
                            # micro-batch b / g do the same work per rank, with a smaller ring
                            continue
                        for cand in _schedules(tp, pp, dp, b, per_replica // b, num_atoms, fixed, stats, cp, torch_schedules):
                            for rep in replicas if cand.zero >= 2 else [] if fixed.hsdp else [1]:
                                for ep in eps if rep == 1 else [1]:
                                    if sp in sp_by_ep.get(ep, ()):
                                        yield replace(cand, sequence_parallel=sp, dp_replicate=rep,
                                                      tp_overlap=bool(fixed.tp_overlap) and sp, ep=ep,
                                                      ep_overlap=bool(fixed.ep_overlap) and ep > 1 and cand.num_microbatches > 1)


def cp_blocker(profile: ModelProfile) -> str:
    """Why context parallelism cannot run on this model ("" when it can; a profile from before
    the profiler looked reads as blocked)."""
    if profile.cp_blocker is None:
        return "the profile does not say whether its attention can be split (profile it again)"
    return profile.cp_blocker


def check_fixed_cp(profile: ModelProfile, fixed: Fixed) -> None:
    """BadInput when --cp asks for a split the model or its sequence cannot take."""
    if fixed.cp is None or fixed.cp == 1:
        return
    blocker, seq = cp_blocker(profile), profile.seq_len or 0
    if blocker:
        raise BadInput(f"--cp {fixed.cp}: context parallelism cannot run on this model: {blocker}")
    if seq % (2 * fixed.cp):
        raise BadInput(f"--cp {fixed.cp}: the sequence ({seq}) does not split into 2 x {fixed.cp} equal shards "
                       "(context parallelism balances causal attention over 2 cp chunks)")


def _context_parallel(profile: ModelProfile, most: int, fixed: Fixed) -> list[int]:
    """CP degrees (dividing `most`, the GPUs left beside TP): 1, and where the model lets it
    (`cp_blocker`) every degree whose 2 cp load-balanced shards split the sequence evenly (torch's
    context_parallel for causal attention)."""
    if fixed.cp is not None:
        return [fixed.cp] if most % fixed.cp == 0 else []
    if cp_blocker(profile):
        return [1]
    seq = profile.seq_len or 0
    return [c for c in divisors(most) if c == 1 or seq % (2 * c) == 0]


def moe_experts(profile: ModelProfile) -> int:
    """The experts of the model's mixture-of-experts blocks (their gcd when they differ; 0: none)."""
    return math.gcd(*(layer.moe_experts for layer in profile.layers))


def check_fixed_ep(profile: ModelProfile, fixed: Fixed) -> None:
    """BadInput when --ep asks for a split the model cannot take."""
    if fixed.ep is None or fixed.ep == 1:
        return
    experts = moe_experts(profile)
    if not experts:
        raise BadInput(f"--ep {fixed.ep}: expert parallelism needs mixture-of-experts blocks and this model has none "
                       "(a router and a list of identical experts, or stacked expert weights)")
    if experts % fixed.ep:
        raise BadInput(f"--ep {fixed.ep}: the {experts} experts of each mixture-of-experts block do not split evenly "
                       f"over {fixed.ep} ranks")
    if fixed.tp is not None and fixed.tp > 1:
        if fixed.sequence_parallel is False:
            raise BadInput(f"--ep {fixed.ep} with --tp {fixed.tp} needs sequence parallelism (each tensor-parallel rank "
                           "routes its own sequence shard through the experts): drop --sequence-parallel off")
        blocker = profile.sp_blocker_at(fixed.ep)
        if blocker is None or blocker:
            why = blocker or "the profile does not say what tensor parallelism may split beyond the Linear pairs"
            raise BadInput(f"--ep {fixed.ep} with --tp {fixed.tp} needs sequence parallelism (each tensor-parallel rank "
                           f"routes its own sequence shard through the experts), which cannot run on this model: {why}")


def _expert_parallel(profile: ModelProfile, tp: int, cp: int, dp: int, pp: int, fixed: Fixed,
                     stats: SpaceStats) -> list[int]:
    """EP degrees: 1, and on a model with mixture-of-experts blocks each divisor of their experts
    that divides a stage's dp x cp x tp ranks (with TP only under sequence parallelism:
    `_sequence_parallel`). On pipeline stages the pipelining tracer splits, only when --ep and --pp
    are both asked for (a published configuration, say): the runtime does not run that, and `plan
    run` says so before launching."""
    experts = moe_experts(profile)
    wanted = [fixed.ep] if fixed.ep is not None else divisors(experts) if experts else [1]
    out = []
    for ep in wanted:
        if ep > 1 and dp * cp * tp % ep:
            if fixed.ep is not None:
                stats.reject(f"ep={ep} must divide dp x cp x tp={dp * cp * tp}")
        elif ep > 1 and pp > 1 and profile.tracer_splits(tp) and (fixed.ep is None or fixed.pp is None):
            stats.reject("expert parallelism on pipeline stages split by the tracer (the runtime does not run it; "
                         "fix --ep and --pp to plan it anyway)")
        else:
            out.append(ep)
    return out


def _hsdp_replicas(tp: int, dp: int, cp: int, gpus_per_node: int, fixed: Fixed, stats: SpaceStats) -> list[int]:
    """dp_replicate choices for ZeRO-2/3: 1 (shard over all dp x cp ranks) and, where they span
    nodes, HSDP with one shard group per node (replicas across nodes; a replica keeps its cp ranks
    whole)."""
    ranks = dp * cp
    in_node = min(ranks, max(1, gpus_per_node // tp))
    reps = ranks // in_node
    hsdp_ok = ranks > in_node and ranks % in_node == 0 and gpus_per_node % tp == 0 and dp % reps == 0
    if fixed.hsdp and not hsdp_ok:
        stats.reject(f"HSDP needs the dp x cp = {ranks} ranks to span nodes in whole groups of the {in_node} in a node")
        return []
    if fixed.hsdp:
        return [reps]
    return [1, reps] if hsdp_ok and fixed.hsdp is None else [1]


def _sequence_parallel_by_ep(profile: ModelProfile, tp: int, fixed: Fixed, stats: SpaceStats, cp: int,
                             eps: list[int], deferred: list[BadInput]) -> dict[int, list[bool]]:
    """`_sequence_parallel` for each EP degree of `eps`. Its BadInput (SP asked for, and the model
    cannot run it) at once where no EP degree would let SP run; where only ep 1 blocks it (the
    mixture-of-experts blocks run on the sequence shards with EP), into `deferred`: the search
    refuses in one line only when no candidate runs SP (`candidates`)."""
    out: dict[int, list[bool]] = {}
    for ep in eps:
        try:
            out[ep] = _sequence_parallel(profile, tp, fixed, stats, cp, ep)
        except BadInput as exc:
            if ep > 1 or profile.sp_blocker_at(2) != "":
                raise
            stats.reject("sequence parallelism without expert parallelism on mixture-of-experts blocks")
            deferred.append(exc)
            out[ep] = []
    return out


def _sequence_parallel(profile: ModelProfile, tp: int, fixed: Fixed, stats: SpaceStats, cp: int = 1,
                       ep: int = 1) -> list[bool]:
    """Both choices with TP (unless fixed); SP splits the sequence, so tp must divide it, and the
    model must let it (the profile's TP roles: `ModelProfile.sp_blocker_at(ep)`; unknown in a profile
    without them, which the runtime then runs without SP). Expert parallelism with TP only with SP:
    each tp rank routes its own sequence shard (without it every tp rank would route the same tokens)."""
    if tp == 1:
        return [False]
    blocker = profile.sp_blocker_at(ep)
    if blocker is None:
        blocker = "the profile does not say what tensor parallelism may split beyond the Linear pairs"
    if blocker and ep > 1:
        stats.reject("expert parallelism with tensor parallelism needs sequence parallelism, which this model cannot run")
        return []
    if blocker:
        if blocker != NO_BLOCK and (fixed.sequence_parallel or fixed.tp_overlap):  # NO_BLOCK: nothing to split
            flag = "--sequence-parallel on" if fixed.sequence_parallel else "--tp-overlap on (it needs sequence parallelism)"
            raise BadInput(f"{flag}: sequence parallelism cannot run on this model: {blocker}")
        return [False]
    choices = [True, False] if fixed.sequence_parallel is None else [fixed.sequence_parallel]
    if fixed.tp_overlap:  # TP overlap chunks the sequence-parallel collectives
        choices = [c for c in choices if c]
    if True in choices and profile.seq_len and (profile.seq_len // cp) % tp:
        shard = f"each rank's 1/{cp} of the sequence ({profile.seq_len // cp})" if cp > 1 else f"the sequence ({profile.seq_len})"
        stats.reject(f"sequence parallelism needs tp={tp} to divide {shard}")
        choices.remove(True)
    if ep > 1 and False in choices:
        if fixed.sequence_parallel is False or True not in choices:
            stats.reject("expert parallelism with tensor parallelism without sequence parallelism (each tp rank would "
                         "route the same tokens; the runtime does not run it)")
        choices.remove(False)
    return choices


def _schedules(tp, pp, dp, b, m, num_atoms, fixed: Fixed, stats: SpaceStats, cp: int = 1,
               torch_schedules: bool = True) -> Iterator[Candidate]:
    zeros = [0] if dp * cp == 1 else [0, 1, 2, 3]
    for zero in zeros:
        if fixed.zero is not None and zero != fixed.zero:
            continue
        if pp == 1:
            stats.enumerated += 1
            yield Candidate(tp, pp, dp, b, m, zero, fixed.schedule or "1f1b", 1, cp=cp)
            continue
        for schedule in ("1f1b", "gpipe", "interleaved"):
            if fixed.schedule is not None and schedule != fixed.schedule:
                continue
            if schedule == "1f1b" and m < pp and torch_schedules:
                # the runtime's (torch's Schedule1F1B) refuses it; with so few micro-batches GPipe
                # runs the same forwards then backwards, and stays a candidate
                stats.reject("1F1B needs at least pp micro-batches (GPipe runs fewer the same way)")
                continue
            if schedule != "interleaved":
                stats.enumerated += 1
                yield Candidate(tp, pp, dp, b, m, zero, schedule, 1, cp=cp)
                continue
            if m % interleaved_rounds(m, pp) and torch_schedules:
                stats.reject("interleaving needs the micro-batches in equal rounds of at least pp")
                continue
            if m < pp and not torch_schedules:  # Megatron-LM's interleaved schedule needs a round
                stats.reject("interleaving needs at least pp micro-batches (Megatron-LM)")
                continue
            for v in [fixed.virtual_stages] if fixed.virtual_stages else interleave_options(num_atoms, pp):
                if pp * v <= num_atoms:
                    stats.enumerated += 1
                    yield Candidate(tp, pp, dp, b, m, zero, schedule, v, cp=cp)


def least_inflight(costs: StageCosts) -> tuple[float, ...]:
    """Per rank, the least in-flight micro-batches of its stages (StageCosts.inflight_stage)."""
    p = costs.cand.pp
    return tuple(min(costs.inflight_stage[s::p]) for s in range(p))


def memory_lower_bound(costs: StageCosts, recompute: str | None = None) -> float:
    """Bytes on the fullest rank of the best imaginable partition (a valid lower bound).

    With STATE the parameter state and ACT the kept activations of one micro-batch over all
    atoms (with the leanest recompute allowed), rank i holding state_i and infl_i x act_i:
    max_i mem_i >= the mean (STATE + min(infl) ACT) / p, and, weighting rank i by 1/infl_i,
    >= ACT / H + STATE / (max(infl) H) with H = sum_i 1/infl_i (stage 0 of a pipeline holds many
    micro-batches in flight: ACT cannot all go to the rank holding one). infl_i is the least of
    rank i's stages' in-flight counts (interleaved 1F1B's chunks hold different counts), which
    keeps the bound below what any of its splits holds.
    """
    cand = costs.cand
    k = FULL if recompute is None else KIND_OF[recompute]
    weights, grads, optim = costs.state_bytes(*costs.param_totals)
    state = weights + optim + (0.0 if costs.grads_freed else grads)
    act = costs.atoms.memo(("least kept", k), lambda: sum(min(a.act_bytes[k], a.act_bytes[NONE]) for a in costs.atoms))
    infl = least_inflight(costs)
    h = sum(1 / x for x in infl)
    held = max((state + min(infl) * act) / cand.pp, act / h + state / (max(infl) * h))
    # freed gradients (one micro-batch, no pipeline): the peak holds the larger of them and the activations
    late = max(0.0, grads - act - costs.working_bytes) if costs.grads_freed else 0.0
    return costs.device_bytes(held + late + costs.working_bytes + costs.zero3_gather_bytes)


def time_lower_bound(costs: StageCosts, recompute: str | None = None, quick: bool = False) -> float:
    """Perfectly balanced stages, the gradient sync of an average rank, and the least recompute
    memory demands. `quick`: without the terms that cost the most to compute (the recompute
    memory forces, the interleaved ranks' own split): a looser bound, below the full one, that
    orders the candidates before the full one is worth computing (search.py).

    With a fixed recompute choice every atom pays its extra time. With a free choice, if the
    activations kept without recompute cannot fit (by memory_lower_bound's own terms), at least
    the missing bytes must be recomputed, at no less than the linear relaxation of choosing a
    recompute per atom charges (_recompute_offers); under interleaving, whose chunks are fixed,
    the same holds rank by rank (_interleaved_ranks).
    """
    cand = costs.cand
    k = NONE if recompute is None else KIND_OF[recompute]
    times = costs.atoms.times(k)
    total = costs.atoms.memo(("total", k), lambda: sum(times))
    if recompute is None and not quick:
        total += _least_recompute_s(costs)
    p, v = cand.pp, cand.virtual_stages if cand.schedule == "interleaved" else 1
    atoms_per_rank = len(costs.atoms) / p
    params, experts = (x / p for x in costs.param_totals)
    latency = costs.atoms.memo(("latency", costs.latency_key),
                               lambda: costs.mb_latency_s(costs.atoms)) / p
    sends = costs.p2p_s * (cand.num_stages // p)
    # the slowest rank: at least the average, and (without interleaving) at least the best
    # contiguous min-max split of the atoms (exact, by bisection on a greedy fill)
    slowest = total / p + latency
    ranks: list[float] = []
    if v == 1 and p > 1:  # the collectives' latency goes with each atom, wherever it lands
        slowest = max(slowest, costs.atoms.memo(("min-max split", k, p, costs.latency_key),
                                                lambda: min_max_split([t + costs.mb_latency_s([a]) for t, a in zip(times, costs.atoms)], p)))
    elif p > 1 and not quick:  # interleaved: the chunks are the balanced split (partition.py), each rank's fixed
        ranks = _interleaved_ranks(costs, k, free=recompute is None)
        slowest = max(slowest, max(ranks))
    # ZeRO-2/3's traffic every micro-batch runs beside a rank's work, hidden by the overlap share
    # (evaluate: overlapped_s(work, traffic) + latency): overlapped_s is convex, so the mean rank's
    # work and traffic bound the slowest rank's, and p of them the sum over ranks
    mean = overlapped_s(total / p + sends, costs.mb_comm_s(params, experts), costs.dp_share) + latency
    slowest = max(slowest + sends, mean)
    every = max(p * mean, sum(ranks) + p * sends)
    pipeline = (cand.num_microbatches - 1 / v) * slowest + every / v
    # the gradient sync past the last backward (evaluate: exposed_after_s, convex in the rank's
    # backward seconds and parameters, so the mean rank's bounds the slowest's)
    sync = costs.after_step_s(params, experts)
    if cand.grad_ranks > 1:
        backward = costs.atoms.memo("backward", lambda: sum(a.bwd_s for a in costs.atoms)) / p
        sync += max(costs.tail_s, exposed_after_s(backward, costs.grad_sync_s(params, experts), costs.dp_share))
    sync += costs.after_step_atom_s * atoms_per_rank
    return pipeline + sync


def _interleaved_ranks(costs: StageCosts, kind: int, free: bool) -> list[float]:
    """Each rank's least seconds per micro-batch over its interleaved chunks (rank i holds chunks
    i, i + pp, ...: the balanced split the partitioner fixes), with recompute `kind` everywhere.
    With recompute `free` (kind none), a rank over the memory limit must recompute at least the
    bytes it is over (at its stages' largest in-flight count, which no recomputed byte saves more
    than, and the fragmentation on top, as evaluate counts them), at no better than the least
    seconds per byte its atoms offer (inf: none can save)."""
    cand = costs.cand
    S, p = cand.num_stages, cand.pp
    ranks, stage_act = costs.atoms.memo(("interleaved ranks", kind, S, p, costs.latency_key),
                                        lambda: _interleaved_chunks(costs, kind))
    out = []
    for i, (t, params, experts, atoms) in enumerate(ranks):
        if free:
            weights, grads, optim = costs.state_bytes(params, experts)  # pp > 1: gradients are kept
            kept = sum(costs.inflight_stage[s] * stage_act[s] for s in range(i, S, p)) + costs.working_bytes
            held = weights + costs.zero3_gather_bytes + grads + optim + kept
            over = costs.device_bytes(held) - costs.limit_bytes
            if over > 0:
                offers = costs.atoms.memo(("recompute offers", kind, S, p, i), lambda: _recompute_offers(costs, atoms, kind))
                # a byte recomputed saves its stage's in-flight count of bytes: at most the rank's largest
                most = max(costs.inflight_stage[s] for s in range(i, S, p))
                t += _least_recompute_on(offers, over / ((1 + costs.fragmentation) * most))
        out.append(t)
    return out


def _interleaved_chunks(costs: StageCosts, kind: int) -> tuple[list[tuple], list[float]]:
    """Of the balanced chunks, per rank: (seconds per micro-batch with recompute `kind`,
    parameters, expert parameters, its atoms); and per stage its activations kept without
    recompute. Once per atom table."""
    from planner.search.partition import balanced_split

    cand = costs.cand
    S, p = cand.num_stages, cand.pp
    bounds = balanced_split(costs, None, S, p)
    times = costs.atoms.times(kind)
    ranks = []
    for i in range(p):
        ids = [a for s in range(i, S, p) for a in range(bounds[s], bounds[s + 1])]
        ranks.append((sum(times[a] for a in ids) + costs.mb_latency_s([costs.atoms[a] for a in ids]),
                      sum(costs.atoms[a].params for a in ids), sum(costs.atoms[a].expert_params for a in ids), ids))
    stage_act = [sum(costs.atoms[a].act_bytes[NONE] for a in range(bounds[s], bounds[s + 1])) for s in range(S)]
    return ranks, stage_act


def _recompute_offers(costs: StageCosts, ids: list[int], kind: int) -> list[tuple[float, float]]:
    """What recomputing atoms `ids` (from recompute `kind`) can save: (seconds per byte, bytes)
    steps, cheapest first, the lower convex hull of each atom's choices (bytes saved, seconds
    added) merged: the linear relaxation of choosing one recompute per atom, whose least cost
    for a number of bytes no choice beats."""
    hulls = costs.atoms.memo(("recompute hulls", kind), lambda: [_hull(a, kind) for a in costs.atoms])
    return sorted(step for a in ids for step in hulls[a])


def _hull(a, kind: int) -> list[tuple[float, float]]:
    """An atom's (seconds per byte, bytes) steps along the lower convex hull of its recompute
    choices' (bytes saved, seconds added) from `kind`."""
    points = sorted({(a.act_bytes[kind] - a.act_bytes[c], a.extra_s[c] - a.extra_s[kind])
                     for c in KINDS if a.act_bytes[kind] > a.act_bytes[c]})
    steps, at = [], (0.0, 0.0)
    while points:  # from `at`, the least slope to any point further out
        nxt = min(points, key=lambda q: ((q[1] - at[1]) / (q[0] - at[0]), -q[0]))
        steps.append((max((nxt[1] - at[1]) / (nxt[0] - at[0]), 0.0), nxt[0] - at[0]))
        at = nxt
        points = [q for q in points if q[0] > at[0]]
    return steps


def _least_recompute_on(offers: list[tuple[float, float]], need: float) -> float:
    """The least seconds that save `need` bytes by the offers (inf: they cannot)."""
    cost = 0.0
    for per_byte, size in offers:
        if need <= size:
            return cost + need * per_byte
        cost, need = cost + size * per_byte, need - size
    return math.inf


def min_max_split(times: list[float], parts: int) -> float:
    """The smallest possible largest sum when `times` is cut into at most `parts` runs."""

    def fits(cap: float) -> bool:
        runs, acc = 1, 0.0
        for t in times:
            if acc + t > cap:
                runs, acc = runs + 1, t
            else:
                acc += t
        return runs <= parts

    lo, hi = max(times), sum(times)
    while hi - lo > 1e-6 * hi:  # lo stays a lower bound at any precision
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return lo


def _least_recompute_s(costs: StageCosts) -> float:
    over = memory_lower_bound(costs, "none") - costs.limit_bytes
    if over <= 0:
        return 0.0
    infl = least_inflight(costs)
    # bytes of the bound per byte of kept activations (the larger of its two slopes)
    slope = (1 + costs.fragmentation) * max(min(infl) / costs.cand.pp, 1 / sum(1 / x for x in infl))
    offers = costs.atoms.memo(("recompute offers", NONE), lambda: _recompute_offers(costs, range(len(costs.atoms)), NONE))
    # all the atoms offer: at most the bytes recomputing everything saves (the memory bound held
    # with it)
    return _least_recompute_on(offers, min(over / slope, sum(size for _, size in offers)))
