"""`plan run --nnodes 2 --node-rank i --rdzv-endpoint HOST:PORT`: a 2-node job formed on this one
machine by two `plan run` processes, 2 gloo ranks each, for a dp x tp plan (dp2 tp2) and a pp x dp
plan (pp2 dp2) of test_parity's tiny GPT, planned with --gpus-per-node 2. The dp x tp job is two
`plan run` processes started together here; the pp x dp one is `plan run plan.json --slurm --submit`
(below): the sbatch script (runtime/jobs.py) run by stand-in `sbatch`, `srun` and `scontrol`
commands that start each node's task on this machine.

Each must train as one process does on the whole batch (losses within 1e-5), node 0 alone writes
the report, whose mesh puts global ranks 0-1 on node 0 and 2-3 on node 1 (rank = node * 2 + local
rank) with every TP group inside a node.

The Slurm job's first submission checkpoints every 2 steps; once a checkpoint is written, node 1's
processes are killed: the whole job must stop within 60 s (srun's --kill-on-bad-exit ends node 0's
task), naming node 1. The requeued job (`SLURM_RESTART_COUNT` 1, the script's --resume) continues
from the newest checkpoint and its losses match one process's on the whole batch. The requeued
job's report and nodes' output are pp x dp's in the checks above, its losses compared from the
step it resumed from on (the steps before ran in the killed job, which writes no report).

Three launches of two nodes (20-60 s apiece on two cores, shared in module fixtures): the dp x tp
job, and the Slurm job's two submissions. The bad-input tests start no torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
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
from runtime.checkpoint import find_latest, plan_sha256, sha256_file
from runtime.launch import free_port
from runtime.multinode import check_tp_within_nodes
from runtime.preflight import check_devices
from runtime.report import RunReport, report_path, tp_groups_across_nodes
from tests.conftest import ROOT
from tests.distributed.reference import RTOL_LOSS, make_plans, single_process
from tests.distributed.test_parity import GLOBAL_BATCH, MODEL

STEPS = 3
"""Steps of the dp x tp job; the Slurm job runs SLURM_STEPS."""
PER_NODE = 2
CONFIGS = {
    "dp_tp": (4, Fixed(dp=2, tp=2, pp=1, zero=0, micro_batch=2, recompute="none", sequence_parallel=True)),
    "pp_dp": (4, Fixed(dp=2, tp=1, pp=2, zero=0, micro_batch=2, recompute="none", schedule="1f1b")),
}
LAUNCH_TIMEOUT_S = 420
SLURM_PLAN = "pp_dp"
SLURM_STEPS = 8
CKPT_EVERY = 2
STOP_WITHIN_S = 60


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
    # same model, data and global batch for every plan; steps enough for both jobs
    return single_process(plans["dp_tp"], max(STEPS, SLURM_STEPS))


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
        "steps": STEPS,
    }


@pytest.fixture(scope="module")
def dp_tp_run(plans) -> dict:
    return _two_nodes(plans["dp_tp"])


# The fixture whose 2-node job ran each plan: dp x tp started here, pp x dp the requeued Slurm job.
RUN_OF = {"dp_tp": "dp_tp_run", SLURM_PLAN: "requeued"}
assert set(RUN_OF) == set(CONFIGS)


def _run(name: str, request) -> dict:
    return request.getfixturevalue(RUN_OF[name])


def _first_step(report: RunReport) -> int:
    """The step a resumed run's losses start after (its "resumed from ... step-NNNNNNNN" warning); 0."""
    resumed = [w for w in report.warnings if "resumed from" in w]
    return int(resumed[0].split("step-")[1][:8]) if resumed else 0


def test_plans_are_two_nodes_of_two(plans):
    for name, path in plans.items():
        plan = Plan.load(path)
        assert (plan.cluster.num_gpus, plan.cluster.gpus_per_node) == (4, PER_NODE), name
    data = json.loads(plans["dp_tp"].read_text())
    assert data["cluster"]["gpus_per_node"] == PER_NODE


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_nodes_match_single_process(name, request, reference):
    """Every step's loss as one process's; the Slurm job's (pp_dp) from the step it resumed from."""
    run = _run(name, request)
    assert run["codes"] == {0: 0, 1: 0}, f"{name}: exit codes {run['codes']}; stderr: {run['stderr']}"
    assert "node 0 has the run report" in run["stdout"][1], run["stdout"][1]
    report = run["report"]
    assert report is not None, f"{name}: node 0 wrote no report"
    ref_losses, _ = reference
    first = _first_step(report)
    if name == SLURM_PLAN:  # the requeued job: resumed from a checkpoint of the killed one
        assert first >= CKPT_EVERY, report.warnings
    else:
        assert first == 0, report.warnings
    assert len(report.measured.losses) == run["steps"] - first
    for step, (got, want) in enumerate(zip(report.measured.losses, ref_losses[first:run["steps"]]), first):
        assert abs(got - want) <= RTOL_LOSS * abs(want), f"{name}: step {step} loss {got} != {want}"
    assert len(report.measured.peak_memory_bytes) == 4  # every rank's figures, both nodes', gathered on rank 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_report_shows_the_mesh_node_by_node(name, request):
    run = _run(name, request)
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


