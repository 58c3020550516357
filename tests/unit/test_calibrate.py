"""`plan calibrate` and what the planner does with it: the CPU step scaled to the processes that
share the cores (the profile's measured thread speed-up, the calibrated turns beyond the cores),
collectives from the calibrated table, and the alpha-beta fit."""

from __future__ import annotations

import math
import re
from pathlib import Path
from dataclasses import replace

import pytest

from planner.cli import main
from planner.hardware import make_cluster
from planner.cost.evaluate import evaluate
from planner.cost.stage_costs import stage_costs
from planner.model_file import load_model_file
from planner.planning import PlanRequest, _cpu_factor, _cpu_scaling, _training, make_plan, profile_for
from planner.search.search import busy_share, run_search
from planner.search.space import Fixed
from runtime.calibrate import fit_alpha_beta


class _Profile:
    """What _cpu_factor reads of a ModelProfile."""

    def __init__(self, threads: int, speedup: float | None):
        self.num_threads, self.thread_speedup, self.timed = threads, speedup, True


def _cpu(cores: int, **fields):
    from planner.local_device import measure_local_cpu

    return replace(measure_local_cpu(), gpus_per_node=cores, **{"process_slowdown": (), "collectives": (), **fields})


def test_processes_sharing_the_cores(monkeypatch):
    """Timed with 2 threads, 1.6 x faster than with one: 2 processes on 2 cores (1 thread each)
    take 1.6 x as long; 4 take turns on top (x2), or as calibrated; without a measured speed-up,
    threads count linearly."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    profile = _Profile(2, 1.6)
    cpu = _cpu(2)
    factor = {n: _cpu_factor(profile, make_cluster(cpu, n)) for n in (1, 2, 4)}
    assert factor[1] == pytest.approx(1.0) and factor[2] == pytest.approx(1.6) and factor[4] == pytest.approx(3.2)
    assert _cpu_factor(_Profile(2, None), make_cluster(cpu, 2)) == pytest.approx(2.0)
    calibrated = _cpu(2, process_slowdown=((1, 1.0), (2, 1.5), (4, 3.3), (8, 7.2)))
    assert _cpu_factor(profile, make_cluster(calibrated, 4)) == pytest.approx(1.6 * 3.3 / 1.5)
    assert _cpu_factor(profile, make_cluster(calibrated, 2)) == pytest.approx(1.6)  # no turns taken


def test_processes_share_the_cores_with_those_computing(monkeypatch):
    """8 processes on 2 cores, each computing a share `busy` of the step: a computing one shares
    the cores with 1 + 7 x busy of them on average (the others wait without using a core), so it
    takes the turns measured for that many: all of them when all are busy, none when it is alone."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    profile = _Profile(2, 1.6)
    slowdown = ((1, 1.0), (2, 1.5), (4, 3.3), (8, 7.2))
    cluster = make_cluster(_cpu(2, process_slowdown=slowdown), 8)
    factor = {busy: _cpu_factor(profile, cluster, busy) for busy in (0.0, 0.5, 1.0)}
    assert factor[1.0] == pytest.approx(1.6 * 7.2 / 1.5) == _cpu_factor(profile, cluster)
    assert factor[0.0] == pytest.approx(1.6)
    # 4.5 processes at once: log-log between the 3.3 measured with 4 and the 7.2 with 8
    at = math.exp(math.log(3.3) + math.log(4.5 / 4) / math.log(2) * math.log(7.2 / 3.3))
    assert factor[0.5] == pytest.approx(1.6 * at / 1.5)
    alone = _cpu_scaling(profile, make_cluster(_cpu(2, process_slowdown=slowdown), 2))
    assert alone(0.0) == alone(1.0) == pytest.approx(1.6)  # no turns: the same factor however busy


