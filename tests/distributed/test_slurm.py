"""`plan run plan.json --slurm --submit`: the sbatch script (runtime/jobs.py) run by stand-in
`sbatch`, `srun` and `scontrol` commands that start each node's task on this machine (a test
fixture: two nodes of 2 gloo ranks, test_multinode's dp2 x tp2 plan).

The first submission checkpoints every 2 steps; once a checkpoint is written, node 1's processes
are killed: the whole job must stop within 60 s (srun's --kill-on-bad-exit ends node 0's task),
naming node 1. The requeued job (`SLURM_RESTART_COUNT` 1, the script's --resume) continues from the
newest checkpoint and its losses match one process's on the whole batch. Two launches of two
nodes.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.checkpoint import find_latest, plan_sha256, sha256_file
from runtime.launch import free_port
from runtime.report import RunReport, report_path
from tests.conftest import ROOT
from tests.distributed.reference import RTOL_LOSS, make_plans, single_process
from tests.distributed.test_multinode import CONFIGS, PER_NODE
from tests.distributed.test_parity import GLOBAL_BATCH, MODEL

STEPS = 8
EVERY = 2
STOP_WITHIN_S = 60

# The stand-ins. sbatch runs the script at once (output to slurm-<id>.out, as Slurm's default
# names it, the job's exit code to slurm-<id>.exit), with the job's environment, and succeeds; srun starts the command once per node with its
# SLURM_NODEID, each in its own process group, and with --kill-on-bad-exit stops them all when one
# fails, naming the node as Slurm does; scontrol lists every node as this host.
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
tasks = [subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)},
                          start_new_session=True) for i in range(nodes)]
with open(os.environ["STANDIN_PIDS"], "w") as f:
    f.write(" ".join(str(t.pid) for t in tasks))
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
        sys.exit(1)
    if all(c == 0 for c in codes):
        sys.exit(0)
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
def cluster(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("slurm")
    (work / "model.py").write_text(MODEL)
    plan = make_plans(work / "model.py", {"dp_tp": CONFIGS["dp_tp"]}, work, GLOBAL_BATCH, gpus_per_node=PER_NODE)["dp_tp"]
    bin_dir = work / "bin"
    bin_dir.mkdir()
    for name, code in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL)):
        _standin(bin_dir / name, code)
    # `plan` on the nodes: this interpreter's (the script reads $PLAN)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PLAN_RDZV_PORT": str(free_port()),
           "PLAN": f"{sys.executable} -m planner.cli", "STANDIN_PIDS": str(work / "pids"), "PYTHONPATH": str(ROOT)}
    return {"work": work, "plan": plan, "env": env, "ckpt": work / "ckpt"}


def _submit(cluster: dict, restart: int) -> subprocess.Popen:
    env = {**cluster["env"], "SLURM_RESTART_COUNT": str(restart), "STANDIN_JOB_ID": str(4242 + restart)}
    cmd = [sys.executable, "-m", "planner.cli", "run", str(cluster["plan"]), "--slurm", "--submit", "--force",
           "--steps", str(STEPS), "--checkpoint-dir", str(cluster["ckpt"]), "--checkpoint-every", str(EVERY)]
    return subprocess.Popen(cmd, cwd=cluster["work"], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


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
    return {"code": proc.returncode, "stop_s": time.monotonic() - killed_at, "stdout": out, "stderr": err,
            "log": (cluster["work"] / "slurm-4242.out").read_text(),
            "job_code": int((cluster["work"] / "slurm-4242.exit").read_text())}


@pytest.fixture(scope="module")
def requeued(cluster, killed) -> dict:
    proc = _submit(cluster, 1)
    out, err = proc.communicate(timeout=500)
    report = report_path(cluster["plan"])
    return {"code": proc.returncode, "stdout": out, "stderr": err, "log": (cluster["work"] / "slurm-4243.out").read_text(),
            "job_code": int((cluster["work"] / "slurm-4243.exit").read_text()),
            "report": RunReport.load(report) if report.exists() else None}


def test_the_script_is_what_sbatch_gets(cluster, killed):
    script = cluster["plan"].with_suffix(".sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --requeue" in script
    assert "Submitted batch job 4242" in killed["stdout"]


def test_a_killed_node_stops_the_job_and_is_named(killed):
    assert killed["code"] == 0 and killed["job_code"] != 0
    assert killed["stop_s"] < STOP_WITHIN_S, killed
    assert "srun: error: node1" in killed["log"], killed["log"][-3000:]


def test_requeue_resumes_from_the_last_checkpoint_with_the_same_losses(cluster, requeued):
    assert requeued["code"] == 0 and requeued["job_code"] == 0, (requeued["stderr"], requeued["log"][-3000:])
    report = requeued["report"]
    assert report is not None, requeued["log"][-3000:]
    resumed = [w for w in report.warnings if "resumed from" in w]
    assert resumed, report.warnings
    first = int(resumed[0].split("step-")[1][:8])
    assert first >= EVERY and first % EVERY == 0
    ref_losses, _ = single_process(cluster["plan"], STEPS)
    assert len(report.measured.losses) == STEPS - first
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