# --- the pp x dp job as a Slurm job: `plan run plan.json --slurm --submit` -----------------------

# The stand-ins. sbatch runs the script at once (output to slurm-<id>.out, as Slurm's default
# names it, the job's exit code to slurm-<id>.exit), with the job's environment, and succeeds; srun
# starts the command once per node with its SLURM_NODEID, each in its own process group, and with
# --kill-on-bad-exit stops them all when one fails, naming the node as Slurm does; scontrol lists
# every node as this host. So that the checks can tell which node printed what, srun keeps each
# task's stdout and stderr apart (slurm-<id>.node<i>.out/.err, its exit code in slurm-<id>.tasks)
# and copies them into the job's output once the tasks have ended.
SBATCH = """\
import os, subprocess, sys
job = os.environ.get("STANDIN_JOB_ID", "4242")
env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]"}
env.setdefault("SLURM_RESTART_COUNT", "0")
print(f"Submitted batch job {job}", flush=True)
with open(f"slurm-{job}.out", "w") as out:
    code = subprocess.run(["bash", sys.argv[-1]], env=env, stdout=out, stderr=subprocess.STDOUT).returncode
with open(f"slurm-{job}.exit", "w") as f:  # the job's state (sacct's), apart from the submission's
    f.write(str(code))
"""
SRUN = """\
import os, signal, subprocess, sys, time
cmd = sys.argv[sys.argv.index("bash"):]
nodes = int(os.environ["SLURM_NNODES"])
base = f"slurm-{os.environ['SLURM_JOB_ID']}"
files = [(open(f"{base}.node{i}.out", "w"), open(f"{base}.node{i}.err", "w")) for i in range(nodes)]
tasks = [subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)},
                          stdout=files[i][0], stderr=files[i][1], start_new_session=True) for i in range(nodes)]
with open(os.environ["STANDIN_PIDS"], "w") as f:
    f.write(" ".join(str(t.pid) for t in tasks))


def end(code):
    with open(f"{base}.tasks", "w") as f:
        f.write(" ".join(str(t.returncode) for t in tasks))
    for i, pair in enumerate(files):
        for f in pair:
            f.close()
            with open(f.name) as g:
                (sys.stdout if f.name.endswith(".out") else sys.stderr).write(g.read())
    sys.exit(code)


while True:
    codes = [t.poll() for t in tasks]
    bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if bad:
        i = bad[0]
        print(f"srun: error: node{i}: task {i}: Exited with exit code {codes[i]}", file=sys.stderr, flush=True)
        for t in tasks:  # --kill-on-bad-exit
            if t.poll() is None:
                os.killpg(t.pid, signal.SIGTERM)
        for t in tasks:
            t.wait()
        end(1)
    if all(c == 0 for c in codes):
        end(0)
    time.sleep(0.2)
"""
SCONTROL = """\
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("127.0.0.1\\n127.0.0.1")
"""


def _standin(path: Path, code: str) -> None:
    path.write_text(f"#!{sys.executable}\n" + code)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture(scope="module")
def cluster(workdir, plans) -> dict:
    """The stand-ins on PATH, and the pp x dp plan the job runs (its report next to it)."""
    work = workdir
    bin_dir = work / "bin"
    bin_dir.mkdir()
    for name, code in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL)):
        _standin(bin_dir / name, code)
    # `plan` on the nodes: this interpreter's (the script reads $PLAN)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PLAN_RDZV_PORT": str(free_port()),
           "PLAN": f"{sys.executable} -m planner.cli", "STANDIN_PIDS": str(work / "pids"), "PYTHONPATH": str(ROOT)}
    return {"work": work, "plan": plans[SLURM_PLAN], "env": env, "ckpt": work / "ckpt"}


