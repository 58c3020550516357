"""The search: enumerate candidates, prune by bounds, solve an ILP for each survivor, rank.

Candidates are solved in order of their time lower bound; the search stops once the bound of the
next one exceeds the K-th best distinct strategy's score, so hopeless ones never reach the solver.
Plans are ranked by a score, the step time plus a margin per departure from plain data
parallelism (`margin`), with a total order: what is chosen from a set is chosen from any subset
that holds it (fixing a choice to the free search's pick changes nothing).
For each survivor the ILP (partition.py) places layers into stages and picks recompute; every
figure reported is re-evaluated from the chosen assignment (cost/evaluate.py).

Recompute: the ILP is first solved without recompute; only when that fails or leaves less than
RECOMPUTE_HEADROOM of the memory free (where recomputing a layer could buy a better split) is the
full problem, with recompute per layer, solved as well.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from planner.cost.evaluate import Evaluation, evaluate
from planner.cost.setup import Candidate, Training
from planner.cost.stage_costs import FULL, KIND_OF, StageCosts, atom_table, atoms_of, stage_costs
from planner.hardware import Cluster
from planner.profile.types import ModelProfile
from planner.search.partition import MIP_GAP, PartitionResult, balanced_split, solve_partition
from planner.search.space import Fixed, SpaceStats, candidates, memory_lower_bound, time_lower_bound

RECOMPUTE_HEADROOM = 0.15
ILP_TIME_LIMIT_S = 1.0
FREE_RECOMPUTE_LIMIT_S = 1.0
# A safety net, not a setting: a search that stops on it returns the best plan solved so far, which
# then depends on the machine's speed and load. The bounds keep the searches well inside it (the 60
# free searches of bench/bench_published.py --free take at most 6.6 s on two slow cores); at 8 s a
# 96-block GPT's search on a loaded CI machine stopped before its pipelines were solved.
SEARCH_BUDGET_S = 30.0
# Plans are ranked by their predicted step time plus a margin for what they add to plain data
# parallelism, the field's rule of thumb (split the model only when it does not fit or is clearly
# faster). A model split (tp, pp or cp > 1) must be faster by more than SPLIT_MARGIN: 3% is below what
# the cost model resolves (median error 7.0% over the 60 published runs of bench/bench_published.py,
# 7.9% over its 38 held-out runs). Each ZeRO stage and each extra interleaved chunk must pay for
# itself by a smaller margin.
SPLIT_MARGIN = 0.03
# Context parallelism on top of that: its ring is priced with less certainty than the other splits
# (its overlap with attention and the merge of partial results depend on the trainer, and no
# published run with CP is predicted within 10%), so a plan with it must beat the same GPUs without
# it by more than the cost model resolves too. Without this, a 70B model at 4k tokens on 64 A100s
# got cp=2 for a predicted 0.3%; CP is the practice for sequences other splits cannot hold.
CP_MARGIN = SPLIT_MARGIN
ZERO_MARGIN = 0.01
CHUNK_MARGIN = 0.005
log = logging.getLogger(__name__)
SCHEDULE_ORDER = ("1f1b", "gpipe", "interleaved")


def margin(c: Candidate) -> float:
    """The share of its step time a plan must save to beat plain data parallelism."""
    split = SPLIT_MARGIN if c.tp * c.pp * c.cp * c.ep > 1 else 0.0
    chunks = c.virtual_stages - 1 if c.schedule == "interleaved" and c.pp > 1 else 0
    return split + (CP_MARGIN if c.cp > 1 else 0.0) + ZERO_MARGIN * c.zero + CHUNK_MARGIN * chunks


@dataclass(frozen=True)
class Scored:
    cand: Candidate
    costs: StageCosts
    partition: PartitionResult
    evaluation: Evaluation

    @property
    def step_time_s(self) -> float:
        return self.evaluation.step_time_s

    @property
    def score(self) -> float:
        """The step time with the plan's margin: the search ranks plans by this."""
        return self.step_time_s * (1 + margin(self.cand))

    def optimizer_s(self) -> list[float]:
        """Each pipeline rank's optimizer step: its parameters x the seconds per parameter."""
        per_param = self.costs.optimizer_s_per_param
        return [per_param * sum(self.costs.atoms[a].params for a in d.atoms) for d in self.evaluation.devices]

    @property
    def key(self) -> tuple:
        """A total order (score, then simplicity on exact ties): the plan chosen from any set of
        plans is also the one chosen from any subset holding it, so fixing a choice to the value
        the free search picked gives the same plan."""
        return (self.score, _simplicity(self.cand))

    @property
    def shape(self) -> tuple:
        return _shape(self.cand)


