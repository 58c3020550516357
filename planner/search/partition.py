r"""The ILP: split atoms into contiguous pipeline stages and choose recompute, for one candidate.

Atoms 0..A-1 (layers between valid cuts) come in segments g: runs of n_g identical atoms starting
at a_g (a transformer: embedding, N blocks, norm, head = 4 segments). Identical atoms share
variables: the ILP decides how many of each segment each stage takes, not which.

Stages s = 0..S-1 (S = pp x virtual stages); stage s runs on rank i(s) = s mod pp.

Variables
    u_sg in {0, 1}            boundary s (the end of stage s) lies in segment g
    o_sg in Z, [u, n_g u]     ... at this offset:  E_s = sum_g (a_g u_sg + o_sg)
    w_gs = n_g sum_{h>g} u_sh + o_sg     atoms of segment g in stages <= s (w_{g,S-1} = n_g)
    c_gs = w_gs - w_g,s-1     atoms of segment g in stage s
    r_kgs in Z>=0             atoms of segment g in stage s with recompute choice k (selective,
                              alternate, full; sum_k r_kgs <= c_gs; none where an interleaved
                              schedule's fixed chunk s holds none of g)
    T_i >= 0                  time per micro-batch of rank i;  M >= T_i
    X_i >= 0                  exposed gradient sync of rank i;  U >= sync_i
Constraints
    [Place]      sum_g u_sg = 1;  s + 1 <= E_s <= A - (S - 1 - s);  E_0 >= the first stage's
                 least atoms (StageCosts.min_first_atoms: where the layers run in sequence)
    [Order]      E_s >= E_{s-1} + 1                           every stage non-empty
    [Chunks]     interleaved schedules only: E_s fixed to the balanced split of the atoms
    [Recompute]  sum_k r_kgs <= c_gs   (or r_kgs = c_gs for a fixed choice k)
    [Time]       T_i >= B_i + (1 - e) D_i,  T_i >= D_i + (1 - e) B_i   (comm.overlapped_s)
                 B_i = sum_{s on i} sum_g (c_gs t_g + sum_k r_kgs d_kg) + p2p  (t = fwd + bwd),
                 D_i = ZeRO-2/3's bytes per micro-batch (0 otherwise); both rows carry the
                 collectives' latency per atom (per gather under ZeRO-3: AtomCost.gathers)
                 M >= T_i
    [Memory]     (1 + frag)(params_i (w/z3 + g/z2 + o/z1)
                 + sum_{s on i} infl_s sum_g (c_gs act0_g - sum_k r_kgs (act0_g - act_kg))
                 + working + gathered) + reserve <= limit        for each rank i
                 (each stage's activations at its own in-flight count: interleaved chunks hold
                 different counts)
    [Sync]       X_i >= tail,  X_i >= grad_sync(params_i) - e backward_i,
                 X_i >= (1 - e) grad_sync(params_i)   (comm.exposed_after_s);
                 U >= X_i + param_gather(params_i, atoms_i) + optimizer(params_i)
Objective
    minimise  m M + (sum_i T_i - M) / v + U          (= evaluate()'s step time, cost/pipeline.py)
    [Cutoff]     objective <= the K-th best plan found so far, when the search gives one, and
                 <= a known feasible assignment's (returned when nothing beats it)

Solved with HiGHS through PuLP, under a time limit; the status is reported as it is.
"""

from __future__ import annotations

import bisect
import itertools
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pulp

from planner.cost import comm
from planner.cost.evaluate import evaluate
from planner.cost.stage_costs import KIND_OF, KINDS, NONE, StageCosts

RECOMPUTING = KINDS[1:]
"""The choices that recompute something (all but NONE), from the most kept to the least."""

GIB = 2**30
# Relative optimality gap: plans within 0.1% of the optimum count as optimal (HiGHS default 1e-4).
MIP_GAP = 1e-3


@dataclass(frozen=True)
class Segment:
    start: int
    count: int


@dataclass(frozen=True)
class PartitionResult:
    status: str
    """optimal | feasible (time limit hit with a solution) | infeasible | not solved (time limit)."""
    bounds: tuple[int, ...] | None
    choice: tuple[int, ...] | None
    objective_s: float | None
    seconds: float


def segments_of(costs: StageCosts) -> list[Segment]:
    out: list[Segment] = []
    for i, atom in enumerate(costs.atoms):
        if out and costs.atoms[out[-1].start].signature() == atom.signature():
            out[-1] = Segment(out[-1].start, out[-1].count + 1)
        else:
            out.append(Segment(i, 1))
    return out


