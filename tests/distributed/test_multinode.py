"""`plan run --nnodes 2 --node-rank i --rdzv-endpoint HOST:PORT`: a 2-node job formed on this one
machine by two `plan run` processes started together, 2 gloo ranks each, for a dp x tp plan
(dp2 tp2) and a pp x dp plan (pp2 dp2) of test_parity's tiny GPT, planned with --gpus-per-node 2.

Each must train as one process does on the whole batch (losses within 1e-5), node 0 alone writes
the report, whose mesh puts global ranks 0-1 on node 0 and 2-3 on node 1 (rank = node * 2 + local
rank) with every TP group inside a node. Two launches of two nodes each (20-60 s apiece on two
cores, shared in a module fixture); the bad-input tests start no torchrun.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from planner.cli import main
from planner.errors import BadInput
from planner.plan import Plan
from planner.search.space import Fixed
from runtime.launch import free_port
from runtime.multinode import check_tp_within_nodes
from runtime.preflight import check_devices
from runtime.report import RunReport, report_path, tp_groups_across_nodes
from tests.conftest import ROOT
from tests.distributed.reference import RTOL_LOSS, make_plans, single_process
from tests.distributed.test_parity import GLOBAL_BATCH, MODEL

STEPS = 3
PER_NODE = 2
CONFIGS = {
    "dp_tp": (4, Fixed(dp=2, tp=2, pp=1, zero=0, micro_batch=2, recompute="none", sequence_parallel=True)),
    "pp_dp": (4, Fixed(dp=2, tp=1, pp=2, zero=0, micro_batch=2, recompute="none", schedule="1f1b")),
}
LAUNCH_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("multinode")
    (path / "model.py").write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def plans(workdir) -> dict[str, Path]:
    """4-process CPU plans in nodes of 2 (`plan ... --gpus 4 --gpu cpu --gpus-per-node 2`)."""
    return make_plans(workdir / "model.py", CONFIGS, workdir, GLOBAL_BATCH, gpus_per_node=PER_NODE)


@pytest.fixture(scope="module")
def reference(plans):
    return single_process(plans["dp_tp"], STEPS)  # same model, data and global batch for every plan


def _plan_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "planner.cli", "run", *args]


def _two_nodes(plan: Path) -> dict:
    """Both nodes' `plan run`, started together; their exit codes and output, and node 0's report."""
    port = free_port()
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--steps", str(STEPS), "--timeout-s", "400"]
    start = time.perf_counter()
    procs = [subprocess.Popen(_plan_run(str(plan), *common, "--node-rank", str(i)), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (1, 0)]
    outs = {}
    try:
        for i, proc in zip((1, 0), procs):
            outs[i] = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    report = report_path(plan)
    return {
        "codes": {i: p.returncode for i, p in zip((1, 0), procs)},
        "stdout": {i: o[0] for i, o in outs.items()},
        "stderr": {i: o[1] for i, o in outs.items()},
        "report": RunReport.load(report) if report.exists() else None,
        "wall_s": time.perf_counter() - start,
    }


@pytest.fixture(scope="module")
def runs(plans) -> dict[str, dict]:
    return {name: _two_nodes(plans[name]) for name in CONFIGS}


def test_plans_are_two_nodes_of_two(plans):
    for name, path in plans.items():
        plan = Plan.load(path)
        assert (plan.cluster.num_gpus, plan.cluster.gpus_per_node) == (4, PER_NODE), name
    data = json.loads(plans["dp_tp"].read_text())
    assert data["cluster"]["gpus_per_node"] == PER_NODE


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_nodes_match_single_process(name, runs, reference):
    run = runs[name]
    assert run["codes"] == {0: 0, 1: 0}, f"{name}: exit codes {run['codes']}; stderr: {run['stderr']}"
    assert "node 0 has the run report" in run["stdout"][1], run["stdout"][1]
    report = run["report"]
    assert report is not None, f"{name}: node 0 wrote no report"
    ref_losses, _ = reference
    assert len(report.measured.losses) == STEPS
    for step, (got, want) in enumerate(zip(report.measured.losses, ref_losses)):
        assert abs(got - want) <= RTOL_LOSS * abs(want), f"{name}: step {step} loss {got} != {want}"
    assert len(report.measured.peak_memory_bytes) == 4  # every rank's figures, both nodes', gathered on rank 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_report_shows_the_mesh_node_by_node(name, runs):
    run = runs[name]
    report = run["report"]
    assert report is not None, run["stderr"]
    mesh = sorted(report.mesh, key=lambda r: r.rank)
    assert [(r.rank, r.node, r.local_rank) for r in mesh] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert tp_groups_across_nodes(mesh) == []
    out = run["stdout"][0]
    assert "mesh over 2 nodes:" in out and "node 1 (" in out, out
    if name == "dp_tp":  # a TP group is a node: dp splits across the nodes
        assert [(r.dp, r.tp) for r in mesh] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert "tensor-parallel groups (tp 2) each inside one node" in out, out
    else:  # a pipeline stage is a node, its 2 dp ranks inside it
        assert [(r.pp, r.dp) for r in mesh] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _refused(capsys, *args: str) -> str:
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_node_rank_out_of_range(plans, capsys):
    err = _refused(capsys, str(plans["dp_tp"]), "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500")
    assert "--node-rank 2 is out of range for --nnodes 2" in err


def test_gpu_count_not_nodes_times_per_node(plans, capsys):
    err = _refused(capsys, str(plans["dp_tp"]), "--nnodes", "4", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500")
    assert "the plan is for 4 GPUs in 2 nodes of 2, not --nnodes 4 x 2" in err


def test_endpoint_and_nodes_go_together(plans, capsys):
    err = _refused(capsys, str(plans["dp_tp"]), "--nnodes", "2", "--node-rank", "0")
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in err
    err = _refused(capsys, str(plans["dp_tp"]), "--rdzv-endpoint", "127.0.0.1:29500")
    assert "--rdzv-endpoint needs --nnodes K" in err
    err = _refused(capsys, str(plans["dp_tp"]), "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500")
    assert "--nnodes 2 needs --node-rank" in err
    err = _refused(capsys, str(plans["dp_tp"]), "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0")
    assert "is not HOST:PORT" in err


def test_unreachable_endpoint_named_within_the_timeout(plans, capsys, tmp_path):
    plan = tmp_path / "copy.json"
    plan.write_text(plans["dp_tp"].read_text())
    port = free_port()  # nothing listens there
    start = time.perf_counter()
    err = _refused(capsys, str(plan), "--nnodes", "2", "--node-rank", "1",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout-s", "2")
    assert f"the rendezvous at 127.0.0.1:{port} did not answer within 2 s" in err
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "copy.run.d").exists()  # nothing launched


def test_node0_port_taken_refused(plans, capsys):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _refused(capsys, str(plans["dp_tp"]), "--nnodes", "2", "--node-rank", "0",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--force")
    assert f"node 0 cannot host the rendezvous at 127.0.0.1:{port}" in err


def test_dry_run_shows_this_nodes_torchrun_and_the_nodes(plans, capsys):
    assert main(["run", str(plans["pp_dp"]), "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29500",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    for part in ("--nproc-per-node 2", "--nnodes 2", "--node-rank 1", "--rdzv-backend static",
                 "--rdzv-endpoint 10.0.0.1:29500", "--rdzv-id plan-"):
        assert part in out, out
    assert "node 0: ranks 0 (pp0 dp0), 1 (pp0 dp1)" in out and "node 1: ranks 2 (pp1 dp0), 3 (pp1 dp1)" in out, out


def test_tp_group_straddling_nodes_refused(plans):
    plan = Plan.load(plans["dp_tp"])
    check_tp_within_nodes(plan, "p.json", 2)  # tp 2 in nodes of 2
    check_tp_within_nodes(replace(plan, parallel=replace(plan.parallel, tp=4)), "p.json", 2)  # spans 2 whole nodes, as planned
    with pytest.raises(BadInput, match="parallel.tp 3 does not divide the 2 GPUs of a node"):
        check_tp_within_nodes(replace(plan, parallel=replace(plan.parallel, tp=3)), "p.json", 2)
    with pytest.raises(BadInput, match="parallel.tp 2 does not divide the 3 GPUs of a node"):
        check_tp_within_nodes(plan, "p.json", 3)


def test_gpu_plan_bigger_than_the_machine_points_at_the_flags(plans, monkeypatch):
    import torch

    plan = Plan.load(plans["dp_tp"])
    gpu_plan = replace(plan, cluster=replace(plan.cluster, gpu="h100"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(BadInput, match=r"plan run p.json --nnodes 2 --node-rank <0..1> --rdzv-endpoint"):
        check_devices(gpu_plan, Path("p.json"), 4)
    assert check_devices(gpu_plan, Path("p.json"), 4, per_node=2) == "cuda"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(BadInput, match="runs 2 GPUs on each node and this machine has 1"):
        check_devices(gpu_plan, Path("p.json"), 4, per_node=2)


def test_worker_refuses_a_node_torchrun_renumbered(monkeypatch):
    """c10d's dynamic rendezvous numbers nodes by host name and pid, not --node-rank: the worker
    checks torchrun's GROUP_RANK against the node rank `plan run` was given."""
    from runtime.worker import NODE_RANK_ENV, _placement

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv(NODE_RANK_ENV, "1")
    assert _placement(3)[:2] == (3, 1)
    monkeypatch.setenv(NODE_RANK_ENV, "0")
    with pytest.raises(AssertionError, match="torchrun made this node 1, not --node-rank 0"):
        _placement(3)
    monkeypatch.setenv(NODE_RANK_ENV, "1")
    with pytest.raises(AssertionError, match=r"rank 1 != node\(1\) \* per node\(2\) \+ local rank\(1\)"):
        _placement(1)


