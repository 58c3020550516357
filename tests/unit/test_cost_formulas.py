"""Each cost-model formula on a small case computed by hand, so a change that breaks one says which:
collectives (alpha-beta, ring steps), pipeline schedules (time and in-flight micro-batches), memory
per ZeRO stage (FSDP under a pipeline, HSDP), data-parallel exposure (DDP's last bucket, ZeRO-1's
gathers, ZeRO-3 per micro-batch, with the overlap efficiency), recompute policies."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.cost import comm
from planner.cost.constants import ASYNC_TP_OVERLAP, DDP_BUCKET_BYTES, LINK_EFFICIENCY, MEMORY_EFFICIENCY, OVERLAP_CONTENTION
from planner.cost.evaluate import evaluate
from planner.cost.pipeline import inflight_per_stage, pipeline_s
from planner.cost.setup import Candidate, Training
from planner.cost.stage_costs import NONE, stage_costs, tp_collectives_s
from planner.hardware import make_cluster
from tests.unit.test_partition import synthetic_profile

GB = 1e9
LINK = comm.Link(bandwidth_Bps=100 * GB, latency_s=10e-6)


def test_collectives_alpha_beta():
    # all-reduce over 8: 3 latency steps (ceil log2 8), 2 x 7/8 of the buffer over 80 GB/s
    ar = comm.allreduce(8, LINK)
    assert ar.fixed_s == pytest.approx(30e-6)
    assert ar(1e9) == pytest.approx(30e-6 + 1.75 * 1e9 / (100 * GB * LINK_EFFICIENCY))
    # all-gather / reduce-scatter over 4: 2 latency steps, 3/4 of the gathered buffer
    ag = comm.allgather(4, LINK)
    assert ag(4e9) == pytest.approx(20e-6 + 0.75 * 4e9 / 80e9)
    assert comm.reduce_scatter(4, LINK) == ag
    assert comm.allreduce(1, LINK)(1e9) == 0.0  # no peers, no traffic
    # a ring (all-gather, reduce-scatter) adds a latency per step: n - nodes NVLink steps and
    # nodes - 1 network steps (NCCL's tuning model); 1,536 GPUs in 192 nodes: 6.4 ms per call
    assert comm.ring_step_s(16, 2) == pytest.approx((14 * 3.4e-6 + 9.6e-6) / 15)
    ring = comm.Link(bandwidth_Bps=100 * GB, latency_s=10e-6, ring_step_s=comm.ring_step_s(1536, 192))
    assert comm.allgather(1536, ring).fixed_s == pytest.approx(11 * 10e-6 + 1344 * 3.4e-6 + 191 * 9.6e-6)
    assert comm.allreduce(1536, ring).fixed_s == pytest.approx(11 * 10e-6)  # all-reduce: trees
    assert comm.p2p(LINK)(8e9) == pytest.approx(10e-6 + 0.1)


@pytest.mark.parametrize("schedule,v,expect_s,per_stage", [
    # 4 ranks, 8 micro-batches, stage times 1 s: (m + p - 1) T for GPipe and 1F1B
    ("gpipe", 1, 11.0, (8, 8, 8, 8)),
    ("1f1b", 1, 11.0, (4, 3, 2, 1)),
    # interleaved with 2 chunks: m T + (p - 1) T / v; rank i holds 2(p-i-1) + (v-1)p + 1 = 11, 9,
    # 7, 5 chunk-micro-batches, run 4 (a round) per chunk in turn: rank 0 forwards chunk 0 four
    # times, chunk 1 four times, chunk 0 three more (7 and 4); the last rank 4 and 1
    ("interleaved", 2, 9.5, (7, 5, 4, 4, 4, 4, 3, 1)),
])
def test_pipeline_schedules(schedule, v, expect_s, per_stage):
    cand = Candidate(tp=1, pp=4, dp=1, micro_batch=1, num_microbatches=8, zero=0, schedule=schedule, virtual_stages=v)
    assert pipeline_s([1.0] * 4, cand) == pytest.approx(expect_s)
    assert inflight_per_stage(cand) == pytest.approx(per_stage)
    # the slowest stage sets the pace: (m - 1) max + sum for one chunk per rank
    if v == 1:
        assert pipeline_s([1.0, 2.0, 1.0, 1.0], cand) == pytest.approx(7 * 2 + 5)


def _costs(zero: int, dp: int = 4, m: int = 4, gpus_per_node: int | None = None, dp_overlap: float | None = None):
    profile = synthetic_profile(n_blocks=4, h=1024, s=512, heads=16, vocab=32768)
    cluster = make_cluster("a100-80gb", dp, gpus_per_node)
    training = Training("bf16", "adamw", dp * m, 80 * 2**30, dp_overlap=dp_overlap)
    cand = Candidate(tp=1, pp=1, dp=dp, micro_batch=1, num_microbatches=m, zero=zero, schedule="1f1b")
    return profile, stage_costs(profile, cluster, training, cand)


def test_each_stage_holds_its_activations_at_its_own_in_flight_count():
    """Interleaved 1F1B, 2 ranks x 2 chunks, 4 micro-batches in rounds of 2: rank 0 runs 2(p-1) +
    p + 1 = 5 forwards before its first backward (chunk 0, 0, 1, 1, 0: stages 0 and 2 hold 3 and
    2), rank 1 three (stages 1 and 3 hold 2 and 1). With every atom recomputed, a rank keeps each
    stage's recomputed activations at that stage's count: rank 1, 2 x stage 1's + 1 x stage 3's
    (the head's, which recompute does not lower), not its mean 1.5 x both."""
    from planner.cost.stage_costs import FULL
    from planner.search.partition import balanced_split

    profile = synthetic_profile(n_blocks=6)
    cand = Candidate(tp=1, pp=2, dp=1, micro_batch=1, num_microbatches=4, zero=0, schedule="interleaved", virtual_stages=2)
    costs = stage_costs(profile, make_cluster("a100-80gb", 2), Training("bf16", "adamw", 4, 80 * 2**30), cand)
    assert costs.inflight_stage == (3, 2, 2, 1)
    bounds = balanced_split(costs, FULL, 4, 2)
    ev = evaluate(costs, bounds, [FULL] * len(costs.atoms))

    def kept(s):
        return sum(costs.atoms[a].act_bytes[FULL] for a in range(bounds[s], bounds[s + 1]))

    assert ev.devices[0].activations_bytes == pytest.approx(3 * kept(0) + 2 * kept(2) + costs.working_bytes)
    assert ev.devices[1].activations_bytes == pytest.approx(2 * kept(1) + 1 * kept(3) + costs.working_bytes)


@pytest.mark.parametrize("zero,per_param", [
    # bf16 + AdamW: 2 (weights) + 2 (grads) + 12 (fp32 master, momentum, variance), dp = 4
    (0, (2, 2, 12)), (1, (2, 2, 3)), (2, (2, 0.5, 3)), (3, (0.5, 0.5, 3)),
])
def test_memory_per_zero_stage(zero, per_param):
    profile, costs = _costs(zero)
    assert costs.state_bytes_per_param() == pytest.approx(per_param)
    ev = evaluate(costs, [0, len(costs.atoms)], [NONE] * len(costs.atoms))
    (d,) = ev.devices
    params = sum(a.params for a in costs.atoms)
    assert params == profile.num_params
    assert d.grads_bytes == pytest.approx(params * per_param[1])
    assert d.optimizer_bytes == pytest.approx(params * per_param[2])
    # ZeRO-3 also holds the two largest layers gathered (the current one and the prefetched)
    gathered = sum(sorted((a.params for a in costs.atoms), reverse=True)[:2]) * 2 if zero == 3 else 0
    assert d.weights_bytes == pytest.approx(params * per_param[0] + gathered)
    # activations: one micro-batch kept, plus the backward working set (twice the largest layer's)
    kept = sum(a.act_bytes[NONE] for a in costs.atoms)
    assert d.activations_bytes == pytest.approx(kept + 2 * max(a.act_bytes[NONE] for a in costs.atoms))
    held = d.weights_bytes + d.grads_bytes + d.optimizer_bytes + d.activations_bytes
    assert d.reserve_bytes == pytest.approx(costs.reserve_fixed_bytes + costs.fragmentation * held)


@pytest.mark.parametrize("zero, dp, m, trainer, freed", [
    (3, 4, 1, "this", True), (2, 4, 1, "torchtitan", True),  # FSDP2, one micro-batch: freed after each step
    (0, 1, 1, "this", True),  # the runtime's single rank (FSDP2 over one rank, or the plain model)
    (3, 4, 2, "this", False),  # accumulated over the micro-batches: held through the next forward
    (0, 4, 1, "this", False),  # DDP's buckets hold them
    (3, 4, 1, "megatron", False),  # Megatron-LM's contiguous gradient buffers
])
def test_freed_gradients_share_the_peak_with_the_activations(zero, dp, m, trainer, freed):
    """With gradients freed after each step and made as backward frees one micro-batch's
    activations, the peak holds the larger of the two, not both (an H200 run: 39.49 GB allocated
    where gradients and activations together made 43.5): the device's gradients count only past
    its activations, and the ILP's constraints say the same (two of them: activations, gradients)."""
    profile = synthetic_profile(n_blocks=4, h=1024, s=512, heads=16, vocab=32768)
    training = Training.for_trainer(trainer, "bf16", "adamw", dp * m, 80 * 2**30)
    cand = Candidate(tp=1, pp=1, dp=dp, micro_batch=1, num_microbatches=m, zero=zero, schedule="1f1b")
    costs = stage_costs(profile, make_cluster("a100-80gb", dp), training, cand)
    assert costs.grads_freed == freed
    (d,) = evaluate(costs, [0, len(costs.atoms)], [NONE] * len(costs.atoms)).devices
    grads = costs.state_bytes(profile.num_params)[1]
    assert d.grads_bytes == pytest.approx(max(0.0, grads - d.activations_bytes) if freed else grads)
    if freed:  # a tiny micro-batch's activations below the gradients: the gradients set the peak
        assert d.grads_bytes == 0 and d.activations_bytes > grads
        small = replace(costs, atoms=tuple(replace(a, act_bytes=tuple(b / 1e4 for b in a.act_bytes)) for a in costs.atoms),
                        working_bytes=costs.working_bytes / 1e4)
        (e,) = evaluate(small, [0, len(costs.atoms)], [NONE] * len(costs.atoms)).devices
        assert e.grads_bytes + e.activations_bytes == pytest.approx(grads)


A100_HBM = 2039 * GB  # profiles/a100-80gb.yaml


def _hidden(link_Bps: float) -> float:
    """The share of an overlap that a collective's contention leaves hidden, by hand: 1 - the
    constant x its link's bandwidth over the A100's HBM bandwidth."""
    return max(0.0, 1 - OVERLAP_CONTENTION * link_Bps / A100_HBM)


def test_contention_exposes_more_of_an_nvlink_ring_than_of_a_network_ring():
    """A collective beside compute slows it by OVERLAP_CONTENTION x the rate its link moves bytes
    at over HBM's: on an A100 (2,039 GB/s) an NVLink ring (300 GB/s) at 4 leaves 1 - 4 x 0.147 =
    41% of the overlap hidden, a network ring of one GPU a node behind 200 Gb/s (25 GB/s) 95%; a
    trainer's own share (Training.dp_overlap) overrides it."""
    nvlink, network = comm.Link(300 * GB, 8e-6), comm.Link(25 * GB, 15e-6)
    c = OVERLAP_CONTENTION
    assert comm.overlap_share(None, comm.link_load(nvlink, A100_HBM)) == pytest.approx(1 - c * 300 / 2039)
    assert comm.overlap_share(None, comm.link_load(network, A100_HBM)) == pytest.approx(1 - c * 25 / 2039)
    assert comm.overlap_share(None, comm.link_load(network, A100_HBM)) > comm.overlap_share(None, comm.link_load(nvlink, A100_HBM))
    assert comm.overlap_share(None, 1e6) == 0.0  # no less than nothing hidden
    assert comm.overlap_share(1.0, comm.link_load(nvlink, A100_HBM)) == 1.0
    # 10 s of compute beside 4 s of gathers: the gathers' contention adds (1 - e) x 4 s
    assert comm.overlapped_s(10.0, 4.0, comm.overlap_share(None, comm.link_load(network, A100_HBM))) == pytest.approx(
        10 + 4 * c * 25 / 2039)
    _, costs = _costs(zero=3, gpus_per_node=1)  # the plan's own data-parallel link: the network
    assert costs.dp_share == pytest.approx(_hidden(25 * GB))
    _, costs = _costs(zero=3)  # one node: NVLink
    assert costs.dp_share == pytest.approx(_hidden(300 * GB))


def test_ddp_exposes_the_last_bucket_and_the_optimizer():
    profile, costs = _costs(zero=0)
    ev = evaluate(costs, [0, len(costs.atoms)], [NONE] * len(costs.atoms))
    params = profile.num_params
    ar = comm.allreduce(4, comm.Link(300 * GB, 8e-6))  # one A100 node: NVLink 3, 300 GB/s per direction
    tail = ar(min(DDP_BUCKET_BYTES, params * 2))
    backward = sum(a.bwd_s for a in costs.atoms)
    # overlapped with the last backward: the sync past it, or the share contention leaves exposed
    e = _hidden(300 * GB)
    exposed = max(tail, ar(params * 2) - e * backward, (1 - e) * ar(params * 2))
    optimizer = costs.optimizer_s_per_param * params
    assert ev.devices[0].sync_s == pytest.approx(exposed + optimizer)
    compute = sum(a.fwd_s + a.bwd_s for a in costs.atoms)
    assert ev.step_time_s == pytest.approx(4 * compute + exposed + optimizer)


@pytest.mark.parametrize("e", [0.0, 1.0])
def test_a_trainer_that_overlaps_its_data_parallel_traffic(e):
    """Training.dp_overlap (Megatron's --overlap-grad-reduce: 1) replaces the contention's share for the
    plan's data-parallel traffic: the gradient sync beside the last backward, ZeRO-3's gathers
    beside each micro-batch. Fully hidden (1), only the sync past the backward and the last bucket
    are exposed, and a micro-batch takes the longer of its compute and its gathers."""
    from planner.search.partition import solve_partition

    profile, costs = _costs(zero=0, gpus_per_node=1, dp_overlap=e)  # over a 200 Gb/s network
    ar = comm.allreduce(4, comm.Link(25 * GB, 15e-6))
    backward = sum(a.bwd_s for a in costs.atoms)
    sync = ar(profile.num_params * 2)
    tail = ar(min(DDP_BUCKET_BYTES, profile.num_params * 2))
    ev = evaluate(costs, [0, len(costs.atoms)], [NONE] * len(costs.atoms))
    exposed = max(tail, sync - e * backward, (1 - e) * sync)
    assert ev.devices[0].sync_s == pytest.approx(exposed + costs.optimizer_s_per_param * profile.num_params)
    best = solve_partition(costs, recompute="none")  # the ILP states the same exposure
    assert best.objective_s == pytest.approx(ev.step_time_s, rel=1e-4)
    profile, costs = _costs(zero=3, gpus_per_node=1, dp_overlap=e)
    ev = evaluate(costs, [0, len(costs.atoms)], [NONE] * len(costs.atoms))
    compute = sum(a.fwd_s + a.bwd_s for a in costs.atoms)
    gathers = costs.mb_comm_s(profile.num_params, 0.0)
    latency = costs.mb_comm_atom_s * len(costs.atoms)
    assert ev.devices[0].time_per_microbatch_s == pytest.approx(max(compute, gathers) + (1 - e) * min(compute, gathers) + latency)


@pytest.mark.parametrize("how,per_block", [("layer", 1), ("module", 6), ("tensor", 12)])
def test_zero3_pays_a_collective_s_latency_for_each_gather(how, per_block):
    """Training.zero3_gathers: ZeRO-3 gathers a GPT block (6 modules that hold 12 tensors) with
    one collective (FSDP's unit), one per module (DeepSpeed since v0.5) or one per tensor
    (DeepSpeed before): each pays its startup latency (mb_comm_atom_s) every micro-batch, the
    bytes stay the same; the ILP states the same; ZeRO-2's reduce-scatter is one per atom anyway."""
    from planner.search.partition import solve_partition

    base = synthetic_profile(n_blocks=4, h=1024, s=512, heads=16, vocab=32768)
    profile = replace(base, layers=tuple(replace(l, param_modules=6, param_tensors=12) if l.kind.startswith("Block") else l
                                         for l in base.layers))
    cluster = make_cluster("a100-80gb", 4)
    for zero in (3, 2):
        cand = Candidate(tp=1, pp=1, dp=4, micro_batch=1, num_microbatches=4, zero=zero, schedule="1f1b")
        layer, costs = (stage_costs(profile, cluster, Training("bf16", "adamw", 16, 80 * 2**30, zero3_gathers=g), cand)
                        for g in ("layer", how))
        blocks = sum(1 for l in profile.layers if l.kind.startswith("Block"))
        assert [a.gathers for a in costs.atoms] == [per_block if profile.layers[a.first].kind.startswith("Block") else 1
                                                    for a in costs.atoms]
        whole = [0, len(costs.atoms)], [NONE] * len(costs.atoms)
        before, after = evaluate(layer, *whole), evaluate(costs, *whole)
        extra = costs.mb_comm_atom_s * blocks * (per_block - 1) if zero == 3 else 0.0
        assert after.devices[0].time_per_microbatch_s == pytest.approx(before.devices[0].time_per_microbatch_s + extra)
        assert solve_partition(costs, recompute="none").objective_s == pytest.approx(after.step_time_s, rel=1e-4)


def test_zero1_all_reduces_then_gathers_layer_by_layer():
    profile, costs = _costs(zero=1)
    ev = evaluate(costs, [0, len(costs.atoms)], [NONE] * len(costs.atoms))
    params, atoms = profile.num_params, len(costs.atoms)
    link = comm.Link(300 * GB, 8e-6, comm.ring_step_s(4, 1))
    ar, ag = comm.allreduce(4, link), comm.allgather(4, link)
    e, backward = _hidden(300 * GB), sum(a.bwd_s for a in costs.atoms)
    exposed = max(ar(min(DDP_BUCKET_BYTES, params * 2)), ar(params * 2) - e * backward, (1 - e) * ar(params * 2))
    gathers = ag.per_byte_s * 2 * params + ag.fixed_s * atoms  # the 16-bit weights, one collective per layer
    assert ev.devices[0].sync_s == pytest.approx(exposed + gathers + costs.optimizer_s_per_param * params)
    assert costs.optimizer_s_per_param == pytest.approx(_costs(zero=0)[1].optimizer_s_per_param / 4)


def test_megatron_distributed_optimizer_reduce_scatters_then_gathers():
    """Megatron's distributed optimizer (Training.zero1_reduce_scatter) reduce-scatters the
    gradients beside the last backward, half an all-reduce's bytes, then all-gathers the updated
    weights layer by layer after the optimizer; the ILP states the same. This runtime's ZeRO-1
    (DDP, then torch's ZeroRedundancyOptimizer) all-reduces."""
    from planner.search.partition import solve_partition

    profile = synthetic_profile(n_blocks=4, h=1024, s=512, heads=16, vocab=32768)
    cluster = make_cluster("a100-80gb", 4, 1)  # nodes of one GPU: the network, 200 Gb/s
    cand = Candidate(tp=1, pp=1, dp=4, micro_batch=1, num_microbatches=4, zero=1, schedule="1f1b")
    link = comm.Link(25 * GB, 15e-6, comm.ring_step_s(4, 4))
    rs, ag, ar = comm.reduce_scatter(4, link), comm.allgather(4, link), comm.allreduce(4, link)
    costs = stage_costs(profile, cluster, Training.for_trainer("megatron", "bf16", "adamw", 16, 80 * 2**30), cand)
    assert costs.grad_sync.per_byte_s == pytest.approx(rs.per_byte_s) == pytest.approx(ar.per_byte_s / 2, rel=0.02)
    ev = evaluate(costs, [0, len(costs.atoms)], [NONE] * len(costs.atoms))
    params, atoms = sum(a.params for a in costs.atoms), len(costs.atoms)
    backward = sum(a.bwd_s for a in costs.atoms)
    exposed = max(rs(min(DDP_BUCKET_BYTES, params * 2)), rs(params * 2) - backward)  # Megatron hides it: dp_overlap 1
    assert exposed > 0  # the network: more than one backward's worth
    gathers = ag.per_byte_s * 2 * params + ag.fixed_s * atoms
    assert ev.devices[0].sync_s == pytest.approx(exposed + gathers + costs.optimizer_s_per_param * params)
    assert solve_partition(costs, recompute="none").objective_s == pytest.approx(ev.step_time_s, rel=1e-4)
    costs = stage_costs(profile, cluster, Training("bf16", "adamw", 16, 80 * 2**30), cand)
    assert costs.grad_sync.per_byte_s == pytest.approx(ar.per_byte_s)


def test_zero3_gathers_every_micro_batch_overlapped_except_latency():
    profile, costs = _costs(zero=3, gpus_per_node=1)  # 4 nodes of 1: every collective crosses the network
    link = comm.Link(25 * GB, 15e-6, comm.ring_step_s(4, 4))
    ag, rs = comm.allgather(4, link), comm.reduce_scatter(4, link)
    params, atoms = profile.num_params, len(costs.atoms)
    per_mb_bytes_s = (2 * ag.per_byte_s * 2 + rs.per_byte_s * 2) * params  # gather twice, scatter grads
    # FSDP2's copies, read and written: each gather's 1/4 shard in and whole weights out, the
    # reduce-scatter's whole gradients in and 1/4 shard out (16-bit: 2 bytes), at the HBM's rate
    copy_bytes = 2 * 2 * (2 / 4 + 2) + 2 * (2 + 2 / 4)
    per_mb_bytes_s += copy_bytes * params / (make_cluster("a100-80gb", 4, 1).gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY)
    per_mb_latency = (2 * ag.fixed_s + rs.fixed_s) * atoms
    ev = evaluate(costs, [0, atoms], [NONE] * atoms)
    compute = sum(a.fwd_s + a.bwd_s for a in costs.atoms)
    # overlapped: the longer of the two, plus the share of the shorter contention leaves exposed
    t = max(compute, per_mb_bytes_s) + (1 - _hidden(25 * GB)) * min(compute, per_mb_bytes_s) + per_mb_latency
    assert ev.devices[0].time_per_microbatch_s == pytest.approx(t)
    assert per_mb_bytes_s > compute  # over a 200 Gb/s network the gathers outlast the math: exposed
    assert ev.pipeline_s == pytest.approx(4 * t)
    assert math.isclose(ev.step_time_s - ev.pipeline_s, ev.devices[0].sync_s)


def test_groups_across_nodes_use_one_port_per_member():
    """Two A100 nodes of 8 (one 25 GB/s NIC per GPU, NVLink 300 GB/s): a data-parallel group with
    all 8 GPUs of each node runs 8 rings, one per NIC; one GPU per node gets one NIC."""
    from planner.cost.topology import links

    cluster = make_cluster("a100-80gb", 16)
    dp16 = Candidate(tp=1, pp=1, dp=16, micro_batch=1, num_microbatches=1, zero=3, schedule="1f1b")
    tp8 = Candidate(tp=8, pp=1, dp=2, micro_batch=1, num_microbatches=1, zero=3, schedule="1f1b")
    tp4 = Candidate(tp=4, pp=1, dp=4, micro_batch=1, num_microbatches=1, zero=3, schedule="1f1b")
    assert links(cluster, dp16).dp.bandwidth_Bps == pytest.approx(200 * GB)  # min(8 x 25, 300)
    assert links(cluster, tp8).dp.bandwidth_Bps == pytest.approx(25 * GB)
    assert links(cluster, tp4).dp.bandwidth_Bps == pytest.approx(50 * GB)
    assert links(cluster, tp8).tp.bandwidth_Bps == pytest.approx(300 * GB)  # inside the node


def test_matmuls_run_at_the_gpus_measured_ceiling_times_one_share():
    from planner.cost.compute import Work, roofline_s
    from planner.cost.constants import MATMUL_EFFICIENCY
    from planner.hardware import get_gpu

    work = Work(flops=1e15, matmul_bytes=0.0, other_bytes=0.0, ops=1)
    for name, ceiling in (("a100-80gb", 0.859), ("h100-sxm-80gb", 0.801)):
        gpu = get_gpu(name)
        assert gpu.matmul_efficiency == ceiling
        assert roofline_s(work, gpu, "bf16") == pytest.approx(1e15 / (gpu.peak("bf16") * ceiling * MATMUL_EFFICIENCY))


def test_batched_activation_matmuls_have_a_roofline_of_their_own():
    """An unfused attention's batched matmuls (about head-dimension FLOPs per byte) are memory-bound
    on an A100 even where the layer's Linears, far above the balance point, hide the layer's bytes
    in aggregate: they cost their own max(FLOPs / rate, bytes / HBM) on top of the rest's."""
    from planner.cost.compute import Work, roofline_s
    from planner.cost.constants import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
    from planner.hardware import get_gpu

    gpu = get_gpu("a100-80gb")
    rate = gpu.peak("bf16") * gpu.matmul_efficiency * MATMUL_EFFICIENCY
    hbm = gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY
    linears, batched, batched_bytes = 1e13, 1e12, 1e12 / 64  # 64 FLOPs per byte: below the balance
    whole = Work(linears + batched, 1e10 + batched_bytes, 0.0, 1, batched_flops=batched, batched_bytes=batched_bytes)
    assert roofline_s(whole, gpu, "bf16") == pytest.approx(linears / rate + batched_bytes / hbm)
    assert batched_bytes / hbm > batched / rate
    aggregate = Work(linears + batched, 1e10 + batched_bytes, 0.0, 1)  # the layer's sums alone hide them
    assert roofline_s(aggregate, gpu, "bf16") == pytest.approx((linears + batched) / rate)
    assert whole.minus(Work(0.0, 0.0, 0.0, 0, batched_flops=batched, batched_bytes=batched_bytes)).batched_bytes == 0


def test_attention_runs_at_its_kernels_share_and_causal_attention_does_half(gpt_bf16):
    """Fused attention runs at the GPU's `attention_efficiency` of the 16-bit peak (FlashAttention-2:
    34% on an H100, 60% on an A100), the rest at the matmul rate; a GPU file without the figure puts
    attention at the matmul rate. examples/gpt.py calls SDPA with is_causal: the profile counts its
    FLOPs whole (4 s^2 h forward, 2.5 x that backward) and marks them causal; the cost model's
    kernels run half of them and half a diagonal tile per row (ATTENTION_TILE keys), so a causal
    call over s keys saves (1 - 128 / s) / 2 of a full one's time (the rows' fixed work, the same
    in both, cancels): at 256 tokens a quarter. Each row's fixed work: ATTENTION_ROW_KEYS keys'."""
    from dataclasses import replace

    from planner.cost.compute import Work, roofline_s
    from planner.cost.constants import MATMUL_EFFICIENCY
    from planner.cost.stage_costs import atom_table
    from planner.hardware import get_gpu

    h100 = get_gpu("h100-sxm-80gb")
    assert h100.attention_efficiency == 0.34 and get_gpu("a100-80gb").attention_efficiency == 0.60
    rate = h100.matmul_efficiency * MATMUL_EFFICIENCY
    work = Work(flops=3e15, matmul_bytes=0.0, other_bytes=0.0, ops=1, attention_flops=1e15)
    assert roofline_s(work, h100, "bf16") == pytest.approx(2e15 / (989.4e12 * rate) + 1e15 / (989.4e12 * 0.34))
    assert roofline_s(work, replace(h100, attention_efficiency=None), "bf16") == pytest.approx(3e15 / (989.4e12 * rate))

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    assert block.fwd_attention_flops == 4 * 256**2 * 384 and block.bwd_attention_flops == 2.5 * block.fwd_attention_flops
    assert block.fwd_causal_attention_flops == block.fwd_attention_flops
    assert block.bwd_causal_attention_flops == block.bwd_attention_flops
    cluster = make_cluster("h100-sxm-80gb", 1)
    training = Training("bf16", "adamw", 256, 80 * 2**30)
    i = next(k for k, l in enumerate(gpt_bf16.layers) if l.name == "blocks.0")
    # compute-bound (at width 384 the matmuls' bytes bind; without them the FLOPs do)
    bound = replace(gpt_bf16, layers=[replace(l, fwd_matmul_io_bytes=0, bwd_matmul_io_bytes=0) for l in gpt_bf16.layers])
    full = replace(bound, layers=[replace(l, fwd_causal_attention_flops=0, bwd_causal_attention_flops=0) for l in bound.layers])
    causal, whole = (atom_table(p, cluster, training, tp=1, micro_batch=256)[i] for p in (bound, full))
    assert gpt_bf16.seq_len == 256
    attention_s = 256 * block.fwd_attention_flops / (989.4e12 * 0.34)
    saved = (1 - 128 / 256) / 2
    assert whole.fwd_s - causal.fwd_s == pytest.approx(attention_s * saved, rel=1e-6)
    assert whole.bwd_s - causal.bwd_s == pytest.approx(2.5 * attention_s * saved, rel=1e-6)
    # a full call: its rows each run 256 keys and ATTENTION_ROW_KEYS (340) more
    none = replace(full, seq_len=None)  # no sequence length: no rows' fixed work
    plain = atom_table(none, cluster, training, tp=1, micro_batch=256)[i]
    assert whole.fwd_s - plain.fwd_s == pytest.approx(attention_s * 340 / 256, rel=1e-6)
    # Transformer Engine's attention (cuDNN's kernels) at the GPU's figure for them: 58% on an H100
    te = replace(training, attention_kernel="te")
    assert h100.cudnn_attention_efficiency == 0.58
    causal, whole = (atom_table(p, cluster, te, tp=1, micro_batch=256)[i] for p in (bound, full))
    assert whole.fwd_s - causal.fwd_s == pytest.approx(attention_s * 0.34 / 0.58 * saved, rel=1e-6)
    # FlashAttention in Triton (llm-foundry's MPT): FlashAttention-2's time x 1.85, from Dao 2023's
    # 1.3-1.5x forward and 2x backward at FlashAttention-2's 73% / 63% of the peak
    triton = replace(training, attention_kernel="triton")
    causal, whole = (atom_table(p, cluster, triton, tp=1, micro_batch=256)[i] for p in (bound, full))
    slowdown = (1.4 / 0.73 + 2 * 2.5 / 0.63) / (1 / 0.73 + 2.5 / 0.63)
    assert slowdown == pytest.approx(1.846, abs=1e-3)
    # its share read at its paper's benchmark lengths, the rows' fixed work in it: causal saves half
    assert whole.bwd_s - causal.bwd_s == pytest.approx(2.5 * attention_s * slowdown / 2, rel=1e-6)

@pytest.fixture(scope="module")
def gpt_bf16():
    from planner.model_file import load_model_file
    from planner.profile import profile_model
    from tests.conftest import EXAMPLES

    return profile_model(load_model_file(EXAMPLES / "gpt.py"), measure=False, dtype="bf16")


def test_profile_splits_what_tp_shards_without_sequence_parallelism(gpt_bf16):
    """examples/gpt.py's block (SDPA, no dropout), s=256, h=384, bf16: outside the column-wise ->
    row-wise regions it saves four whole s x h tensors (the two norms' outputs, the two residual
    sums): Korthikanti et al.'s 10 sbh less the two dropout masks, plus the norms' fp32 statistics."""
    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    sbh_bytes = 256 * 384 * 2
    whole = block.activation_bytes - block.activation_tp_bytes
    assert 4 * sbh_bytes <= whole <= 4 * sbh_bytes + 2 * 2 * 256 * 4
    assert block.activation_matmul_tp_bytes < block.activation_matmul_bytes  # row-wise outputs are whole
    assert 0 < block.fwd_other_io_tp_bytes < block.fwd_other_io_bytes


def test_sequence_parallelism_splits_the_rest(gpt_bf16):
    """With sequence parallelism every tensor the block saves is split over the tp ranks but the
    input its column-wise Linears share, gathered from the sequence shards: DTensor's TP (this
    runtime, torchtitan) saves that whole, gpt.py's two norm outputs (q, k, v read ln_1's, up
    ln_2's: 2 sbh bytes); Megatron-LM's keeps the shard and gathers it again in backward."""
    from planner.cost.stage_costs import atom_table

    cluster, training = make_cluster("a100-80gb", 2), Training("bf16", "adamw", 8, 80 * 2**30)
    on = atom_table(gpt_bf16, cluster, training, tp=2, micro_batch=256, sequence_parallel=True)
    off = atom_table(gpt_bf16, cluster, training, tp=2, micro_batch=256, sequence_parallel=False)
    megatron = atom_table(gpt_bf16, cluster, replace(training, tp_saves_gathered=False), tp=2, micro_batch=256,
                          sequence_parallel=True)
    i = next(k for k, a in enumerate(on) if gpt_bf16.layers[a.first].name == "blocks.0")
    block = gpt_bf16.layers[on[i].first]
    scale = 256 / gpt_bf16.batch_size
    sbh = 256 * 384 * 2
    assert block.activation_linear_input_bytes - block.activation_linear_input_tp_bytes == 2 * sbh
    assert megatron[i].act_bytes[NONE] == pytest.approx(block.activation_bytes * scale / 2)
    assert on[i].act_bytes[NONE] == pytest.approx((block.activation_bytes / 2 + 2 * sbh / 2) * scale)
    tp_part = block.activation_tp_bytes
    assert off[i].act_bytes[NONE] == pytest.approx((tp_part / 2 + block.activation_bytes - tp_part) * scale)
    # norms and residuals run whole on both ranks (memory-bound at 256 x 256 tokens)
    assert off[i].fwd_s + off[i].bwd_s - off[i].tp_comm_s > on[i].fwd_s + on[i].bwd_s - on[i].tp_comm_s
    assert off[i].params == on[i].params


def test_batch_first_tensors_copy_around_sequence_parallel_collectives(gpt_bf16):
    """DTensor's TP on batch-first tensors (Training.tp_batch_first) gathers and scatters along the
    sequence (dim 1): each reduce-scatter's input and, with more than one sequence a micro-batch,
    each all-gather's output is copied whole (read and written) at a copy's rate. gpt.py's block
    reduce-scatters its two row-wise outputs and all-gathers its two shared inputs, each s x h:
    forward and backward each move 2 x (2 + 2) sbh bytes at 2 sequences, 2 x 2 at one. Megatron's
    sequence-first tensors copy nothing; nor does TP without sequence parallelism."""
    from planner.cost.compute import stream_s
    from planner.cost.stage_costs import atom_table

    cluster, training = make_cluster("a100-80gb", 2), Training("bf16", "adamw", 8, 80 * 2**30)
    i = next(k for k, l in enumerate(gpt_bf16.layers) if l.name == "blocks.0")
    assert gpt_bf16.layers[i].tp.allreduce_bytes == 2 * 256 * 384 * 2  # two s x h tensors, profiled at one sequence
    sbh = 256 * 384 * 2
    for mb, tensors in ((2, 8), (1, 4)):
        batch_first, seq_first = (atom_table(gpt_bf16, cluster, replace(training, tp_batch_first=b), tp=2, micro_batch=mb,
                                             sequence_parallel=sp) for b, sp in ((True, True), (False, True)))
        a, b = (next(x for x in t if x.first == i) for t in (batch_first, seq_first))
        assert a.tp_comm_s - b.tp_comm_s == pytest.approx(2 * stream_s(tensors * mb * sbh, cluster.gpu))
    plain = [next(x for x in atom_table(gpt_bf16, cluster, replace(training, tp_batch_first=b), tp=2, micro_batch=2,
                                        sequence_parallel=False) if x.first == i) for b in (True, False)]
    assert plain[0].tp_comm_s == plain[1].tp_comm_s


def test_selective_recompute_gathers_again_what_its_policy_does_not_keep(gpt_bf16):
    """Selective and alternate recompute rerun the forward TP collectives whose outputs backward
    reads, as far as the trainer's policy does not keep them: this runtime's save-matmuls policy
    reruns all of them (an all-gather and a reduce-scatter per region under SP), torchtitan's
    keeps the reduce-scatters (half), Megatron-LM's attention-core recompute none. Full recompute
    is the same under each."""
    from planner.cost.stage_costs import ALTERNATE, FULL, SELECTIVE, atom_table
    from planner.cost.topology import links

    cluster = make_cluster("a100-80gb", 2)
    base = Training("bf16", "adamw", 8, 80 * 2**30, tp_batch_first=False)  # the collectives alone, no layout copies
    tables = {kind: atom_table(gpt_bf16, cluster, replace(base, recompute_collectives=kind), tp=2, micro_batch=256,
                               sequence_parallel=True) for kind in ("all", "all_gathers", "none")}
    i = next(k for k, a in enumerate(tables["all"]) if gpt_bf16.layers[a.first].name == "blocks.0")
    block = gpt_bf16.layers[tables["all"][i].first]
    lk = links(cluster, Candidate(tp=2, pp=1, dp=1, micro_batch=256, num_microbatches=1, zero=0, schedule="1f1b",
                                  sequence_parallel=True))
    tp_fwd = tp_collectives_s(block, 2, True, lk.tp, 256 / gpt_bf16.batch_size)[0]
    extra = {kind: t[i].extra_s for kind, t in tables.items()}
    for k in (SELECTIVE, ALTERNATE):
        assert extra["all"][k] - extra["none"][k] == pytest.approx(tp_fwd, rel=1e-6)
        assert extra["all_gathers"][k] - extra["none"][k] == pytest.approx(tp_fwd / 2, rel=1e-6)
    assert extra["all"][FULL] == extra["none"][FULL] == extra["all_gathers"][FULL]


def test_a_pipeline_cut_sends_each_tp_rank_its_shard(gpt_bf16):
    """gpt.py under tp=2: what crosses a pipeline cut is half a block's output per rank with
    sequence parallelism, after a block or after the final norm (its sequence shard), so a tp x pp
    plan's sends are that size (the cut after ln_f, counted whole, had made every boundary's send
    twice as large). Without it the tensor is replicated on the TP ranks: torch's pipelining (this
    runtime) sends it whole from each, Megatron-LM and DeepSpeed's engine scatter it
    (Training.p2p_scatter_gather), half per rank."""
    from planner.cost.stage_costs import atom_table
    from planner.cost.topology import links

    cluster, this = make_cluster("a100-80gb", 4), Training("bf16", "adamw", 8, 80 * 2**30)
    scale = 256 / gpt_bf16.batch_size
    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    for trainer in ("this", "megatron", "deepspeed"):
        training = Training.for_trainer(trainer, "bf16", "adamw", 8, 80 * 2**30)
        for sp in (True, False):
            whole = trainer == "this" and not sp
            atoms = atom_table(gpt_bf16, cluster, training, tp=2, micro_batch=256, sequence_parallel=sp)
            norm = next(a for a in atoms if gpt_bf16.layers[a.last].name == "ln_f")
            per_rank = block.output_bytes * scale / (1 if whole else 2)
            assert norm.cut_ok and norm.out_bytes == pytest.approx(per_rank)
            assert max(a.out_bytes for a in atoms if a.cut_ok) == pytest.approx(per_rank)
    cand = Candidate(tp=2, pp=2, dp=1, micro_batch=256, num_microbatches=4, zero=0, schedule="1f1b",
                     sequence_parallel=True)
    costs = stage_costs(gpt_bf16, cluster, this, cand)
    assert costs.p2p_s == pytest.approx(2 * comm.p2p(links(cluster, cand).pp)(block.output_bytes * scale / 2))
    unsplit = stage_costs(gpt_bf16, cluster, this, replace(cand, sequence_parallel=False))
    assert unsplit.p2p_s == pytest.approx(2 * comm.p2p(links(cluster, cand).pp)(block.output_bytes * scale))


def test_an_interleaved_schedule_hides_its_sends_where_the_trainer_overlaps_them(gpt_bf16):
    """Megatron's interleaved schedule runs each chunk's sends beside the next chunk's compute
    (Training.p2p_overlap): a stage's sends are exposed only past the median atom's forward and
    backward; not under 1F1B (sent between the compute there), nor for this runtime's schedules."""
    import statistics

    from planner.cost.stage_costs import AtomTable, _exposed_sends
    from planner.cost.topology import links

    cluster = make_cluster("a100-80gb", 8)
    this = Training("bf16", "adamw", 8, 80 * 2**30)
    megatron = Training.for_trainer("megatron", "bf16", "adamw", 8, 80 * 2**30)
    assert megatron.p2p_overlap and not this.p2p_overlap
    interleaved = Candidate(tp=1, pp=2, dp=1, micro_batch=2, num_microbatches=4, zero=0, schedule="interleaved",
                            virtual_stages=2)
    plain = replace(interleaved, schedule="1f1b", virtual_stages=1)
    sent = stage_costs(gpt_bf16, cluster, this, interleaved)
    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    sends = 2 * comm.p2p(links(cluster, interleaved).pp)(block.output_bytes * 2 / gpt_bf16.batch_size)
    assert sent.p2p_s == pytest.approx(sends)
    assert stage_costs(gpt_bf16, cluster, megatron, plain).p2p_s == pytest.approx(sends)
    hidden = stage_costs(gpt_bf16, cluster, megatron, interleaved)
    chunk = statistics.median(a.fwd_s + a.bwd_s for a in hidden.atoms)
    assert hidden.p2p_s == pytest.approx(max(0.0, sends - chunk))
    # by hand: sends of 3 ms beside atoms of 1, 2 and 4 ms (median 2): 1 ms exposed; of 1 ms: none
    atoms = AtomTable(replace(hidden.atoms[0], fwd_s=t / 3, bwd_s=2 * t / 3) for t in (1e-3, 2e-3, 4e-3))
    assert _exposed_sends(atoms, megatron, interleaved, 3e-3) == pytest.approx(1e-3)
    assert _exposed_sends(atoms, megatron, interleaved, 1e-3) == 0.0
    assert _exposed_sends(atoms, megatron, plain, 3e-3) == 3e-3


def test_tp_collectives_are_one_call_per_linear_group_and_norm_parameter(gpt_bf16):
    """gpt.py's block under tp=2: two row-wise Linears (proj, down), four column-wise ones (q, k,
    v, up) in two gathered groups (attention, MLP). Without SP: an all-reduce per row-wise output
    in forward, per column-wise Linear's input gradient in backward (DTensor's ColwiseParallel
    each on its own), the bytes shared among the calls. With SP a reduce-scatter and an all-gather
    per row-wise output and per group (half an all-reduce's volume apiece), and backward also
    all-reduces each norm parameter's gradient (ln_1, ln_2: weight and bias)."""
    from planner.cost.comm import Link
    from planner.cost.stage_costs import tp_collectives_s

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    assert block.tp_role.gathers == ("attn", "mlp") and block.tp_role.norm_params == 4
    latency, bw, scale = 1e-3, 1e9, 2.0
    link = Link(bw, latency)
    nbytes = block.tp.allreduce_bytes * scale / 2
    ar = latency + nbytes / (bw * LINK_EFFICIENCY)  # 2 (n - 1) / n = 1 at n = 2; log2(2) = 1 latency
    half = latency + nbytes / 2 / (bw * LINK_EFFICIENCY)
    off = tp_collectives_s(block, 2, False, link, scale)
    on = tp_collectives_s(block, 2, True, link, scale)
    quarter = latency + nbytes / 2 / (bw * LINK_EFFICIENCY)  # 4 calls share the backward's bytes
    assert off == pytest.approx((2 * ar, 4 * quarter))
    assert on == pytest.approx((4 * half, 4 * half + 4 * latency))
    # the vocabulary-parallel embedding: its output reduce-scattered to the sequence shards with
    # SP (its gradient all-gathered in backward); where the first block takes the shard
    # (TPRole.shard_at: Hugging Face's models) all-reduced whole, the block's cut gathering the gradient
    from dataclasses import replace

    wte = gpt_bf16.layers[0]
    emb = wte.tp.allreduce_bytes * scale
    rs = latency + emb / 2 / (bw * LINK_EFFICIENCY)
    assert tp_collectives_s(wte, 2, True, link, scale) == pytest.approx((rs, rs))
    cut = replace(wte, tp_role=replace(wte.tp_role, shard_at="blocks.0"))
    assert tp_collectives_s(cut, 2, True, link, scale) == pytest.approx((latency + emb / (bw * LINK_EFFICIENCY), rs))


def test_fp8_runs_the_linear_matmuls_at_the_fp8_peak(gpt_bf16):
    """gpt.py's block (s=256, h=384): its Linears are 2 s 12 h^2 forward FLOPs, twice that backward;
    under --precision fp8 those run at the FP8 peak, attention at bf16's, and each operand's cast
    (2.5 x its bf16 bytes) is memory-bound work. (A 7B model gains: tests/cli/test_plan_cli.py.)"""
    from dataclasses import replace

    from planner.cost.compute import Work, roofline_s
    from planner.cost.constants import MATMUL_EFFICIENCY
    from planner.cost.stage_costs import atom_table
    from planner.hardware import get_gpu

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    assert block.fwd_linear_flops == 2 * 256 * 12 * 384**2 and block.bwd_linear_flops == 2 * block.fwd_linear_flops
    assert 0 < block.fwd_flops - block.fwd_linear_flops  # attention stays 16-bit
    h100 = get_gpu("h100-sxm-80gb")
    rate = h100.matmul_efficiency * MATMUL_EFFICIENCY
    # FP8 matmuls at their own measured ceiling (71% of the FP8 peak against 80% of bf16's), the
    # 16-bit share where the GPU file has none
    assert (h100.matmul_efficiency, h100.fp8_matmul_efficiency) == (0.801, 0.709)
    fp8_rate = 0.709 * MATMUL_EFFICIENCY
    work = Work(flops=3e15, matmul_bytes=0.0, other_bytes=0.0, ops=1, fp8_flops=2e15)
    assert roofline_s(work, h100, "fp8") == pytest.approx(1e15 / (989.4e12 * rate) + 2e15 / (1978.9e12 * fp8_rate))
    no_figure = replace(h100, fp8_matmul_efficiency=None)
    assert roofline_s(work, no_figure, "fp8") == pytest.approx(1e15 / (989.4e12 * rate) + 2e15 / (1978.9e12 * rate))
    cluster = make_cluster("h100-sxm-80gb", 1)
    bf16 = atom_table(gpt_bf16, cluster, Training("bf16", "adamw", 256, 80 * 2**30), tp=1, micro_batch=256)
    fp8 = atom_table(gpt_bf16, cluster, Training("fp8", "adamw", 256, 80 * 2**30), tp=1, micro_batch=256)
    i = next(k for k, a in enumerate(bf16) if gpt_bf16.layers[a.first].name == "blocks.0")
    # at width 384 the casts cost more than the 8-bit matmuls save (torchao's float8 pays off
    # only for large GEMMs); the same bf16 tensors are saved either way
    assert fp8[i].fwd_s > bf16[i].fwd_s and fp8[i].act_bytes == bf16[i].act_bytes


def test_fp8_casts_stream_at_a_copys_rate_and_the_head_stays_16_bit_where_the_trainer_keeps_it(gpt_bf16):
    """A cast reads its operand and writes it again in 8 bits, in order: priced at a copy's share of
    HBM (STREAM_EFFICIENCY), not at the step's memory-bound average (MEMORY_EFFICIENCY). torchtitan
    and Megatron-LM leave the output projection in 16 bits: the head's matmuls at bf16's rate and
    no casts, as the bf16 plan runs it; this runtime converts it (its features allow)."""
    from planner.cost.compute import Work, roofline_s
    from planner.cost.constants import STREAM_EFFICIENCY
    from planner.cost.stage_costs import atom_table
    from planner.hardware import get_gpu

    h100 = get_gpu("h100-sxm-80gb")
    work = Work(flops=0.0, matmul_bytes=0.0, other_bytes=1e9, ops=1, stream_bytes=2e9)
    assert roofline_s(work, h100, "fp8") == pytest.approx(1e9 / (3.35e12 * MEMORY_EFFICIENCY) + 2e9 / (3.35e12 * STREAM_EFFICIENCY))
    assert MEMORY_EFFICIENCY < STREAM_EFFICIENCY < 1
    assert work.scaled(2.0).stream_bytes == 4e9 and work.minus(work).stream_bytes == 0.0
    cluster = make_cluster("h100-sxm-80gb", 1)
    tables = {name: atom_table(gpt_bf16, cluster, training, tp=1, micro_batch=256) for name, training in (
        ("bf16", Training("bf16", "adamw", 256, 80 * 2**30)),
        ("fp8", Training("fp8", "adamw", 256, 80 * 2**30)),
        ("fp8, 16-bit head", Training("fp8", "adamw", 256, 80 * 2**30, fp8_head=False)))}
    head = next(k for k, a in enumerate(tables["bf16"]) if gpt_bf16.layers[a.first].tp_role.kind == "head")
    block = next(k for k, a in enumerate(tables["bf16"]) if gpt_bf16.layers[a.first].name == "blocks.0")
    assert tables["fp8, 16-bit head"][head].fwd_s == pytest.approx(tables["bf16"][head].fwd_s)
    assert tables["fp8, 16-bit head"][head].bwd_s == pytest.approx(tables["bf16"][head].bwd_s)
    assert tables["fp8"][head].fwd_s != pytest.approx(tables["bf16"][head].fwd_s)
    assert tables["fp8, 16-bit head"][block].fwd_s == pytest.approx(tables["fp8"][block].fwd_s)
    from planner.cost.setup import TRAINERS
    assert TRAINERS["torchtitan"]["fp8_head"] is False and TRAINERS["megatron"]["fp8_head"] is False


def test_megatron_lms_unfused_cross_entropy_moves_52_bytes_a_logit(gpt_bf16):
    """Megatron-LM's vocabulary-parallel cross-entropy without its fusion: 38 bytes a logit forward
    (the fp32 upcast, max, shift, exp, sum and division, each its own pass) and 14 backward, in
    place of the loss ops the profile traced; the head's matmuls, and every other layer, as before.
    A model file's own loss is measured as written and keeps its traced traffic."""
    from dataclasses import replace as dc_replace

    from planner.cost.compute import memory_bound_s
    from planner.cost.constants import VOCAB_PARALLEL_CE_BYTES
    from planner.cost.stage_costs import atom_table

    assert VOCAB_PARALLEL_CE_BYTES == (38.0, 14.0)
    cluster = make_cluster("a100-80gb", 1)
    plain, vocab = (Training("bf16", "adamw", 8, 80 * 2**30, fused_kernels=True, loss_bytes_per_logit=b)
                    for b in (None, VOCAB_PARALLEL_CE_BYTES))
    head_index = len(gpt_bf16.layers) - 1
    head = gpt_bf16.layers[head_index]
    logits = gpt_bf16.output_bytes / 2
    mb = 2
    scale = mb / gpt_bf16.batch_size
    tables = [atom_table(gpt_bf16, cluster, t, tp=1, micro_batch=mb) for t in (plain, vocab)]
    a, b = (next(x for x in table if x.last == head_index) for table in tables)
    traced_fwd, traced_bwd = head.fwd_fused_io_bytes, head.bwd_fused_io_bytes
    assert b.fwd_s - a.fwd_s == pytest.approx(memory_bound_s((38 * logits - traced_fwd) * scale, cluster.gpu), rel=1e-6)
    assert b.bwd_s - a.bwd_s == pytest.approx(memory_bound_s((14 * logits - traced_bwd) * scale, cluster.gpu), rel=1e-6)
    for x, y in zip(*tables):
        if x.last != head_index:
            assert (x.fwd_s, x.bwd_s) == (y.fwd_s, y.bwd_s)
    own = dc_replace(gpt_bf16, own_loss=True)
    c, d = (next(x for x in atom_table(own, cluster, t, tp=1, micro_batch=mb) if x.last == head_index) for t in (plain, vocab))
    assert (c.fwd_s, c.bwd_s) == (d.fwd_s, d.bwd_s)


def test_fp8_casts_the_weights_once_per_micro_batch_whatever_its_size(gpt_bf16):
    """gpt.py's block: its Linears' weights are 12 h^2 bf16 values (and their biases, operands of
    addmm in forward); backward's input-gradient matmuls read the weights again. A cast is 2.5 x
    the operand's bf16 bytes; the activations' casts double with the micro-batch, the weights' do
    not, and tensor parallelism splits both."""
    from planner.cost.stage_costs import fp8_cast_bytes

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    weights = 2 * 12 * 384**2
    # biases: q, k, v, proj (h each), up (4h), down (h)
    assert block.bwd_linear_weight_bytes == weights and block.fwd_linear_weight_bytes == weights + 2 * 9 * 384
    acts = block.fwd_linear_operand_bytes - block.fwd_linear_weight_bytes, block.bwd_linear_operand_bytes - weights
    for scale, shard in ((1.0, 1), (2.0, 1), (2.0, 2)):
        fwd, bwd = fp8_cast_bytes(block, scale, shard)
        assert fwd == pytest.approx(2.5 * (acts[0] * scale + block.fwd_linear_weight_bytes) / shard)
        assert bwd == pytest.approx(2.5 * (acts[1] * scale + weights) / shard)


def test_compiled_torchao_casts_run_once_per_tensor(gpt_bf16):
    """gpt.py's block (s=256, h=384): its Linears read 9h values per token (q, k and v the same
    ln_1 output, proj the attention's, up ln_2's, down GELU's 4h), 7h distinct; their outputs'
    gradients are 9h. Eager ("op"): forward each input at each use, backward each gradient twice
    and each input and weight again. Each Linear compiled ("linear", this runtime): forward its
    input and weight, backward each gradient once (the rest merged with the forward's casts). A
    compiled block ("block"): the 3 reads of ln_1's output cast once too."""
    from planner.cost.stage_costs import fp8_cast_bytes

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    h, s = 384, 256
    row = 2 * h * s  # bf16 bytes of one h-wide value per token
    wf, wb = block.fwd_linear_weight_bytes, block.bwd_linear_weight_bytes
    for scale, shard in ((1.0, 1), (2.0, 2)):
        assert fp8_cast_bytes(block, scale, shard) == pytest.approx(
            (2.5 * (9 * row * scale + wf) / shard, 2.5 * (27 * row * scale + wb) / shard))
        assert fp8_cast_bytes(block, scale, shard, scope="linear") == pytest.approx(
            (2.5 * (9 * row * scale + wf) / shard, 2.5 * 9 * row * scale / shard))
        assert fp8_cast_bytes(block, scale, shard, scope="block") == pytest.approx(
            (2.5 * (7 * row * scale + wf) / shard, 2.5 * 9 * row * scale / shard))
    assert Training.for_trainer("this", "fp8", "adamw", 8, 80 * 2**30).fp8_cast_scope == "linear"
    assert Training.for_trainer("torchtitan", "fp8", "adamw", 8, 80 * 2**30).fp8_cast_scope == "op"


def test_transformer_engine_fp8_casts_each_input_and_output_gradient_once(gpt_bf16):
    """Transformer Engine's recipe on gpt.py's block (s=256, h=384): the Linears' inputs are 9 h
    per token (q, k, v and up read the norms' outputs, proj the attention's, down the MLP's 4h)
    and so are their outputs' gradients (q, k, v, proj, down h each, up 4h). Forward casts each
    input once (2.5 passes), backward each output gradient once with its transpose (3 passes);
    the weights are cast once per step, after the optimizer: 6 more bytes per parameter."""
    from planner.cost.stage_costs import fp8_cast_bytes

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    nine_h = 9 * 384 * 256 * 2
    for scale, shard in ((1.0, 1), (2.0, 2)):
        fwd, bwd = fp8_cast_bytes(block, scale, shard, "te")
        assert fwd == pytest.approx(2.5 * nine_h * scale / shard) and bwd == pytest.approx(3.0 * nine_h * scale / shard)
    assert sum(fp8_cast_bytes(block, 1.0, 1, "te")) < 0.5 * sum(fp8_cast_bytes(block, 1.0, 1))
    te, torchao = (Training("fp8", "adamw", 8, 80 * 2**30, fp8_recipe=r) for r in ("te", "torchao"))
    assert te.optimizer_traffic_per_param() == torchao.optimizer_traffic_per_param() + 6


def test_transformer_engine_keeps_the_inputs_only_linears_save_in_fp8(gpt_bf16):
    """gpt.py's block (s=256, h=384): autograd keeps, for its Linears alone, ln_1's output (q, k and
    v read it: 3 matmuls), ln_2's (up) and GELU's (down, 4h): 6h bf16 values per token, 12h bytes;
    the attention's output, which proj reads, SDPA keeps too (its 16-bit copy stays). Transformer
    Engine's Linears cache their input quantized instead, one copy each: 3h + h + 4h values, 8h
    bytes in FP8 (4h less per token), 4.5h in NVFP4 (half a byte and a scale per 16). torchao's
    Float8Linear keeps the 16-bit input: no change."""
    from planner.cost.stage_costs import atom_table

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    h, s = 384, 256
    assert (block.activation_linear_input_bytes, block.activation_linear_input_copies) == (6 * h * s * 2, 8 * h * s * 2)
    cluster = make_cluster("b200", 1)
    act = {}
    for precision, recipe in (("bf16", "torchao"), ("fp8", "torchao"), ("fp8", "te"), ("fp4", "te")):
        table = atom_table(gpt_bf16, cluster, Training(precision, "adamw", 8, 80 * 2**30, fp8_recipe=recipe), tp=1, micro_batch=2)
        act[precision, recipe] = next(a for a in table if gpt_bf16.layers[a.first].name == "blocks.0").act_bytes[NONE]
    assert act["fp8", "torchao"] == act["bf16", "torchao"]
    assert act["bf16", "torchao"] - act["fp8", "te"] == pytest.approx(2 * 4 * h * s)
    assert act["bf16", "torchao"] - act["fp4", "te"] == pytest.approx(2 * (12 - 4.5) * h * s)


def test_nvfp4_runs_the_linear_matmuls_at_the_fp4_peak_and_transforms_the_weight_gradient_operands(gpt_bf16):
    """--precision fp4 (NVFP4, Transformer Engine's recipe): the Linear matmuls at the GPU's FP4 peak
    (at the share its bf16 and FP8 ceilings give: GPUSpec.matmul_share), the rest at bf16's; its casts are TE's
    FP8 ones plus a Hadamard transform (read and written) of both weight-gradient operands; its
    weights cast once a step to half a byte and its transpose."""
    from planner.cost.compute import Work, roofline_s
    from planner.cost.constants import MATMUL_EFFICIENCY
    from planner.cost.stage_costs import NVFP4_HADAMARD_PASSES, fp8_cast_bytes
    from planner.errors import BadInput
    from planner.hardware import get_gpu

    gb300 = get_gpu("gb300")
    rate = gb300.matmul_efficiency * MATMUL_EFFICIENCY
    work = Work(flops=3e15, matmul_bytes=0.0, other_bytes=0.0, ops=1, fp8_flops=2e15)
    fp4 = 2e15 / (15000e12 * gb300.matmul_share("fp4") * MATMUL_EFFICIENCY)
    assert roofline_s(work, gb300, "fp4") == pytest.approx(1e15 / (2500e12 * rate) + fp4)
    assert roofline_s(work, gb300, "fp4") < roofline_s(work, gb300, "fp8")
    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    nine_h = 9 * 384 * 256 * 2
    fwd, bwd = fp8_cast_bytes(block, 1.0, 1, "te", fp4=True)
    assert NVFP4_HADAMARD_PASSES == 2.0
    assert fwd == pytest.approx((2.5 + 2.0) * nine_h) and bwd == pytest.approx((3.0 + 2.0) * nine_h)
    nvfp4, fp8 = (Training(p, "adamw", 8, 80 * 2**30, fp8_recipe="te") for p in ("fp4", "fp8"))
    assert nvfp4.optimizer_traffic_per_param() == fp8.optimizer_traffic_per_param() - 1
    with pytest.raises(BadInput, match="no fp4 peak"):
        roofline_s(work, get_gpu("h100-sxm-80gb"), "fp4")


def test_the_fp4_ceiling_follows_from_the_bf16_and_fp8_ones():
    """1 / ceiling = a / peak + c: a matmul's time per FLOP runs at the tensor cores' rate but for a
    part that does not speed up with the precision. Hand case: bf16 1,000 of 2,000, FP8 1,600 of
    4,000: 1/1000 - 1/1600 = a (1/2000 - 1/4000), a = 1.5, c = 1/1000 - 1.5/2000 = 1/4000; FP4 at
    8,000: 1 / (1.5/8000 + 1/4000) = 2,285.7, 28.6% of its peak. FP8 at bf16's share: no fixed
    part, FP4 at that share too. The B200's MAMF figures give the NVFP4 ceiling measured on it (6,624)."""
    from planner.gpu_spec import low_precision_share
    from planner.hardware import get_gpu

    assert low_precision_share(((2000, 0.5), (4000, 0.4)), 8000) == pytest.approx(2285.714 / 8000, rel=1e-5)
    assert low_precision_share(((2000, 0.7), (4000, 0.7)), 8000) == pytest.approx(0.7)
    b200 = low_precision_share(((2250, 1745 / 2250), (4500, 3432.5 / 4500)), 9000)
    assert b200 * 9000 == pytest.approx(6624, rel=0.005)
    gb300 = get_gpu("gb300")  # its FP8 share 4 points under its bf16 one: NVFP4 at about 62% of its peak
    assert gb300.matmul_share("fp4") == pytest.approx(0.616, abs=0.002) and gb300.matmul_share("fp8") == 0.745
    assert get_gpu("h100-sxm-80gb").matmul_share("fp4") == get_gpu("h100-sxm-80gb").matmul_share("fp8")


def _pipelined(zero: int, m: int = 4):
    profile = synthetic_profile(n_blocks=4, h=1024, s=512, heads=16, vocab=32768)
    cluster = make_cluster("a100-80gb", 8, 1)  # 8 nodes of 1: every collective crosses the network
    training = Training("bf16", "adamw", 4 * m, 80 * 2**30)
    cand = Candidate(tp=1, pp=2, dp=4, micro_batch=1, num_microbatches=m, zero=zero, schedule="1f1b")
    return stage_costs(profile, cluster, training, cand)


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_under_a_pipeline_keeps_the_stage_whole_and_syncs_once(zero):
    """PipelineStage runs FSDP2's backwards without gradient sync and without resharding but on the
    last micro-batch: the 16-bit weights (2 B) and fp32-accumulated gradients (4 B) of a stage are
    whole, only the optimizer state (12 B) is sharded over dp = 4; the weights' all-gather and the
    gradients' reduce-scatter happen once a step, overlapped with the last backward; ZeRO-3 also
    gathers again for each micro-batch's backward (what its forward freed)."""
    costs = _pipelined(zero)
    assert costs.pipelined_fsdp
    assert costs.state_bytes_per_param() == pytest.approx((2, 4, 3))
    assert costs.zero3_gather_bytes == 0
    link = comm.Link(25 * GB, 15e-6, comm.ring_step_s(4, 4))
    ag, rs = comm.allgather(4, link), comm.reduce_scatter(4, link)
    # FSDP2's copies per parameter, read and written: a gather's shard in and whole weights out,
    # the reduce-scatter's whole gradients in and shard out (2 B each)
    copy = 2 * (2 / 4 + 2) / (make_cluster("a100-80gb", 8, 1).gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY)
    # weights and gradients: 2 B each
    assert costs.grad_sync(2e9) == pytest.approx(ag(2e9) + rs(2e9) + 2 * copy * 2e9 / 2)
    assert costs.after_step_param_s == 0 and costs.after_step_atom_s == 0
    if zero == 3:
        assert costs.mb_comm_param_s == pytest.approx(ag.per_byte_s * 2 + copy) and costs.mb_comm_atom_s == pytest.approx(ag.fixed_s)
    else:
        assert costs.mb_comm_param_s == 0 and costs.mb_comm_atom_s == 0
    # without a pipeline the same ZeRO stage shards gradients (and ZeRO-3 weights) and syncs every micro-batch
    flat = _costs(zero)[1]
    assert not flat.pipelined_fsdp and flat.mb_comm_param_s > 0


def test_alternate_recompute_sits_between_selective_and_full(gpt_bf16):
    """gpt.py's block runs its Linears q, k, v, proj, fc, fc2 in that order: the alternate policy
    keeps q, v and fc's outputs of the selective set, and recomputes k, proj and fc2 (their forward
    FLOPs, 2 s h (h + h + 4h) at s=256, h=384), besides what selective recomputes."""
    from planner.cost.stage_costs import ALTERNATE, FULL, SELECTIVE, atom_table

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    assert block.fwd_alternate_flops == 2 * 256 * 384 * (384 + 384 + 4 * 384)
    dropped = block.activation_matmul_bytes - block.activation_alternate_bytes
    assert dropped == 2 * 256 * (384 + 384 + 384)  # k, proj and fc2's bf16 outputs
    cluster, training = make_cluster("a100-80gb", 1), Training("bf16", "adamw", 8, 80 * 2**30)
    atoms = atom_table(gpt_bf16, cluster, training, tp=1, micro_batch=gpt_bf16.batch_size)
    a = next(x for x in atoms if gpt_bf16.layers[x.first].name == "blocks.0")
    assert a.act_bytes[NONE] > a.act_bytes[SELECTIVE] > a.act_bytes[ALTERNATE] > a.act_bytes[FULL]
    assert a.extra_s[SELECTIVE] < a.extra_s[ALTERNATE] < a.extra_s[FULL]
    assert a.act_bytes[SELECTIVE] - a.act_bytes[ALTERNATE] == pytest.approx(dropped)


def test_hsdp_with_tp_filling_a_node_shards_over_one_rank_and_copies_nothing():
    """tp 8 fills each 8-GPU node, so HSDP's shard groups are one rank: no all-gather, no
    reduce-scatter and none of FSDP2's copies around them; only the replicas' all-reduce across
    the 2 nodes (bf16 gradients, 2 B)."""
    profile = synthetic_profile(n_blocks=4, h=1024, s=512, heads=16, vocab=32768)
    cluster = make_cluster("a100-80gb", 16)
    training = Training("bf16", "adamw", 8, 80 * 2**30)
    cand = Candidate(tp=8, pp=1, dp=2, micro_batch=1, num_microbatches=4, zero=3, schedule="1f1b", dp_replicate=2)
    costs = stage_costs(profile, cluster, training, cand)
    assert cand.dp_shard == 1
    assert costs.mb_comm_param_s == pytest.approx(comm.allreduce(2, costs.links.dp_replicate).per_byte_s * 2)


def test_hsdp_shards_inside_a_node_and_all_reduces_the_shards_across():
    """16 A100s in 2 nodes, ZeRO-3 over dp = 16 as HSDP 2 x 8: state sharded over the 8 ranks of a
    node (bf16 + AdamW: 16 / 8 B per parameter); each micro-batch gathers twice and reduce-scatters
    over NVLink (an 8-rank ring), then all-reduces its 1/8 of the gradients with the other node
    (2 ranks, one 25 GB/s NIC each)."""
    profile = synthetic_profile(n_blocks=4, h=1024, s=512, heads=16, vocab=32768)
    cluster = make_cluster("a100-80gb", 16)
    training = Training("bf16", "adamw", 64, 80 * 2**30)
    cand = Candidate(tp=1, pp=1, dp=16, micro_batch=1, num_microbatches=4, zero=3, schedule="1f1b", dp_replicate=2)
    costs = stage_costs(profile, cluster, training, cand)
    assert cand.dp_shard == 8 and costs.state_bytes_per_param() == pytest.approx((2 / 8, 2 / 8, 12 / 8))
    inside = comm.Link(300 * GB, 8e-6, comm.ring_step_s(8, 1))
    across = comm.Link(25 * GB, 15e-6, comm.ring_step_s(2, 2))
    ag, rs, ar = comm.allgather(8, inside), comm.reduce_scatter(8, inside), comm.allreduce(2, across)
    # and FSDP2's copies (2 B weights and gradients, read and written; test_zero3_gathers_every_micro_batch...)
    copies = (2 * 2 * (2 / 8 + 2) + 2 * (2 + 2 / 8)) / (cluster.gpu.hbm_bandwidth_Bps * MEMORY_EFFICIENCY)
    assert costs.mb_comm_param_s == pytest.approx(2 * ag.per_byte_s * 2 + (rs.per_byte_s + ar.per_byte_s / 8) * 2 + copies)
    assert costs.mb_comm_atom_s == pytest.approx(2 * ag.fixed_s + rs.fixed_s + ar.fixed_s)
    # what the traffic takes from compute beside it: each link's rate over HBM's, weighted by the
    # seconds spent on it (the network's all-reduce barely contends; the NVLink ring does)
    hbm = cluster.gpu.hbm_bandwidth_Bps
    inner, outer = 2 * ag.per_byte_s * 2 + rs.per_byte_s * 2, ar.per_byte_s / 8 * 2
    assert costs.dp_load == pytest.approx((inner * 300 * GB / hbm + outer * 25 * GB / hbm) / (inner + outer))
    assert 25 * GB / hbm < costs.dp_load < 300 * GB / hbm
    # plain FSDP over all 16 moves every byte over the network (8 rings, one per NIC: 200 GB/s)
    flat = stage_costs(profile, cluster, training, replace(cand, dp_replicate=1))
    assert flat.state_bytes_per_param() == pytest.approx((2 / 16, 2 / 16, 12 / 16))
    assert costs.mb_comm_param_s < flat.mb_comm_param_s


def test_tp_overlap_hides_the_collectives_behind_the_linear_gemms(gpt_bf16):
    """--tp-overlap (Megatron-LM's --tp-comm-overlap, torchtitan's async TP): per phase, a block's
    TP collectives cost what outlasts its Linear GEMMs, and at least one chunk of tp."""
    from planner.cost.stage_costs import atom_table

    cluster, training = make_cluster("a100-80gb", 2), Training("bf16", "adamw", 8, 80 * 2**30)
    plain = atom_table(gpt_bf16, cluster, training, tp=2, micro_batch=256, sequence_parallel=True)
    over = atom_table(gpt_bf16, cluster, training, tp=2, micro_batch=256, sequence_parallel=True, tp_overlap=True)
    i = next(k for k, a in enumerate(plain) if gpt_bf16.layers[a.first].name == "blocks.0")
    block, a, b = gpt_bf16.layers[plain[i].first], plain[i], over[i]
    per_phase = a.tp_comm_s / 2  # one all-reduce's worth forward, one backward
    gemm_fwd = (a.fwd_s - per_phase) * block.fwd_linear_flops / block.fwd_flops
    gemm_bwd = (a.bwd_s - per_phase) * block.bwd_linear_flops / block.bwd_flops
    expect = max(per_phase / 2, per_phase - gemm_fwd) + max(per_phase / 2, per_phase - gemm_bwd)
    assert b.tp_comm_s == pytest.approx(expect) and b.tp_comm_s < a.tp_comm_s
    assert b.fwd_s + b.bwd_s - b.tp_comm_s == pytest.approx(a.fwd_s + a.bwd_s - a.tp_comm_s)  # same math
    # torchtitan's async TP hides its share of what the GEMMs cover (constants.ASYNC_TP_OVERLAP):
    # share s leaves max(chunk, comm - s min(gemm, comm)) exposed per phase
    titan = Training.for_trainer("torchtitan", "bf16", "adamw", 8, 80 * 2**30)
    assert titan.tp_overlap_share == ASYNC_TP_OVERLAP < 1 == training.tp_overlap_share
    c = atom_table(gpt_bf16, cluster, titan, tp=2, micro_batch=256, sequence_parallel=True, tp_overlap=True)[i]
    share = ASYNC_TP_OVERLAP
    expect = sum(max(per_phase / 2, per_phase - share * min(gemm, per_phase)) for gemm in (gemm_fwd, gemm_bwd))
    assert c.tp_comm_s == pytest.approx(expect) and b.tp_comm_s < c.tp_comm_s < a.tp_comm_s


def test_dtensor_host_time_shows_beside_gpu_kernels_only_where_it_outlasts_them(gpt_bf16):
    """A GPU runs its kernels while the host issues the next: a TP layer's phase takes the longer
    of the two. gpt.py's block has six sharded Linears (q, k, v, proj, up, down)."""
    from planner.cost.stage_costs import atom_table
    from planner.hardware import get_gpu

    gpu, training = get_gpu("a100-80gb"), Training("bf16", "adamw", 8, 80 * 2**30)

    def block(**host) -> object:
        cluster = make_cluster(replace(gpu, **host), 2)
        table = atom_table(gpt_bf16, cluster, training, tp=2, micro_batch=64, sequence_parallel=True)
        return next(a for a in table if gpt_bf16.layers[a.first].name == "blocks.0")

    base, tiny = block(), block(tp_forward_overhead_s=1e-9, tp_backward_overhead_s=1e-9)
    assert (tiny.fwd_s, tiny.bwd_s) == (base.fwd_s, base.bwd_s)  # hidden behind the kernels
    slow = block(tp_forward_overhead_s=1e-2, tp_backward_overhead_s=2e-2)
    slower = block(tp_forward_overhead_s=2e-2, tp_backward_overhead_s=4e-2)
    assert slow.fwd_s > base.fwd_s and slow.bwd_s > base.bwd_s  # host-bound: 60 ms forward against a millisecond
    assert slower.fwd_s - slow.fwd_s == pytest.approx(6 * 1e-2) and slower.bwd_s - slow.bwd_s == pytest.approx(6 * 2e-2)


def test_full_recompute_reruns_the_forward_but_its_tail(gpt_bf16):
    """torch's non-reentrant checkpoint (this runtime's, torchtitan's) does not rerun a block's last
    matmul nor a checkpointed head's; a reentrant one (Megatron-LM's: recompute_whole_forward)
    reruns the whole forward."""
    from planner.cost.compute import Work, roofline_s
    from planner.cost.stage_costs import FULL, atom_table, attention_run_flops

    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    assert block.fwd_tail_flops == 2 * 256 * (4 * 384) * 384 and block.fwd_tail_rowwise_linears == 1  # the MLP's down
    cluster = make_cluster("a100-80gb", 1)

    def atoms(whole: bool) -> dict:
        training = Training("bf16", "adamw", 8, 80 * 2**30, recompute_whole_forward=whole)
        return {gpt_bf16.layers[a.first].name: a for a in atom_table(gpt_bf16, cluster, training, tp=1, micro_batch=64)}

    whole, stop = atoms(True), atoms(False)
    assert whole["blocks.0"].extra_s[FULL] == whole["blocks.0"].fwd_s and whole["lm_head"].extra_s[FULL] == whole["lm_head"].fwd_s
    assert stop["lm_head"].extra_s[FULL] == 0.0  # its matmul saves its inputs before it runs: nothing to rerun

    def work(flops, matmul, other, ops, attention, causal):  # attention as its kernels run it (about half when causal)
        run = attention_run_flops(attention, causal, gpt_bf16.seq_len)
        return Work((flops - attention + run) * 64, matmul * 64, other * 64, ops, 0.0, run * 64)

    b = block
    fwd = work(b.fwd_flops, b.fwd_matmul_io_bytes, b.fwd_other_io_bytes, b.fwd_ops, b.fwd_attention_flops, b.fwd_causal_attention_flops)
    tail = work(b.fwd_tail_flops, b.fwd_tail_matmul_io_bytes, b.fwd_tail_other_io_bytes, b.fwd_tail_ops,
                b.fwd_tail_attention_flops, b.fwd_tail_causal_attention_flops)
    share = roofline_s(fwd.minus(tail), cluster.gpu, "bf16") / roofline_s(fwd, cluster.gpu, "bf16")
    assert 0.6 < share < 0.8  # the down projection is 4/12 of the block's Linear FLOPs
    assert stop["blocks.0"].extra_s[FULL] == pytest.approx(stop["blocks.0"].fwd_s * share)


def test_loss_parallel_adds_its_measured_time_per_logit_element(gpt_bf16):
    """A head TP splits over the vocabulary runs the loss as torch's loss_parallel: plan calibrate's
    seconds per logit element (beyond the fused cross-entropy the profile timed) times the logits
    of one micro-batch on one rank (tokens x vocabulary / tp), on the head only, with tp > 1 only."""
    from planner.cost.stage_costs import atom_table

    cluster = make_cluster("a100-80gb", 2)
    measured = make_cluster(replace(cluster.gpu, loss_parallel_steps=((2, "forward", 3e-9), (2, "backward", -1e-9))), 2)
    training = Training("bf16", "adamw", 8, 80 * 2**30)

    def atoms(c, tp):
        return {gpt_bf16.layers[a.first].name: a for a in atom_table(gpt_bf16, c, training, tp=tp, micro_batch=4)}

    head = gpt_bf16.layers[-1]
    logits = 4 * 256 * 8192 / 2  # micro-batch x sequence x vocabulary, over tp = 2
    plain, split = atoms(cluster, 2), atoms(measured, 2)
    assert split["lm_head"].fwd_s - plain["lm_head"].fwd_s == pytest.approx(3e-9 * logits)
    assert split["lm_head"].bwd_s - plain["lm_head"].bwd_s == pytest.approx(-1e-9 * logits)
    assert head.name == "lm_head" and split["blocks.0"].fwd_s == plain["blocks.0"].fwd_s
    assert atoms(measured, 1)["lm_head"].fwd_s == atoms(cluster, 1)["lm_head"].fwd_s  # no TP, no split loss


def test_fused_kernels_cost_the_fused_traffic():
    """A trainer that fuses its memory-bound ops (Training.fused_kernels) pays the profile's fused
    bytes at HBM speed instead of the op-by-op ones, and keeps for backward what its kernels save
    (activation_fused_bytes), not what eager PyTorch does; nothing else of the layer changes."""
    from planner.cost.compute import memory_bound_s
    from planner.cost.stage_costs import atom_table
    from planner.hardware import get_gpu
    from planner.model_file import load_model_file
    from planner.profile import profile_model
    from tests.conftest import EXAMPLES

    profile = profile_model(load_model_file(EXAMPLES / "llama.py"), measure=False, dtype="bf16")
    cluster = make_cluster("h100-sxm-80gb", 1)
    eager = Training("bf16", "adamw", 256, 80 * 2**30)
    fused = replace(eager, fused_kernels=True)
    i, a = next((k, a) for k, a in enumerate(atom_table(profile, cluster, eager, tp=1, micro_batch=256))
                if profile.layers[a.first].name == "layers.1")
    b = atom_table(profile, cluster, fused, tp=1, micro_batch=256)[i]
    block = profile.layers[a.first]
    scale = 256 / profile.batch_size
    gpu = get_gpu("h100-sxm-80gb")
    saved_fwd = memory_bound_s((block.fwd_other_io_bytes - block.fwd_fused_io_bytes) * scale, gpu)
    saved_bwd = memory_bound_s((block.bwd_other_io_bytes - block.bwd_fused_io_bytes) * scale, gpu)
    assert a.fwd_s - b.fwd_s == pytest.approx(saved_fwd, rel=1e-6)
    assert a.bwd_s - b.bwd_s == pytest.approx(saved_bwd, rel=1e-6)
    assert a.act_bytes[NONE] - b.act_bytes[NONE] == pytest.approx((block.activation_bytes - block.activation_fused_bytes) * scale)
    assert block.activation_fused_bytes < block.activation_bytes
    assert all(y <= x for x, y in zip(a.act_bytes, b.act_bytes)) and a.params == b.params


def test_attentions_rows_fixed_work_reproduces_the_h200_measurement():
    """ATTENTION_ROW_KEYS and ATTENTION_TILE with the catalogue's H200 plateaus (FlashAttention-2
    34%, cuDNN 58%) give every measured point of bench/measured/h200_kernels_2026-12-04.json from
    2K to 32K tokens, causal or not, within 5% (the 128K points ran at a clock the GPU's power limit
    lowered: left out)."""
    import json

    from planner.cost.stage_costs import attention_run_flops
    from planner.hardware import get_gpu
    from tests.conftest import ROOT

    h200 = get_gpu("h200")
    plateau = {"flash": h200.attention_efficiency, "cudnn": h200.cudnn_attention_efficiency}
    points = [r for r in json.loads((ROOT / "bench/measured/h200_kernels_2026-12-04.json").read_text())["results"]
              if r["kind"] == "attention" and r["backend"] in plateau and r["seq"] <= 32768]
    assert len(points) == 12
    for r in points:
        counted = 1.0  # the share is measured against the FLOPs counted whole (causal: half)
        run = attention_run_flops(counted, counted if r["causal"] else 0.0, r["seq"]) / (0.5 if r["causal"] else 1.0)
        assert plateau[r["backend"]] / run == pytest.approx(r["of_peak"], rel=0.05), r


def test_torchs_sdpa_runs_cudnns_kernels_from_torch_2_11_on_hopper_and_the_b200(monkeypatch):
    """torch's SDPA puts cuDNN's attention first on compute capability 9.0 and 10.0 from torch 2.11
    (constants.SDPA_CUDNN_FROM_TORCH): "sdpa" attention there at cuDNN's share (H100: 58%, not
    FlashAttention-2's 34%); not on Blackwell Ultra (10.3), an A100 or a GPU without the figure. A
    plan takes the installed torch's (plan run runs it) and says so."""
    from planner import planning
    from planner.hardware import get_gpu
    from planner.model_file import load_model_file
    from planner.planning import PlanRequest, make_plan
    from tests.conftest import EXAMPLES

    shares = {name: (get_gpu(name).attention_share("sdpa"), get_gpu(name).attention_share("sdpa", True))
              for name in ("h100-sxm-80gb", "h200", "b200", "b300", "a100-80gb")}
    assert shares == {"h100-sxm-80gb": (0.34, 0.58), "h200": (0.34, 0.58), "b200": (0.35, 0.50), "b300": (0.35, 0.35),
                      "a100-80gb": (0.60, 0.60)}
    handle = load_model_file(EXAMPLES / "gpt_1b.py")  # compute-bound at its width (2048)
    request = PlanRequest(gpus=8, gpu="h100-sxm-80gb", global_batch=64)
    plans = {}
    for release in ((2, 10), (2, 11)):
        monkeypatch.setattr(planning, "torch_release", lambda release=release: release)
        plans[release] = make_plan(handle, request)
    old, new = plans[(2, 10)], plans[(2, 11)]
    assert any("fused attention 34% of peak" in a for a in old.assumptions)
    assert any("fused attention 58% of peak" in a and "torch 2.11's SDPA runs cuDNN's kernels" in a for a in new.assumptions)
    assert new.predicted.step_time_s < old.predicted.step_time_s


def test_a_stack_of_identical_blocks_is_costed_once(gpt_bf16):
    """The blocks of a transformer differ only in where they are and what they are called (their
    dropout modules' names among it, which TP shards by name): one set of costs serves them all
    (the search builds an atom table for each TP degree and micro-batch; a 96-block GPT-3's took
    seconds when each block was costed alone)."""
    from planner.cost.stage_costs import _layer_figures

    layers = [replace(l, tp_role=replace(l.tp_role, shard_dropout=(f"{l.name}.attn.dropout",)))
              if l.name.startswith("blocks.") else l for l in gpt_bf16.layers]
    named = replace(gpt_bf16, layers=layers)
    figures = _layer_figures(named)
    blocks = [l.index for l in layers if l.name.startswith("blocks.")]
    assert len(blocks) > 1 and len({figures[i] for i in blocks}) == 1
    assert len(set(figures)) < len(figures)


def test_without_master_weights_the_optimizer_state_is_in_the_parameters_dtype():
    """Mixed precision keeps an fp32 master copy beside Adam's fp32 momentum and variance (12 bytes
    a parameter, ZeRO's K); a trainer that steps its bf16 parameters in place (NeMo AutoModel)
    keeps Adam's two moments in bf16 (4), SGD's momentum (2); fp32 training is unchanged."""
    def per_param(trainer, precision="bf16", optimizer="adamw"):
        return Training.for_trainer(trainer, precision, optimizer, 8, 2**30).bytes_per_param()

    assert per_param("this") == (2, 2, 12) and per_param("automodel") == (2, 2, 4)
    assert per_param("this", optimizer="sgd") == (2, 2, 8) and per_param("automodel", optimizer="sgd") == (2, 2, 2)
    assert per_param("automodel", "fp32") == per_param("this", "fp32") == (4, 4, 8)