def solve_partition(
    costs: StageCosts,
    recompute: str | None = None,
    time_limit_s: float = 10.0,
    cutoff_s: float | None = None,
    initial: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> PartitionResult:
    """Optimal stages and recompute for `costs`. `recompute`: fix every atom to this choice.
    `cutoff_s`: only solutions faster than this are wanted (infeasible otherwise), which lets the
    solver drop a candidate as soon as its LP bound is worse. `initial`: (bounds, choice) of a
    feasible assignment to start from."""
    start = time.perf_counter()
    cand = costs.cand
    S, p = cand.num_stages, cand.pp
    A = len(costs.atoms)
    if S > A:
        return PartitionResult("infeasible", None, None, None, time.perf_counter() - start)
    v = cand.virtual_stages if cand.schedule == "interleaved" else 1
    segs = segments_of(costs)
    prob = pulp.LpProblem("partition", pulp.LpMinimize)

    # -- [Order] and [Place]: where each stage boundary falls ------------------------------
    # Boundary s lies in segment g (a_g < E_s <= a_g + n_g) when u_sg = 1, at offset o_sg.
    E: dict[int, object] = {}
    u: dict[tuple[int, int], object] = {}
    o: dict[tuple[int, int], object] = {}
    for s in range(S - 1):
        lo, hi = max(s + 1, costs.min_first_atoms if s == 0 else 0), A - (S - 1 - s)
        if lo > hi:
            return PartitionResult("infeasible", None, None, None, time.perf_counter() - start)
        inside = [g for g, seg in enumerate(segs) if seg.start < hi and seg.start + seg.count >= lo]
        for g in inside:
            seg = segs[g]
            u[s, g] = _var(prob, f"u_{s}_{g}", cat="Binary")
            o[s, g] = _var(prob, f"o_{s}_{g}", 0, seg.count, cat="Integer")
            prob += o[s, g] >= u[s, g]
            prob += o[s, g] <= seg.count * u[s, g]
        prob += pulp.lpSum(u[s, g] for g in inside) == 1, f"place_{s}"
        E[s] = pulp.lpSum(segs[g].start * u[s, g] + o[s, g] for g in inside)
        prob += E[s] >= lo
        prob += E[s] <= hi
    for s in range(1, S - 1):
        prob += E[s] >= E[s - 1] + 1, f"order_{s}"
    if v > 1:
        # [Chunks] Interleaved: chunks are the balanced split (as Megatron-LM assigns layers to
        # virtual stages evenly); the ILP still chooses recompute per rank. Free chunk boundaries
        # with interleaving made HiGHS take seconds per candidate for a gain within the gap.
        chunks = balanced_split(costs, None, S, p)
        for s in range(S - 1):
            prob += E[s] == chunks[s + 1], f"chunk_{s}"
    # Linear expressions are built as {variable: coefficient} dicts (key None: the constant) and
    # turned into PuLP expressions once: PuLP's operator overloading is the slow part otherwise.
    # atoms of segment g in stages <= s: all of it when the boundary lies in a later segment
    w: dict[tuple[int, int], dict] = {}
    for g, seg in enumerate(segs):
        for s in range(S - 1):
            expr = {u[s, h]: float(seg.count) for h in range(g + 1, len(segs)) if (s, h) in u}
            if (s, g) in o:
                expr[o[s, g]] = 1.0
            w[g, s] = expr
        w[g, S - 1] = {None: float(seg.count)}
    # atoms of segment g in stage s (w_gs - w_g,s-1), and on rank i (its stages' counts)
    cnt_stage: dict[tuple[int, int], dict] = {}
    for g in range(len(segs)):
        for s in range(S):
            expr: dict = {}
            _add(expr, w[g, s], 1.0)
            if s > 0:
                _add(expr, w[g, s - 1], -1.0)
            cnt_stage[g, s] = expr
    cnt: dict[tuple[int, int], dict] = {}
    for g in range(len(segs)):
        for i in range(p):
            expr = {}
            for s in range(i, S, p):
                _add(expr, cnt_stage[g, s], 1.0)
            cnt[g, i] = expr

    # -- [Recompute]: counts per stage (its atoms of a segment are interchangeable) -----------
    # r[k, g, s]: atoms of segment g in stage s with recompute choice k (NONE: the rest); a stage
    # apart from the rank's others, since its activations are held at its own in-flight count
    # (interleaved chunks hold different counts). Without interleaving a stage is its rank.
    fixed_kind = None if recompute is None else KIND_OF[recompute]
    r: dict[tuple[int, int, int], dict] = {}
    for g, seg in enumerate(segs):
        for s in range(S):
            if fixed_kind is not None:
                for k in RECOMPUTING:
                    r[k, g, s] = cnt_stage[g, s] if k == fixed_kind else {}
                continue
            if v > 1 and not _overlap(chunks[s], chunks[s + 1], seg):
                for k in RECOMPUTING:  # the fixed chunk holds none of the segment
                    r[k, g, s] = {}
                continue
            chosen = [_var(prob, f"r{k}_{g}_{s}", 0, seg.count, cat="Integer") for k in RECOMPUTING]
            for k, var in zip(RECOMPUTING, chosen):
                r[k, g, s] = {var: 1.0}
            prob += pulp.lpSum(chosen) <= _expr(cnt_stage[g, s]), f"recompute_{g}_{s}"

    # -- per-rank sums ----------------------------------------------------------------------
    def rank_sum(i: int, per_atom) -> pulp.LpAffineExpression:
        expr: dict = {}
        for g, seg in enumerate(segs):
            atom = costs.atoms[seg.start]
            base = per_atom(atom, NONE)
            _add(expr, cnt[g, i], base)
            for k in RECOMPUTING:
                for s in range(i, S, p):
                    _add(expr, r[k, g, s], per_atom(atom, k) - base)
        return _expr(expr)

    def held_activations(i: int) -> pulp.LpAffineExpression:
        """Rank i's activations at the schedule's peak: each stage's activations kept times its
        in-flight micro-batches (StageCosts.inflight_stage), with its recompute choices; evaluate.py
        counts the same."""
        expr: dict = {}
        for s in range(i, S, p):
            for g, seg in enumerate(segs):
                atom = costs.atoms[seg.start]
                _add(expr, cnt_stage[g, s], costs.inflight_stage[s] * atom.act_bytes[NONE])
                for k in RECOMPUTING:
                    _add(expr, r[k, g, s], costs.inflight_stage[s] * (atom.act_bytes[k] - atom.act_bytes[NONE]))
        return _expr(expr)

    # Time rows are in units of `unit` (one micro-batch through the whole model), so that every
    # time coefficient is O(1): HiGHS's absolute tolerances (1e-7) would otherwise swamp a
    # model whose step takes microseconds.
    unit = sum(a.fwd_s + a.bwd_s for a in costs.atoms) or 1.0
    sc = 1.0 / unit
    step_time = lambda atom, k: (atom.fwd_s + atom.bwd_s + atom.extra_s[k]) * sc  # noqa: E731
    backward = lambda atom, k: atom.bwd_s * sc  # noqa: E731
    params_of = lambda atom, k: atom.params  # noqa: E731
    experts_of = lambda atom, k: atom.expert_params  # noqa: E731
    one = lambda atom, k: 1  # noqa: E731
    gathers = lambda atom, k: costs.latency_units(atom)  # noqa: E731

    M = _var(prob, "M", 0)
    U = _var(prob, "U", 0)
    T = {}
    dp = cand.dp
    e = costs.dp_share
    for i in range(p):
        T[i] = _var(prob, f"T_{i}", 0)
        params = rank_sum(i, params_of)
        experts = rank_sum(i, experts_of) if cand.ep > 1 else 0.0
        # [Time]
        latency = costs.mb_comm_atom_s * sc * rank_sum(i, gathers) if costs.mb_comm_atom_s else 0
        busy = rank_sum(i, step_time) + costs.p2p_s * sc * (S // p)
        if costs.mb_comm_param_s:  # ZeRO-2/3 bytes per micro-batch, overlapped with compute (comm.overlapped_s)
            dp_bytes = costs.mb_comm_s(params, experts) * sc
            prob += T[i] >= busy + (1 - e) * dp_bytes + latency, f"time_{i}"
            prob += T[i] >= dp_bytes + (1 - e) * busy + latency, f"dp_mb_{i}"
        else:
            prob += T[i] >= busy + latency, f"time_{i}"
        prob += M >= T[i]
        # [Memory]
        weights, grads, optim = costs.state_bytes(params, experts)
        state = weights + optim + costs.zero3_gather_bytes
        memory = state + (0 if costs.grads_freed else grads) + held_activations(i) + costs.working_bytes
        # in GiB: byte-sized coefficients next to time-sized ones hurt the solver's tolerances
        prob += costs.device_bytes(memory) * (1 / GIB) <= costs.limit_bytes / GIB, f"memory_{i}"
        if costs.grads_freed:  # the peak holds the larger of the activations and the gradients
            prob += costs.device_bytes(state + grads) * (1 / GIB) <= costs.limit_bytes / GIB, f"memory_grads_{i}"
        # [Sync]
        sync = costs.after_step_s(params, experts) * sc
        if costs.after_step_atom_s:
            sync = sync + costs.after_step_atom_s * sc * rank_sum(i, one)
        if dp > 1:
            X = _var(prob, f"X_{i}", 0)
            prob += X >= costs.tail_s * sc
            if costs.grad_sync.per_byte_s or costs.expert_grad_sync_per_byte_s:  # comm.exposed_after_s over one micro-batch's backward
                sync_s = costs.grad_sync_s(params, experts) * sc
                prob += X >= sync_s - e * rank_sum(i, backward)
                prob += X >= (1 - e) * sync_s
            sync = sync + X
        prob += U >= sync, f"sync_{i}"

    m = cand.num_microbatches
    objective = m * M + (pulp.lpSum(T.values()) - M) * (1.0 / v) + U
    prob += objective
    # [Cutoff] the caller's, and a known feasible assignment's: HiGHS 1.16 can hand back a
    # warm start's values instead of a better optimum it found, so a start is given as a bound.
    start_plan = _start_plan(costs, recompute, initial)
    bound_s = min(x for x in (cutoff_s, start_plan[2] if start_plan else None) if x is not None) if (
        cutoff_s is not None or start_plan
    ) else None
    if bound_s is not None:
        prob += objective <= bound_s * sc * (1 + 1e-9), "cutoff"

    solver = _HiGHS(msg=False, timeLimit=time_limit_s, gapRel=MIP_GAP)
    prob.solve(solver)
    elapsed = time.perf_counter() - start
    status = _status(prob)
    if status in ("infeasible", "not solved"):
        # Nothing beat the known assignment: it is the answer (when it is under the cutoff).
        if start_plan is not None and (cutoff_s is None or start_plan[2] <= cutoff_s):
            return PartitionResult("optimal" if status == "infeasible" else "feasible", start_plan[0], start_plan[1], start_plan[2], elapsed)
        if status == "infeasible" and start_plan is None and cutoff_s is None:
            # HiGHS's presolve has been seen to call a feasible model infeasible: confirm.
            prob.solve(_HiGHS(msg=False, timeLimit=time_limit_s, gapRel=MIP_GAP, presolve="off"))
            status = _status(prob)
            elapsed = time.perf_counter() - start
        if status in ("infeasible", "not solved"):
            return PartitionResult(status, None, None, None, elapsed)

    bounds = [0] + [int(round(pulp.value(E[s]))) for s in range(S - 1)] + [A]
    choice = [NONE] * A
    for g, seg in enumerate(segs):
        for s in range(S):
            ids = range(max(bounds[s], seg.start), min(bounds[s + 1], seg.start + seg.count))
            # the stage's atoms of the segment are interchangeable: the leanest choices first
            kinds = [k for k in reversed(RECOMPUTING) for _ in range(int(round(pulp.value(_expr(r[k, g, s])) or 0)))]
            for atom, k in zip(ids, kinds):
                choice[atom] = k
    return PartitionResult(status, tuple(bounds), tuple(choice), pulp.value(prob.objective) * unit, elapsed)


def _overlap(first: int, end: int, seg) -> bool:
    """Whether atoms first:end hold any of segment `seg`'s."""
    return max(first, seg.start) < min(end, seg.start + seg.count)


def _var(prob: pulp.LpProblem, name: str, low=None, up=None, cat: str = "Continuous") -> pulp.LpVariable:
    """A variable attached to `prob` (PuLP 4 drops free-standing LpVariable construction)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def _add(target: dict, expr: dict, scale: float) -> None:
    if scale == 0:
        return
    for var, coef in expr.items():
        target[var] = target.get(var, 0.0) + coef * scale


def _expr(d: dict) -> pulp.LpAffineExpression:
    return pulp.LpAffineExpression([(v, c) for v, c in d.items() if v is not None and c], constant=d.get(None, 0.0))


def _status(prob: pulp.LpProblem) -> str:
    """PuLP says "Optimal" after a time limit that found a feasible point: read sol_status too."""
    if prob.status == pulp.LpStatusOptimal:
        return "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible"
    if prob.status == pulp.LpStatusInfeasible:
        return "infeasible"
    if prob.sol_status in (pulp.LpSolutionIntegerFeasible, pulp.LpSolutionOptimal):
        return "feasible"
    return "not solved"


@contextmanager
def _quiet_stdout():
    """HiGHS prints a banner on stdout when a solver is created, before any option can silence
    it; that would corrupt `plan --json`. Point file descriptor 1 at /dev/null meanwhile."""
    try:
        fd = os.dup(1)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)
        os.close(devnull)


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS, without the banner HiGHS prints on stdout when it starts."""

    def createAndConfigureSolver(self, lp):
        with _quiet_stdout():
            super().createAndConfigureSolver(lp)


def balanced_bounds(times: list[float], num_stages: int, pp: int) -> list[int]:
    """Contiguous split of atoms into `num_stages` non-empty stages minimising the slowest stage
    (greedy fill under a bisected cap): the ILP's starting point, and the interleaved chunks.
    With interleaving a rank holds stages i, i + pp, ...: equal stages make equal ranks."""
    n = len(times)
    prefix = list(itertools.accumulate(times, initial=0.0))

    def split(cap: float) -> list[int] | None:
        """Each stage as far as `cap` allows, leaving an atom for each stage after it."""
        bounds = [0]
        for s in range(num_stages - 1):
            start = bounds[-1]
            fill = bisect.bisect_right(prefix, prefix[start] + cap) - 1  # atoms [start, fill) fit
            bounds.append(max(start + 1, min(fill, n - (num_stages - 1 - s))))
        bounds.append(n)
        # every stage but the last holds what fits under the cap, or one atom (<= max(times) <= cap)
        ok = bounds[-2] < n and prefix[n] - prefix[bounds[-2]] <= cap * (1 + 1e-9)
        return bounds if ok else None

    # the cap lies between the mean stage and the mean plus an atom (each greedy stage but the
    # last then holds more than the mean)
    lo = max(max(times), prefix[n] / num_stages)
    hi = min(prefix[n], lo + max(times))
    best = split(hi)
    if best is None:
        hi = prefix[n]
        best = split(hi) or [round(n * k / num_stages) for k in range(num_stages + 1)]
    while hi - lo > 1e-6 * hi:  # to a millionth of the slowest stage
        mid = (lo + hi) / 2
        b = split(mid)
        if b is not None:
            best, hi = b, mid
        else:
            lo = mid
    return best


def balanced_split(costs: StageCosts, kind: int | None, num_stages: int, pp: int) -> list[int]:
    """balanced_bounds of the atoms' seconds with recompute `kind` (None: forward + backward),
    once per atom table (candidates that differ in ZeRO, schedule or dp share it)."""
    return list(costs.atoms.memo(("balanced", kind, num_stages, pp),
                                 lambda: tuple(balanced_bounds(costs.atoms.times(kind), num_stages, pp))))


def _start_plan(costs, recompute, initial) -> tuple[tuple[int, ...], tuple[int, ...], float] | None:
    """(bounds, choice, step seconds) of a known feasible assignment: `initial` when given, else
    the balanced split with one recompute choice for all atoms, when that fits in memory."""
    cand = costs.cand
    S, p = cand.num_stages, cand.pp
    if initial is not None:
        bounds, choice = list(initial[0]), list(initial[1])
        ev = evaluate(costs, bounds, choice)
    else:
        kinds = KINDS if recompute is None else (KIND_OF[recompute],)
        for k in kinds:
            bounds = balanced_split(costs, k, S, p)
            choice = [k] * len(costs.atoms)
            ev = evaluate(costs, bounds, choice)
            if ev.fits:
                break
    if not ev.fits or (S > 1 and bounds[1] < costs.min_first_atoms):
        return None
    if cand.schedule == "interleaved" and cand.virtual_stages > 1:
        chunks = balanced_split(costs, None, S, p)
        if list(bounds) != chunks:
            return None  # not a point of the interleaved problem (its chunks are fixed)
    return tuple(bounds), tuple(choice), ev.step_time_s