def _submit(cluster: dict, restart: int) -> subprocess.Popen:
    env = {**cluster["env"], "SLURM_RESTART_COUNT": str(restart), "STANDIN_JOB_ID": str(4242 + restart)}
    cmd = [sys.executable, "-m", "planner.cli", "run", str(cluster["plan"]), "--slurm", "--submit", "--force",
           "--steps", str(SLURM_STEPS), "--checkpoint-dir", str(cluster["ckpt"]), "--checkpoint-every", str(CKPT_EVERY)]
    return subprocess.Popen(cmd, cwd=cluster["work"], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _job(cluster: dict, proc: subprocess.Popen, job: int, out: str, err: str) -> dict:
    """The submission's exit code and output; the job's (sbatch's log, exit code); each node's task
    (exit codes, stdout, stderr, as test_two_nodes_match_single_process reads a 2-node run's)."""
    work = cluster["work"]
    tasks = work / f"slurm-{job}.tasks"
    codes = [int(c) for c in tasks.read_text().split()] if tasks.exists() else []
    return {"code": proc.returncode, "submitted": out, "submit_stderr": err,
            "log": (work / f"slurm-{job}.out").read_text(), "job_code": int((work / f"slurm-{job}.exit").read_text()),
            "codes": dict(enumerate(codes)),
            "stdout": {i: (work / f"slurm-{job}.node{i}.out").read_text() for i in range(len(codes))},
            "stderr": {i: (work / f"slurm-{job}.node{i}.err").read_text() for i in range(len(codes))}}


@pytest.fixture(scope="module")
def killed(cluster) -> dict:
    """The first submission, node 1's processes killed once a checkpoint is written."""
    proc = _submit(cluster, 0)
    hashes = plan_sha256(cluster["plan"]), sha256_file(cluster["work"] / "model.py")
    deadline = time.monotonic() + 400
    while not cluster["ckpt"].exists() or find_latest(cluster["ckpt"], *hashes) is None:
        assert proc.poll() is None, f"the job ended before a checkpoint: {proc.communicate()}"
        assert time.monotonic() < deadline, "no checkpoint within 400 s"
        time.sleep(0.2)
    node1 = int((cluster["work"] / "pids").read_text().split()[1])
    os.killpg(node1, signal.SIGKILL)  # node 1 dies: its plan run, torchrun and ranks
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=300)
    return {**_job(cluster, proc, 4242, out, err), "stop_s": time.monotonic() - killed_at}


@pytest.fixture(scope="module")
def requeued(cluster, killed) -> dict:
    """The requeued job: resumes from the killed one's newest checkpoint to SLURM_STEPS. Its report
    and nodes' output are pp_dp's 2-node run (RUN_OF)."""
    report = report_path(cluster["plan"])
    assert not report.exists(), "the killed job wrote a report"
    proc = _submit(cluster, 1)
    out, err = proc.communicate(timeout=500)
    return {**_job(cluster, proc, 4243, out, err), "steps": SLURM_STEPS,
            "report": RunReport.load(report) if report.exists() else None}


def test_the_script_is_what_sbatch_gets(cluster, killed):
    script = cluster["plan"].with_suffix(".sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --requeue" in script
    assert "Submitted batch job 4242" in killed["submitted"]


def test_a_killed_node_stops_the_job_and_is_named(killed):
    assert killed["code"] == 0 and killed["job_code"] != 0
    assert killed["stop_s"] < STOP_WITHIN_S, killed
    assert "srun: error: node1" in killed["log"], killed["log"][-3000:]


def test_requeue_resumes_from_the_last_checkpoint_with_the_same_losses(cluster, requeued):
    assert requeued["code"] == 0 and requeued["job_code"] == 0, (requeued["submit_stderr"], requeued["log"][-3000:])
    report = requeued["report"]
    assert report is not None, requeued["log"][-3000:]
    resumed = [w for w in report.warnings if "resumed from" in w]
    assert resumed, report.warnings
    first = int(resumed[0].split("step-")[1][:8])
    assert first >= CKPT_EVERY and first % CKPT_EVERY == 0
    ref_losses, _ = single_process(cluster["plan"], SLURM_STEPS)
    assert len(report.measured.losses) == SLURM_STEPS - first
    for step, (got, want) in enumerate(zip(report.measured.losses, ref_losses[first:]), first):
        assert abs(got - want) <= RTOL_LOSS * abs(want), f"step {step}: {got} != {want}"


def test_submit_without_sbatch_is_one_line(cluster, capsys, monkeypatch):
    from planner.cli import main

    monkeypatch.setenv("PATH", "/nonexistent")
    out = cluster["work"] / "x.sbatch"
    assert main(["run", str(cluster["plan"]), "--slurm", "--submit", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("sbatch is not on PATH (submit the script from a Slurm login node)") and "\n" not in err
    assert not out.exists()  # nothing written