def test_a_pipeline_bubble_lightens_the_others_compute(monkeypatch):
    """examples/gpt.py on 8 processes sharing 2 cores: a pipelined plan is costed with the CPU
    factor of the share of its step its processes compute (its bubble leaves the cores to the
    others): faster than with every process busy throughout, and consistent (re-costed with the
    factor of its own busy share, its step stays); a DDP plan, whose ranks wait only for the
    gradient all-reduce, computes most of its step and is costed nearly as with all busy."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    request = PlanRequest(gpus=8, gpu="cpu", global_batch=8)
    profile = profile_for(load_model_file(Path(__file__).parents[2] / "examples" / "gpt.py"), request)
    cluster = make_cluster(_cpu(2, process_slowdown=((1, 1.0), (2, 1.8), (4, 3.9), (8, 8.0))), 8)
    training = _training(request, cluster, 8)
    scaling = _cpu_scaling(profile, cluster)

    def best(fixed: Fixed, settle: bool):
        return run_search(profile, cluster, training, fixed, 1, scaling if settle else lambda busy: scaling(1.0)).best

    gpipe = Fixed(pp=2, dp=4, tp=1, zero=0, schedule="gpipe", micro_batch=1)
    busy, settled = best(gpipe, False), best(gpipe, True)
    share = busy_share(settled)
    assert share < 0.9 and settled.step_time_s < busy.step_time_s
    again = evaluate(stage_costs(profile, cluster, training, settled.cand, scaling(share)),
                     list(settled.partition.bounds), list(settled.partition.choice))
    assert again.step_time_s == pytest.approx(settled.step_time_s, rel=0.02)
    ddp = Fixed(pp=1, dp=8, tp=1, zero=0)
    settled_ddp, busy_ddp = best(ddp, True), best(ddp, False)
    assert busy_share(settled_ddp) > 0.8 > share
    assert 0.9 * busy_ddp.step_time_s < settled_ddp.step_time_s <= busy_ddp.step_time_s


def test_the_plan_says_how_many_processes_compute_at_once(monkeypatch):
    """More processes than cores: the plan states the turns it was costed with, from its bubble."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    handle = load_model_file(Path(__file__).parents[2] / "examples" / "gpt.py")

    def said(**fixed) -> str:
        plan = make_plan(handle, PlanRequest(gpus=4, gpu="cpu", global_batch=8, fixed=Fixed(tp=1, **fixed)))
        return next(a for a in plan.assumptions if a.startswith("4 processes on 2 cores"))

    def share(text: str) -> int:
        assert "compute at once on average" in text
        return int(re.search(r"each computes (\d+)% of the step", text).group(1))

    # a pipeline rank waits for its neighbour through the bubble (half the step with one micro-batch
    # on two stages); a DDP rank only for the all-reduce. (With four micro-batches the bubble is a
    # fifth, about the DDP ranks' wait here: the two shares were within 2 points, either way.)
    assert share(said(pp=2, dp=2, schedule="gpipe", micro_batch=4)) < share(said(pp=1, dp=4)) <= 100


def test_slowdown_and_collectives_read_from_the_calibration():
    """Each group is costed with what was measured for its kind with the process count nearest to
    the plan's (all of whose processes compete for the cores while any group communicates):
    exactly latency + bytes x volume / bus bandwidth; unmeasured kinds and counts as before."""
    from planner.cost import comm
    from planner.cost.setup import Candidate
    from planner.cost.topology import links

    measured = ((2, "all_reduce", 1e-3, 1e9), (2, "all_gather", 2e-3, 5e8), (8, "all_reduce", 4e-3, 5e8), (2, "p2p", 4e-4, 2e9))
    spec = _cpu(8, process_slowdown=((1, 1.0), (2, 1.5), (8, 6.0)), collectives=measured)
    assert spec.slowdown(4) == pytest.approx(math.exp(math.log(1.5) + 0.5 * (math.log(6.0) - math.log(1.5))))
    assert spec.slowdown(16) == pytest.approx(12.0)  # proportional past the last count
    assert spec.collective(6) == (("all_reduce", 4e-3, 5e8),)
    # 8 processes, the pipeline pairs (2 processes each) among them: the 8-process figures
    lk = links(make_cluster(spec, 8), Candidate(1, 2, 4, 1, 1, 0, "1f1b"))
    ar = comm.allreduce(2, lk.pp)
    assert (ar.fixed_s, ar.per_byte_s) == pytest.approx((4e-3, 2 * (2 - 1) / 2 / 5e8))
    assert comm.allgather(2, lk.pp).fixed_s != 2e-3  # not measured with 8: the alpha-beta model of the link
    # 2 processes, one pipeline pair: the 2-process figures
    lk = links(make_cluster(spec, 2), Candidate(1, 2, 1, 1, 1, 0, "1f1b"))
    ar, ag = comm.allreduce(2, lk.pp), comm.allgather(2, lk.pp)
    assert (ar.fixed_s, ar.per_byte_s) == pytest.approx((1e-3, 1 / 1e9)) and ag.fixed_s == pytest.approx(2e-3)
    rs = comm.reduce_scatter(2, lk.pp)  # not measured: the alpha-beta model of the link
    assert rs.fixed_s != 2e-3
    one = comm.p2p(lk.pp)  # measured both ways at once: one message is half
    assert (one.fixed_s, one.per_byte_s) == pytest.approx((2e-4, 1 / 2e9))