def test_calibrate_measures_across_nodes_and_inside_each():
    """`plan calibrate --nnodes 2 ...` launches as `plan run` does (runtime.calibrate.run_counts
    with this node's share): two nodes of 2 gloo processes here. Node 0 gets the figures: the
    collectives over all 4 ranks (across the nodes) and the all-reduce inside a node; node 1 none.
    The catalogue file takes the per-GPU inter-node bandwidth as the group's over its 2 members
    per node (runtime.cli.gpu_catalogue)."""
    import threading

    from planner.hardware import get_gpu
    from runtime.calibrate import run_counts
    from runtime.cli import gpu_catalogue
    from runtime.multinode import calibration_node

    endpoint = f"127.0.0.1:{free_port()}"
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def node(rank: int) -> None:
        try:
            spec = calibration_node(2, rank, endpoint, PER_NODE, 300)
            results[rank] = run_counts([PER_NODE], "cpu", 300, lambda line: None, node=spec)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    assert not errors, errors
    assert results[1] == []
    (figures,) = results[0]
    assert figures["processes"] == 4 and figures["processes_per_node"] == PER_NODE
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "intra_node_all_reduce"):
        assert figures[kind]["busbw_Bps"] > 0 and len(figures[kind]["seconds"]) == 7, kind
    base = get_gpu("h100-sxm-80gb")
    data = gpu_catalogue(base, {**figures, "matmul_bf16_flops": 7e14, "attention_bf16_flops": 4e14}, "mine", "test")
    assert data["gpus_per_node"] == PER_NODE
    assert data["inter_node_bandwidth_GBps"] == pytest.approx(figures["all_reduce"]["busbw_Bps"] / PER_NODE / 1e9)
    assert data["intra_node_bandwidth_GBps"] == pytest.approx(figures["intra_node_all_reduce"]["busbw_Bps"] / 1e9)
    assert "2 nodes x 2 GPUs" in data["sources"]["inter_node_bandwidth_GBps"]


def test_calibrate_node_flags_are_one_line(capsys):
    for args, message in (
        (["--gpu", "cpu", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1"], "measure GPU nodes"),
    ):
        assert main(["calibrate", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    from runtime.multinode import calibration_node

    with pytest.raises(BadInput, match="--node-rank 2 is out of range for --nnodes 2"):
        calibration_node(2, 2, "h:1", 8, 60)
    with pytest.raises(BadInput, match="go together"):
        calibration_node(2, 0, None, 8, 60)