def _shape(c: Candidate) -> tuple:
    return (c.dp, c.tp, c.pp, c.cp, c.ep, c.schedule if c.pp > 1 else "")


def _simplicity(c: Candidate) -> tuple:
    return (c.tp * c.pp * c.cp * c.ep, c.zero, c.virtual_stages, -c.micro_batch, c.pp, SCHEDULE_ORDER.index(c.schedule),
            not c.sequence_parallel, c.dp_replicate)


def _rank(plans) -> list[Scored]:
    """Best first, by `Scored.key`."""
    return sorted(plans, key=lambda s: s.key)


@dataclass
class SearchResult:
    ranked: list[Scored]
    """The best plan of each distinct shape (dp, tp, pp, cp, schedule), fastest first."""
    data_parallel: Scored | None
    """Plain data parallelism (tp = pp = 1, ZeRO-0), when it fits."""
    data_parallel_need_bytes: float | None
    """When it does not fit: the least memory per GPU it needs (any micro-batch, full recompute)."""
    min_need_bytes: float | None
    """When nothing fits: the least memory per GPU any candidate needs, and which."""
    min_need_cand: Candidate | None
    stats: SpaceStats
    pruned_memory: int = 0
    pruned_time: int = 0
    ilps: int = 0
    solver_s: float = 0.0
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    budget_hit: bool = False
    tight: bool = False
    """Nothing fit with the allocator's fragmentation counted (constants.FRAGMENTATION_GPU, an
    average): these plans fit without it, their tensors within the memory (run_search)."""

    @property
    def best(self) -> Scored | None:
        return self.ranked[0] if self.ranked else None

    @property
    def status(self) -> str:
        if not self.ranked:
            return "infeasible"
        if self.budget_hit or self.statuses.get("feasible"):
            return "feasible (time limit)"
        return "optimal"


class _Solver:
    def __init__(self, result: SearchResult, fixed: Fixed) -> None:
        self.result = result
        self.fixed = fixed

    def _solve(self, costs: StageCosts, recompute: str | None, cutoff_s: float | None, start=None, limit_s=ILP_TIME_LIMIT_S) -> PartitionResult:
        part = solve_partition(costs, recompute=recompute, time_limit_s=limit_s, cutoff_s=cutoff_s, initial=start)
        log.debug("ilp %6.2fs %-10s recompute=%s %s", part.seconds, part.status, recompute, costs.cand.label())
        r = self.result
        r.ilps += 1
        r.solver_s += part.seconds
        r.statuses[part.status] = r.statuses.get(part.status, 0) + 1
        return part

    def score(self, costs: StageCosts, cutoff_s: float | None = None) -> Scored | None:
        """The candidate's best plan, or None when nothing fits (or nothing beats `cutoff_s`).

        Without a fixed recompute choice: solve without recompute first. Recomputing can only
        pay when memory distorts that solution: when it does not fit, or when it is tight and
        slower than the candidate's lower bound with free recompute. Then the full problem is
        solved, started from (and cut off at) the no-recompute solution, for at most
        FREE_RECOMPUTE_LIMIT_S: HiGHS keeps its incumbent if it finds nothing better in time.
        """
        if self.fixed.recompute is not None:
            part = self._solve(costs, self.fixed.recompute, cutoff_s)
        else:
            part = self._solve(costs, "none", cutoff_s)
            tight = part.bounds is None or evaluate(costs, list(part.bounds), list(part.choice)).peak_bytes > (
                1 - RECOMPUTE_HEADROOM
            ) * costs.limit_bytes
            distorted = part.bounds is None or part.objective_s > time_lower_bound(costs) * (1 + MIP_GAP)
            if tight and distorted:
                start = (part.bounds, part.choice) if part.bounds is not None else None
                best_known = part.objective_s if part.objective_s is not None else cutoff_s
                free = self._solve(costs, None, best_known, start, FREE_RECOMPUTE_LIMIT_S)
                if free.bounds is not None and (part.bounds is None or free.objective_s < part.objective_s):
                    part = free
        if part.bounds is None:
            return None
        ev = evaluate(costs, list(part.bounds), list(part.choice))
        return Scored(costs.cand, costs, part, ev) if ev.fits else None