def test_a_calibration_measured_on_a_busy_machine_is_refused_and_the_last_one_kept(tmp_path, monkeypatch):
    """N processes each stepping faster than one process alone cannot be sharing: the one-process
    launch met other load. plan calibrate says so in one line and keeps the calibration it had."""
    from planner.errors import PlanError
    from planner.local_device import calibration_path, store_calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    good = [{"processes": 1, "step_s": 0.036}, {"processes": 2, "step_s": 0.070}]
    assert store_calibration(good).slowdown(2) == pytest.approx(0.070 / 0.036)
    kept = calibration_path().read_text()
    busy = [{"processes": 1, "step_s": 0.341}, {"processes": 2, "step_s": 0.195}, {"processes": 4, "step_s": 0.277}]
    with pytest.raises(PlanError, match="busy while measuring: one process's step took 0.341 s, each of 2 processes' 0.195 s"):
        store_calibration(busy)
    assert calibration_path().read_text() == kept


def test_alpha_beta_fit():
    sizes = (4096, 65536, 1 << 20, 1 << 24)
    seconds = [2e-4 + s * 1.5 / 2e9 for s in sizes]
    latency, busbw = fit_alpha_beta(sizes, seconds, 1.5)
    assert latency == pytest.approx(2e-4, rel=1e-6) and busbw == pytest.approx(2e9, rel=1e-6)


def test_attention_throughput_counts_the_causal_kernels_flops(monkeypatch):
    """`plan calibrate` on GPUs measures causal SDPA forward + backward, in the FLOPs its kernels
    run at their plateau rate (half of 4 s^2 h d forward, 2.5 x that backward, and each query
    row's fixed work of 340 keys plus half a 128-key diagonal tile), as the catalogue's
    attention_efficiency means them; run here on the CPU at a small size, each timing taken as 1 s."""
    import torch

    import runtime.calibrate as calibrate

    calls = []
    monkeypatch.setattr(calibrate, "_median_s", lambda fn, sync: (calls.append(fn()), 1.0)[1])
    flops = calibrate.attention_flops(torch.device("cpu"), lambda: None, seqs=(32, 64), heads=2, head_dim=16)
    assert len(calls) == 2 and flops == pytest.approx(3.5 * 2 * 2 * 64**2 * 16 * (1 + (128 + 2 * 340) / 64))


