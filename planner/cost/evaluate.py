"""Evaluate one complete assignment: stages (contiguous atom ranges) and a recompute choice per
atom. This is the cost model's single source of figures: the ILP optimises the same expressions
(search/partition.py), the exhaustive search in the tests minimises this function, and every
number a plan reports comes from here.

Per pipeline rank i (holding stages i, i+p, ... when interleaved), for one micro-batch:
    T_i = overlapped(sum over its atoms (fwd + bwd + recompute extra) + pipeline sends per stage,
                     the data-parallel bytes of each micro-batch (ZeRO-2/3)),
          plus those collectives' startup latencies, where overlapped(a, b) = max(a, b) + (1 - e)
          min(a, b) (comm.overlapped_s: contention leaves a share of the shorter exposed)
Step = pipeline(T) + max_i (exposed gradient sync_i + parameter all-gather_i + optimizer_i), with
    exposed sync_i = max(last bucket, overlapped(backward_i, sync_i) - backward_i) over one
    micro-batch's backward of rank i
    (stage_costs.StageCosts documents which collectives each ZeRO stage runs, and when)
Memory_i = (1 + fragmentation) x (weights + grads + optimizer state (each / dp per ZeRO stage)
           + each stage's in-flight count x its kept activations + working set [+ ZeRO-3
           gathered layers]) + reserve,
    with max(grads, activations and working set) for their sum where the gradients are freed
    between steps and made as backward frees the activations (StageCosts.grads_freed).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.comm import exposed_after_s, overlapped_s
from planner.cost.pipeline import pipeline_s
from planner.cost.stage_costs import StageCosts


@dataclass(frozen=True)
class DeviceFigures:
    rank: int
    atoms: tuple[int, ...]
    time_per_microbatch_s: float
    compute_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    """Context-parallel ring exchanges left exposed past attention."""
    ep_comm_s: float
    """Expert-parallel all-to-alls (token dispatch and combine)."""
    p2p_s: float
    sync_s: float
    """Exposed gradient sync, parameter all-gather and optimizer step after the pipeline."""
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    reserve_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.reserve_bytes


@dataclass(frozen=True)
class Evaluation:
    step_time_s: float
    pipeline_s: float
    devices: tuple[DeviceFigures, ...]
    fits: bool

    @property
    def peak_bytes(self) -> float:
        return max(d.total_bytes for d in self.devices)


def device_of(stage: int, pp: int) -> int:
    return stage % pp


def evaluate(costs: StageCosts, bounds: list[int], choice: list[int]) -> Evaluation:
    """`bounds`: S+1 atom indices (stage s holds atoms bounds[s]:bounds[s+1]); `choice`: 0/1/2 per
    atom (none/selective/full recompute)."""
    cand = costs.cand
    p, ranks = cand.pp, cand.grad_ranks
    assert len(bounds) == cand.num_stages + 1, f"bounds({len(bounds)}) != stages({cand.num_stages}) + 1"
    per_device: list[list[int]] = [[] for _ in range(p)]
    for s in range(cand.num_stages):
        per_device[device_of(s, p)].extend(range(bounds[s], bounds[s + 1]))
    stages_per_device = cand.num_stages // p
    devices = []
    for i, atom_ids in enumerate(per_device):
        atoms = [costs.atoms[a] for a in atom_ids]
        compute = sum(a.fwd_s + a.bwd_s - a.tp_comm_s - a.cp_comm_s - a.ep_comm_s for a in atoms)
        recompute = sum(a.extra_s[choice[k]] for a, k in zip(atoms, atom_ids))
        tp_comm = sum(a.tp_comm_s for a in atoms)
        cp_comm = sum(a.cp_comm_s for a in atoms)
        ep_comm = sum(a.ep_comm_s for a in atoms)
        p2p = costs.p2p_s * stages_per_device
        t = compute + recompute + tp_comm + cp_comm + ep_comm + p2p
        params = sum(a.params for a in atoms)
        experts = sum(a.expert_params for a in atoms)
        # data-parallel traffic every micro-batch (ZeRO-2/3): bytes overlap compute, latency does not
        t = overlapped_s(t, costs.mb_comm_s(params, experts), costs.dp_share) + costs.mb_latency_s(atoms)
        one_backward = sum(a.bwd_s for a in atoms)
        exposed = (max(costs.tail_s, exposed_after_s(one_backward, costs.grad_sync_s(params, experts), costs.dp_share))
                   if ranks > 1 else 0.0)
        sync = exposed + costs.after_step_s(params, experts) + costs.after_step_atom_s * len(atoms)
        weights, grads, optim = costs.state_bytes(params, experts)
        weights += costs.zero3_gather_bytes
        # each stage's activations, with their recompute choices, kept as many times as the stage
        # holds micro-batches (the solver's figure, partition.py)
        kept = sum(costs.inflight_stage[s] * costs.atoms[a].act_bytes[choice[a]]
                   for s in range(i, cand.num_stages, p) for a in range(bounds[s], bounds[s + 1]))
        activations = kept + costs.working_bytes
        if costs.grads_freed:  # made as backward frees the activations: what they add to its peak
            grads = max(0.0, grads - activations)
        reserve = costs.reserve_fixed_bytes + costs.fragmentation * (weights + grads + optim + activations)
        devices.append(
            DeviceFigures(
                rank=i,
                atoms=tuple(atom_ids),
                time_per_microbatch_s=t,
                compute_s=compute,
                recompute_s=recompute,
                tp_comm_s=tp_comm,
                cp_comm_s=cp_comm,
                ep_comm_s=ep_comm,
                p2p_s=p2p,
                sync_s=sync,
                weights_bytes=weights,
                grads_bytes=grads,
                optimizer_bytes=optim,
                activations_bytes=activations,
                reserve_bytes=reserve,
            )
        )
    pipe = pipeline_s([d.time_per_microbatch_s for d in devices], cand)
    step = pipe + max(d.sync_s for d in devices)
    fits = all(d.total_bytes <= costs.limit_bytes for d in devices)
    return Evaluation(step_time_s=step, pipeline_s=pipe, devices=tuple(devices), fits=fits)