def run_search(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    fixed: Fixed = Fixed(),
    top_k: int = 3,
    cpu_factor: Callable[[float], float] | None = None,
) -> SearchResult:
    """The best plans for the request. `cpu_factor`: cost the profile's measured CPU seconds times
    this function of the share of the step a process computes (planning._cpu_factor: where more
    processes than cores take turns, it falls with that share), settled per plan (`_settle`).

    On a GPU, when nothing fits with the allocator's fragmentation counted, the plans whose
    tensors fit without it (`SearchResult.tight`): the fragmentation is an average of what the
    caching allocator holds unused when it has room (15%, GMLake), and a run that needs the room
    gets some of it back, as PyTorch's allocator frees its cached blocks and retries a cudaMalloc
    that failed (c10/cuda/CUDACachingAllocator.cpp); configurations that ran at the edge of memory
    (llm-foundry's largest micro-batches) need less than 10%. Only what cannot fit at all is
    refused."""
    result = _search(profile, cluster, training, fixed, top_k, cpu_factor)
    if result.best is None and training.fragmentation is None and cluster.gpu.origin != "measured":
        tight = _search(profile, cluster, replace(training, fragmentation=0.0), fixed, top_k, cpu_factor)
        if tight.best is not None:
            tight.tight = True
            tight.seconds += result.seconds
            return tight
    return result


def _search(
    profile: ModelProfile,
    cluster: Cluster,
    training: Training,
    fixed: Fixed,
    top_k: int,
    cpu_factor: Callable[[float], float] | None,
) -> SearchResult:
    start = time.perf_counter()
    stats = SpaceStats()
    result = SearchResult([], None, None, None, None, stats)
    num_atoms = len(atoms_of(profile))
    tables: dict[tuple, tuple] = {}

    all_busy = cpu_factor(1.0) if cpu_factor is not None else None
    # the time bounds that prune hold for any share of the step a process computes: the least factor
    lowest = cpu_factor(0.0) if cpu_factor is not None else None

    def costs_of(cand: Candidate, factor: float | None = all_busy) -> StageCosts:
        key = (cand.tp, cand.micro_batch, cand.sequence_parallel, cand.tp_overlap, cand.cp, cand.ep, cand.ep_overlap)
        if (key, factor) not in tables:
            tables[key, factor] = atom_table(profile, cluster, training, *key[:2], factor, *key[2:])
        return stage_costs(profile, cluster, training, cand, factor, atoms=tables[key, factor])

    survivors: list[tuple[float, StageCosts]] = []
    for cand in candidates(profile, cluster.num_gpus, cluster.gpus_per_node, num_atoms, training.global_batch, fixed, stats,
                           torch_schedules=training.trainer != "megatron"):
        costs = costs_of(cand, lowest)
        need = memory_lower_bound(costs, fixed.recompute)
        if need > costs.limit_bytes:
            result.pruned_memory += 1
            if result.min_need_bytes is None or need < result.min_need_bytes:
                result.min_need_bytes, result.min_need_cand = need, cand
            continue
        survivors.append((time_lower_bound(costs, fixed.recompute, quick=True), costs))
    # in line by their quick bound; a candidate's full bound (tighter, dearer) is computed when it
    # comes first, and it goes back in line: the first always has the least bound of those left
    queue = [(bound, n, False) for n, (bound, _) in enumerate(survivors)]
    heapq.heapify(queue)

    solver = _Solver(result, fixed)
    best_by_shape: dict[tuple, Scored] = {}
    while queue:
        bound, n, full = heapq.heappop(queue)
        costs = survivors[n][1]
        kth = sorted(s.score for s in best_by_shape.values())[top_k - 1 : top_k]
        if kth and bound > kth[0]:  # every later candidate's score >= its time >= its bound
            result.pruned_time += len(queue) + 1
            break
        if not full:
            heapq.heappush(queue, (time_lower_bound(costs, fixed.recompute), n, True))
            continue
        if time.perf_counter() - start > SEARCH_BUDGET_S and best_by_shape:
            result.budget_hit = True
            break
        # Only a plan that could enter the top K and beat its shape's best is worth solving for:
        # its step time must stay under their scores less its own margin.
        shape_best = best_by_shape.get(_shape(costs.cand))
        scores = kth + ([shape_best.score] if shape_best else [])
        cutoff = min(scores) / (1 + margin(costs.cand)) if scores else None
        if cutoff is not None and bound > cutoff:
            result.pruned_time += 1
            continue
        if lowest != all_busy:
            costs = costs_of(costs.cand)
        scored = _settle(solver.score(costs, cutoff), cpu_factor, costs_of, solver)
        if scored is None:
            continue
        shape = scored.shape
        if shape not in best_by_shape or scored.key < best_by_shape[shape].key:
            best_by_shape[shape] = scored
    result.ranked = _rank(best_by_shape.values())
    leanest = FULL if fixed.recompute is None else KIND_OF[fixed.recompute]
    if not result.ranked:
        _min_need(result, survivors, leanest)
    # Plain data parallelism as a user would try it: any recompute that makes it fit.
    _data_parallel_baseline(result, profile, cluster, training, costs_of, _Solver(result, Fixed()), num_atoms,
                            cpu_factor)
    result.seconds = time.perf_counter() - start
    return result