def test_plan_calibrate_cpu_keeps_the_figures_for_cpu_plans(capsys, tmp_path, monkeypatch):
    """Two short launches (1 and 2 processes); the figures land with the CPU's other measured
    ones, where --gpu cpu finds them (and in -o, never over an existing file)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--gpus", "2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "slowdown" in text and out.exists()
    from planner.local_device import measure_local_cpu

    spec = measure_local_cpu()
    assert [n for n, _ in spec.process_slowdown] == [1, 2] and spec.process_slowdown[0][1] == 1.0
    assert {(n, kind) for n, kind, _, _ in spec.collectives} == {(2, k) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}
    assert "plan calibrate" in spec.sources["process_slowdown"]
    assert {(n, name) for n, name, _ in spec.optimizer_steps} == {(n, k) for n in (1, 2) for k in ("adamw", "sgd")}
    assert spec.optimizer_s_per_param(2, "adamw") > spec.optimizer_s_per_param(2, "sgd") > 0  # AdamW does more per parameter
    # DTensor's host work per sharded Linear, measured in the one-process launch: each direction
    # measured and recorded (how they compare is this machine's timing, not a contract)
    assert 0 < spec.tp_forward_overhead_s < 0.1 and 0 < spec.tp_backward_overhead_s < 0.1
    # loss_parallel beyond a fused cross-entropy, per logit element, per process count: measured,
    # recorded and read back for the process count asked (a microsecond per element is no loss)
    assert {(n, phase) for n, phase, _ in spec.loss_parallel_steps} == {(n, k) for n in (1, 2) for k in ("forward", "backward")}
    for n in (1, 2):
        got = spec.loss_parallel_s_per_element(n)
        assert got == tuple(s for m, _, s in sorted(spec.loss_parallel_steps, key=lambda x: x[1], reverse=True) if m == n)
        assert all(abs(s) < 1e-6 for s in got)
    from planner.local_device import share_host

    assert share_host(spec, 2 * spec.gpus_per_node).tp_forward_overhead_s == pytest.approx(2 * spec.tp_forward_overhead_s)
    assert share_host(spec, 1).tp_forward_overhead_s == spec.tp_forward_overhead_s  # a core of its own
    import json

    from tests.conftest import EXAMPLES

    assert main([str(EXAMPLES / "gpt.py"), "--gpu", "cpu", "--gpus", "2", "--global-batch", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)  # the plan says which calibration it used
    assert any(a.startswith("calibration: process_slowdown plan calibrate on") for a in plan["assumptions"])
    assert main([str(EXAMPLES / "gpt.py"), "--gpu", "cpu", "--gpus", "2", "--global-batch", "4", "--tp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert any(a.startswith("tensor parallelism costs the host") for a in plan["assumptions"])
    assert main(["calibrate", "--gpus", "2", "-o", str(out)]) == 2  # not overwritten without --force
    assert "already exists" in capsys.readouterr().err
    assert main(["calibrate", "--gpu", "a100-80gb"]) == 2
    assert "give -o FILE.yaml" in capsys.readouterr().err


def _report(compute: float, comm: float, optimizer: float, measured: tuple[float, float, float],
            factors: dict[str, float] | None = None, tp: int = 1, zero: int = 0):
    """A run report whose plan predicted these phases (with these calibration factors in them) and
    whose run measured compute, comm and optimizer seconds `measured` (what the runtime times
    apart: the optimizer step, the rest; with TP, the profiled TP communication). Its communication
    is TP's with tp > 1, FSDP's with ZeRO-3, else the pipeline's."""
    from runtime.report import MeasuredRun, PhaseRun, PredictedRun, Ratios, RunReport

    step = compute + comm + optimizer
    took = sum(measured)
    kind = "tp_comm" if tp > 1 else "dp_comm" if zero else "pp_comm"
    tp_phase = (PhaseRun("TP communication", comm, measured[1]),) if tp > 1 else ()
    return RunReport(
        plan="p", plan_path="p.json", model_name="m", device="cpu", world_size=2, steps=5,
        predicted=PredictedRun(step, 1, {"compute": compute, kind: comm, "optimizer": optimizer}, dict(factors or {}), tp, zero),
        measured=MeasuredRun(took, (took,) * 5, (1,), (1.0,) * 5), ratios=Ratios(took / step, 1.0),
        phases=(PhaseRun("forward, backward, communication, bubble", compute + comm, took - measured[2]),
                *tp_phase, PhaseRun("optimizer step", optimizer, measured[2])),
    )


