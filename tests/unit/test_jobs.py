"""Cluster job files (runtime/jobs.py): the Kubernetes PyTorchJob checked against the Kubeflow
training operator's published v1 fields, and the Slurm batch script's shape and shell syntax."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from planner.cli import main
from planner.errors import BadInput
from planner.plan import Plan
from runtime.jobs import dump_yaml, job_name, local_imports, node_shape, pytorchjob, slurm_script
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A 16-GPU plan of examples/gpt_175b.py's small sibling on A100 nodes of 8 (two nodes), and a
    4-process CPU plan (one node)."""
    tmp = tmp_path_factory.mktemp("jobs")
    out = {}
    for key, args in {
        "gpu": ["--gpus", "16", "--gpu", "a100-80gb", "--global-batch", "32"],
        "cpu": ["--gpus", "4", "--gpu", "cpu", "--global-batch", "8"],
    }.items():
        path = tmp / f"{key} plan.json"
        assert main([str(EXAMPLES / "gpt.py"), *args, "-o", str(path)]) == 0
        out[key] = path
    return out


# The PyTorchJob fields of the Kubeflow training operator's v1 API (kubeflow/training-operator,
# pkg/apis/kubeflow.org/v1/pytorch_types.go: PyTorchJobSpec.PyTorchReplicaSpecs keyed "Master" /
# "Worker", NprocPerNode a string; ReplicaSpec Replicas, RestartPolicy, Template; the default
# container name "pytorch"), and the environment the operator gives torchrun in each pod.
V1_REPLICA_TYPES = {"Master", "Worker"}
V1_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
OPERATOR_ENV = ("$PET_NNODES", "$PET_NODE_RANK", "$PET_MASTER_ADDR", "$PET_MASTER_PORT")


def test_pytorchjob_has_the_operators_fields_and_one_master_per_job(plans):
    plan = Plan.load(plans["gpu"])
    nodes, per_node = node_shape(plan)
    assert (nodes, per_node) == (2, 8)
    docs = list(yaml.safe_load_all(dump_yaml(pytorchjob(plan, plans["gpu"], EXAMPLES / "gpt.py", image="reg.io/planner:1",
                                                        namespace="ml", steps=20))))
    config, job = docs
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"] == {**job["metadata"], "name": "gpu-plan", "namespace": "ml"}
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8"
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == V1_REPLICA_TYPES
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == nodes - 1
    for role in replicas.values():
        assert role["restartPolicy"] in V1_RESTART_POLICIES
        (container,) = role["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == "reg.io/planner:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == per_node
        command = container["command"][-1]
        assert "plan run /work/plan.json --model /work/gpt.py --steps 20" in command
        assert all(env in command for env in OPERATOR_ENV)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in role["template"]["spec"]["volumes"]}
        assert volumes["plan-files"]["configMap"]["name"] == config["metadata"]["name"] and mounts["plan-files"] == "/plan"
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"
    # the ConfigMap holds the plan and the model file, byte for byte
    assert config["kind"] == "ConfigMap" and config["metadata"]["namespace"] == "ml"
    assert config["data"] == {"plan.json": plans["gpu"].read_text(), "gpt.py": (EXAMPLES / "gpt.py").read_text()}


def test_pytorchjob_ships_the_models_local_imports_or_uses_a_volume(plans):
    plan = Plan.load(plans["cpu"])
    # gpt_175b.py imports gpt.py from its folder: both go to the pods
    assert [p.name for p in local_imports(EXAMPLES / "gpt_175b.py")] == ["gpt_175b.py", "gpt.py"]
    (job,) = pytorchjob(plan, plans["cpu"], EXAMPLES / "gpt.py", image="img", volume="shared:/mnt/plans")
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]
    assert "Worker" not in job["spec"]["pytorchReplicaSpecs"]  # one node
    spec = master["template"]["spec"]
    assert spec["volumes"][0] == {"name": "plan-files", "persistentVolumeClaim": {"claimName": "shared"}}
    container = spec["containers"][0]
    assert "cp -rL /mnt/plans/. /work/" in container["command"][-1] and "/work/cpu plan.json" in container["command"][-1]
    assert container["resources"]["limits"] == {"cpu": "4"}  # a CPU plan: one core per process, no GPU


@pytest.mark.parametrize("kwargs, message", [
    (dict(image=""), "--k8s needs --image"),
    (dict(image="img", volume="nocolon"), "--k8s-volume 'nocolon': expected CLAIM:/absolute/path"),
    (dict(image="img", name="___"), "a job name needs a letter or digit"),
])
def test_pytorchjob_bad_input(plans, kwargs, message):
    with pytest.raises(BadInput, match=message):
        pytorchjob(Plan.load(plans["cpu"]), plans["cpu"], EXAMPLES / "gpt.py", **kwargs)


def test_job_names_are_dns_labels():
    assert job_name("runs/My_Plan v2.json") == "my-plan-v2"
    assert len(job_name("x" * 100 + ".json")) == 52


def test_slurm_script_runs_one_task_per_node_with_the_rendezvous_on_the_first(plans, tmp_path):
    plan = Plan.load(plans["gpu"])
    script = slurm_script(plan, plans["gpu"], EXAMPLES / "gpt.py", partition="gpu", account="proj", time="02:00:00",
                          checkpoint_dir=tmp_path / "ckpt", checkpoint_every=50, steps=1000)
    lines = script.splitlines()
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=02:00:00", "#SBATCH --requeue"):
        assert expected in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun
    for part in ('--nnodes "$SLURM_NNODES"', '--node-rank "$SLURM_NODEID"', '--rdzv-endpoint "$PLAN_RDZV"',
                 "--resume", "--checkpoint-every 50", "--steps 1000"):
        assert part in srun
    if shutil.which("bash"):
        path = tmp_path / "job.sbatch"
        path.write_text(script)
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    with pytest.raises(BadInput, match="--time 'two hours': one word expected"):
        slurm_script(plan, plans["gpu"], EXAMPLES / "gpt.py", time="two hours")


def test_plan_run_k8s_prints_the_manifest_and_bad_flags_are_one_line(plans, capsys, tmp_path):
    assert main(["run", str(plans["gpu"]), "--k8s", "--image", "reg.io/planner:1", "--steps", "5"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    assert docs[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    out = tmp_path / "job.sbatch"
    assert main(["run", str(plans["gpu"]), "--slurm", "--time", "01:00:00", "-o", str(out)]) == 0
    assert "#SBATCH --time=01:00:00" in out.read_text() and str(out) in capsys.readouterr().out
    assert main(["run", str(plans["gpu"]), "--slurm", "-o", str(out)]) == 2  # nothing the user had is overwritten
    assert "already exists" in capsys.readouterr().err
    for args, message in (
        (["--partition", "gpu"], "--partition, --account"),
        (["--slurm", "--image", "x"], "--image goes with --k8s"),
        (["--k8s", "--submit"], "--submit goes with --slurm"),
        (["--k8s"], "--k8s needs --image IMAGE"),
        (["--slurm", "--k8s"], "--slurm or --k8s, not both"),
        (["--k8s", "--image", "x", "--nnodes", "2"], "leave out --dry-run, --nnodes"),
    ):
        assert main(["run", str(plans["gpu"]), *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, (args, err)