def busy_share(s: Scored) -> float:
    """The share of the step a process computes (forward, backward, recompute, optimizer step),
    averaged over the pipeline ranks. The rest it waits in gloo: for a pipeline neighbour (the
    bubble), a tensor-parallel partner or a data-parallel collective, which takes next to no CPU
    (a 3 s wait in a gloo recv or all-reduce took 0.01 s of CPU here)."""
    ev, m = s.evaluation, s.cand.num_microbatches
    if ev.step_time_s <= 0:
        return 1.0
    busy = [m * (d.compute_s + d.recompute_s) + opt for d, opt in zip(ev.devices, s.optimizer_s())]
    return min(1.0, sum(busy) / len(busy) / ev.step_time_s)


def _settle(scored: Scored | None, cpu_factor: Callable[[float], float] | None, costs_of, solver: "_Solver") -> Scored | None:
    """The plan (costed with every process busy) re-costed until the CPU factor agrees with the
    share of the step its processes compute (planning._cpu_factor): processes waiting in gloo (a
    pipeline bubble, a collective) leave the cores to the others. That share moves little as the
    factor does (the waits scale with the compute), so a round or two settle it; none where the
    factor is constant."""
    if cpu_factor is None:
        return scored
    factor = cpu_factor(1.0)
    for _ in range(SETTLE_ROUNDS):
        if scored is None:
            return None
        new = float(f"{cpu_factor(busy_share(scored)):.3g}")
        if abs(new - factor) <= SETTLE_TOLERANCE * factor:
            break
        factor = new
        scored = solver.score(costs_of(scored.cand, factor))
    return scored


SETTLE_ROUNDS = 6
SETTLE_TOLERANCE = 0.01


def _min_need(result: SearchResult, survivors: list[tuple[float, StageCosts]], leanest: int) -> None:
    """Nothing fit: the least peak memory among candidates that passed the bound (balanced
    stages, the leanest recompute allowed), to tell the user how far off the limit they are."""
    for _, costs in survivors:
        bounds = balanced_split(costs, None, costs.cand.num_stages, costs.cand.pp)
        ev = evaluate(costs, bounds, [leanest] * len(costs.atoms))
        if result.min_need_bytes is None or ev.peak_bytes < result.min_need_bytes:
            result.min_need_bytes, result.min_need_cand = ev.peak_bytes, costs.cand


def _data_parallel_baseline(result, profile, cluster, training, costs_of, solver, num_atoms, cpu_factor) -> None:
    """The best plain data-parallel plan (tp = pp = 1, ZeRO-0), or the memory it would need."""
    dp_only = Fixed(tp=1, pp=1, zero=0, cp=1, ep=1)
    for s in result.ranked:
        if (s.cand.tp, s.cand.pp, s.cand.cp, s.cand.ep, s.cand.zero) == (1, 1, 1, 1, 0):
            result.data_parallel = s
            return
    best: Scored | None = None
    need: float | None = None
    for cand in candidates(profile, cluster.num_gpus, cluster.gpus_per_node, num_atoms, training.global_batch, dp_only, SpaceStats()):
        costs = costs_of(cand)
        ev = evaluate(costs, [0, len(costs.atoms)], [FULL] * len(costs.atoms))
        if not ev.fits:
            need = ev.peak_bytes if need is None else min(need, ev.peak_bytes)
            continue
        scored = _settle(solver.score(costs), cpu_factor, costs_of, solver)
        if scored is not None and (best is None or scored.step_time_s < best.step_time_s):
            best = scored
    result.data_parallel = best
    result.data_parallel_need_bytes = None if best is not None else need