def test_refit_from_runs_finds_the_phase_factors_and_converges():
    """Runs whose compute took 1.5x (1.5 x 1.4x in plans with tensor parallelism), communication 2x
    (2.5x FSDP's every micro-batch, 1.7x TP's) and optimizer 3x the bare prediction, in different
    mixes: the refit finds those factors (within
    the weak pull to the current ones); a second refit from runs of plans made with them, pooled
    with the first runs, moves them by under 3%, to within 1% of the truth; and reports of plans
    made with other factors pool the same."""
    from runtime.calibrate import refit

    truth = {"compute": 1.5, "comm": 2.0, "optimizer": 3.0, "tp_compute": 1.4, "zero_comm": 2.5, "tp_comm": 1.7}
    mixes = [(1.0, 0.1, 0.02, 1, 0), (0.6, 0.5, 0.02, 1, 0), (0.3, 0.9, 0.05, 1, 0), (1.2, 0.3, 0.01, 1, 0),
             (0.5, 0.4, 0.02, 2, 0), (0.8, 0.2, 0.01, 2, 0), (0.9, 0.3, 0.02, 1, 3), (0.7, 0.6, 0.02, 1, 3)]

    def runs(factors):
        def on(tp, f):
            return f.get("compute", 1.0) * (f.get("tp_compute", 1.0) if tp > 1 else 1.0)

        def comm(tp, zero, f):
            kind = "tp_comm" if tp > 1 else "zero_comm" if zero else "comm"
            return f.get(kind, f.get("comm", 1.0))
        return [_report(c * on(tp, factors), m * comm(tp, zero, factors), o * factors.get("optimizer", 1.0),
                        (c * on(tp, truth), m * comm(tp, zero, truth), o * truth["optimizer"]), factors, tp, zero)
                for c, m, o, tp, zero in mixes]

    first_runs = runs({})
    first, fitted = refit(first_runs, {})
    for k, v in truth.items():
        assert first[k] == pytest.approx(v, rel=0.05), (k, first)
    assert all(abs(after / measured - 1) < 0.05 for _, _, after, measured in fitted)
    second, _ = refit(first_runs + runs(first), first)
    for k in truth:
        assert second[k] == pytest.approx(first[k], rel=0.03) and second[k] == pytest.approx(truth[k], rel=0.01)
    # the factors a plan was made with come out before the fit: any calibration's runs give the same
    other, _ = refit(runs({"compute": 0.7, "comm": 3.0, "optimizer": 1.2, "tp_compute": 0.8, "zero_comm": 1.1,
                           "tp_comm": 0.9}), first)
    for k in truth:
        assert other[k] == pytest.approx(second[k], rel=0.01)


def test_phase_factors_from_a_catalogue_file_scale_their_phases(tmp_path):
    """A GPU file's phase_factors (what --from-run writes) multiply that phase's seconds in the
    cost tables; an unknown phase is one line naming the file."""
    from planner.cost.setup import Candidate, Training
    from planner.cost.stage_costs import stage_costs
    from planner.errors import BadInput
    from planner.hardware import load_gpu_file
    from tests.unit.test_partition import synthetic_profile

    base = (Path(__file__).parents[2] / "profiles" / "a100-80gb.yaml").read_text().replace("name: a100-80gb", "name: mine")
    path = tmp_path / "mine.yaml"
    path.write_text(base + "phase_factors:\n  compute: 2.0\n  optimizer: 3.0\n  comm: 1.5\n")
    scaled = load_gpu_file(path)
    path.write_text(base)
    plain = load_gpu_file(path)
    profile = synthetic_profile()
    training = Training("bf16", "adamw", 8, 80 * 2**30)
    cand = Candidate(1, 1, 2, 4, 1, 0, "1f1b")
    a, b = (stage_costs(profile, make_cluster(g, 2), training, cand) for g in (plain, scaled))
    assert sum(x.fwd_s for x in b.atoms) == pytest.approx(2 * sum(x.fwd_s for x in a.atoms))
    assert b.optimizer_s_per_param == pytest.approx(3 * a.optimizer_s_per_param)
    assert (b.grad_sync.fixed_s, b.grad_sync.per_byte_s) == pytest.approx((1.5 * a.grad_sync.fixed_s, 1.5 * a.grad_sync.per_byte_s))
    # FSDP's traffic every micro-batch: "comm" unless "zero_comm" is given, which leaves DDP's alone
    fsdp = Candidate(1, 1, 2, 4, 1, 3, "1f1b")
    a3, b3 = (stage_costs(profile, make_cluster(g, 2), training, fsdp) for g in (plain, scaled))
    assert (b3.mb_comm_atom_s, b3.mb_comm_param_s) == pytest.approx((1.5 * a3.mb_comm_atom_s, 1.5 * a3.mb_comm_param_s))
    path.write_text(base + "phase_factors:\n  comm: 1.5\n  zero_comm: 4.0\n")
    zeroed = load_gpu_file(path)
    c, c3 = stage_costs(profile, make_cluster(zeroed, 2), training, cand), stage_costs(profile, make_cluster(zeroed, 2), training, fsdp)
    assert (c3.mb_comm_atom_s, c3.mb_comm_param_s) == pytest.approx((4 * a3.mb_comm_atom_s, 4 * a3.mb_comm_param_s))
    assert c.grad_sync.per_byte_s == pytest.approx(b.grad_sync.per_byte_s)
    path.write_text(base + "phase_factors:\n  network: 2.0\n")
    with pytest.raises(BadInput, match="mine.yaml: field 'phase_factors' must map phases"):
        load_gpu_file(path)


def test_measured_optimizer_step_and_tp_host_time_from_a_catalogue_file(tmp_path):
    """What `plan calibrate` writes into a GPU file: the optimizer step per parameter replaces the
    memory-bound estimate (ZeRO-1 divides it over the shards as before); DTensor's host time per
    sharded Linear shows only where it outlasts the kernels (a GPU runs them beside the host)."""
    from planner.cost.setup import Candidate, Training
    from planner.cost.stage_costs import stage_costs
    from planner.errors import BadInput
    from planner.hardware import load_gpu_file
    from tests.unit.test_partition import synthetic_profile

    base = (Path(__file__).parents[2] / "profiles" / "a100-80gb.yaml").read_text().replace("name: a100-80gb", "name: mine")
    path = tmp_path / "mine.yaml"
    path.write_text(base + "optimizer_ns_per_param:\n  adamw: 2.0\n  sgd: 0.5\n")
    gpu = load_gpu_file(path)
    assert gpu.optimizer_s_per_param(64, "adamw") == 2e-9 and gpu.optimizer_s_per_param(1, "sgd") == 5e-10
    profile = synthetic_profile()
    for optimizer, ns in (("adamw", 2.0), ("sgd", 0.5)):
        training = Training("bf16", optimizer, 8, 80 * 2**30)
        for zero, shard in ((0, 1), (1, 2)):
            costs = stage_costs(profile, make_cluster(gpu, 2), training, Candidate(1, 1, 2, 4, 1, zero, "1f1b"))
            assert costs.optimizer_s_per_param == pytest.approx(ns * 1e-9 / shard)
    path.write_text(base + "optimizer_ns_per_param:\n  lamb: 1.0\n")
    with pytest.raises(BadInput, match="mine.yaml: field 'optimizer_ns_per_param' must map optimizers"):
        load_gpu_file(path)
    path.write_text(base + "loss_parallel_ns_per_element:\n  forward: 12.0\n  backward: -2.0\n")
    assert load_gpu_file(path).loss_parallel_s_per_element(8) == (12e-9, -2e-9)
    path.write_text(base + "loss_parallel_ns_per_element:\n  forward: fast\n")
    with pytest.raises(BadInput, match="mine.yaml: field 'loss_parallel_ns_per_element' must map forward and backward"):
        load_gpu_file(path)


def test_a_calibrated_gpu_file_keeps_what_the_launch_did_not_measure():
    """`plan calibrate --gpu h200` writes the measured ceilings over the catalogue part's, and keeps
    its GEMM shape table, FP8 and cuDNN shares, TDP and sources (the first H200 run's file lost
    them: its plans priced every GEMM at the square ceiling); not its compute capability, so that
    torch's SDPA there runs at the measured figure, whichever kernels this torch picks."""
    import yaml

    from planner.hardware import get_gpu, parse_gpu
    from runtime.cli import gpu_catalogue

    base = get_gpu("h200")
    data = gpu_catalogue(base, {"processes": 1, "matmul_bf16_flops": 7.6e14, "attention_bf16_flops": 5.6e14}, "mine", "test")
    spec = parse_gpu(yaml.safe_load(yaml.safe_dump(data)), where="mine.yaml", default_name="mine", origin="user")
    assert spec.matmul_efficiency == pytest.approx(7.6e14 / base.peak("bf16"))
    assert spec.attention_efficiency == pytest.approx(5.6e14 / base.peak("bf16"))
    assert (spec.matmul_shapes, spec.fp8_matmul_efficiency, spec.cudnn_attention_efficiency, spec.tdp_w) == (
        "sm_90", base.fp8_matmul_efficiency, base.cudnn_attention_efficiency, base.tdp_w)
    assert spec.sources["fp8_matmul_efficiency"].startswith("h200's: ")
    assert spec.compute_capability is None and spec.attention_share("sdpa", True) == spec.attention_efficiency
