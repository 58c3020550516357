"""Job files that run a plan on a cluster's scheduler: a Slurm batch script and a Kubernetes
PyTorchJob (Kubeflow training operator, API kubeflow.org/v1).

Both start the same command on every node, `plan run PLAN --nnodes K --node-rank i
--rdzv-endpoint HOST:PORT` (torchrun's rendezvous: runtime/launch.py), with the node count and
the processes per node the plan says (its GPUs over the GPUs per node of its cluster). The
scheduler gives each node its rank and names the first node's address:

- Slurm: one task per node (`srun --ntasks-per-node=1`), node rank `$SLURM_NODEID`, the first host
  of `$SLURM_JOB_NODELIST` as the endpoint; `--kill-on-bad-exit` ends every node's task when one
  fails; `#SBATCH --requeue` with `--resume` continues from the newest checkpoint after a requeue.
- Kubernetes: one Master and K - 1 Workers; the operator sets `PET_NNODES`, `PET_NODE_RANK`,
  `PET_MASTER_ADDR` and `PET_MASTER_PORT` in each pod (torchrun's environment names); the plan and
  the model file (with the Python files next to it that it imports) come from a ConfigMap, or from
  a volume the user names.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path
from typing import Any

from planner.errors import BadInput
from planner.plan import Plan

RDZV_PORT = 29500
"""The rendezvous port on the first node (torchrun's default master port)."""
CONFIGMAP_LIMIT_BYTES = 1 << 20
"""Kubernetes refuses a ConfigMap over 1 MiB (etcd's object limit)."""
_NAME_RE = re.compile(r"[^a-z0-9-]+")


def node_shape(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) of a plan: its ranks over its cluster's GPUs per node."""
    world = plan.parallel.world_size
    per_node = min(plan.cluster.gpus_per_node, world)
    if world % per_node:
        raise BadInput(f"the plan's {world} ranks do not fill nodes of {per_node} GPUs: re-plan with a GPU count that does")
    return world // per_node, per_node


def _on_gpus(plan: Plan) -> bool:
    return plan.cluster.gpu.lower() != "cpu"


def _run_args(plan_file: str, model_file: str, steps: int | None, checkpoint_dir: str | None,
              checkpoint_every: int | None) -> list[str]:
    args = [plan_file, "--model", model_file]
    if steps is not None:
        args += ["--steps", str(steps)]
    if checkpoint_dir is not None:
        # --resume starts from step 0 when there is no checkpoint yet, so a requeued or restarted
        # job continues where its last verified checkpoint left it
        args += ["--checkpoint-dir", checkpoint_dir, "--resume"]
        if checkpoint_every:
            args += ["--checkpoint-every", str(checkpoint_every)]
    return args


def job_name(plan_path: str | Path, name: str | None = None) -> str:
    """A DNS-1123 name (lower-case letters, digits, '-'; at most 52 characters, leaving room for
    the operator's pod suffixes): `name`, else the plan file's stem."""
    raw = name if name is not None else Path(plan_path).name.removesuffix(".json")
    out = _NAME_RE.sub("-", raw.lower()).strip("-")[:52].strip("-")
    if not out:
        raise BadInput(f"--job-name {raw!r}: a job name needs a letter or digit")
    return out


def slurm_script(
    plan: Plan,
    plan_path: str | Path,
    model_path: str | Path,
    *,
    name: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    time: str | None = None,
    steps: int | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    port: int = RDZV_PORT,
    plan_command: str = "plan",
) -> str:
    """An sbatch script running the plan on its nodes (one `plan run` task per node)."""
    nodes, per_node = node_shape(plan)
    job = job_name(plan_path, name)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1"]
    if _on_gpus(plan):
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    else:
        lines.append(f"#SBATCH --cpus-per-task={per_node}")  # one core per gloo process
    for flag, value in (("partition", partition), ("account", account), ("time", time)):
        if value is not None:
            if not value or any(c.isspace() for c in value):
                raise BadInput(f"--{flag} {value!r}: one word expected")
            lines.append(f"#SBATCH --{flag}={value}")
    lines += ["#SBATCH --requeue", f"#SBATCH --output={job}-%j.out", ""]
    run = _run_args(str(Path(plan_path).resolve()), str(Path(model_path).resolve()), steps,
                    str(Path(checkpoint_dir).resolve()) if checkpoint_dir is not None else None, checkpoint_every)
    lines += [
        f"# {plan.parallel.one_line()} on {nodes} node(s) x {per_node} {plan.cluster.display_name}",
        "# written by `plan run --slurm`; submit with sbatch (or `plan run ... --slurm --submit`)",
        "set -euo pipefail",
        f'export PLAN="${{PLAN:-{plan_command}}}"  # the planner\'s command on the nodes',
        "# the first node hosts the rendezvous (srun passes the environment to every task)",
        f'export PLAN_RDZV="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):${{PLAN_RDZV_PORT:-{port}}}"',
        "# one task per node, each its node's share of the ranks; one failing task ends them all",
        'srun --kill-on-bad-exit=1 --ntasks-per-node=1 --nodes="$SLURM_NNODES" bash -c '
        + shlex.quote(f'exec $PLAN run {shlex.join(run)} --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" '
                      '--rdzv-endpoint "$PLAN_RDZV"'),
        "",
    ]
    return "\n".join(lines)


def local_imports(model_path: Path) -> list[Path]:
    """The model file and the Python files next to it that it imports (transitively), the files
    a node needs besides the plan."""
    model_path = Path(model_path).resolve()
    here = model_path.parent
    seen: list[Path] = []
    todo = [model_path]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (OSError, SyntaxError, ValueError) as exc:
            raise BadInput(f"{path}: cannot read it to find what it imports ({exc.__class__.__name__})") from None
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for module in names:
                candidate = here / f"{module.split('.')[0]}.py"
                if candidate.is_file():
                    todo.append(candidate)
    return seen


def pytorchjob(
    plan: Plan,
    plan_path: str | Path,
    model_path: str | Path,
    *,
    image: str,
    name: str | None = None,
    namespace: str | None = None,
    volume: str | None = None,
    steps: int | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    port: int = RDZV_PORT,
) -> list[dict[str, Any]]:
    """Kubernetes objects running the plan: a ConfigMap with the plan and model files and a
    PyTorchJob (one Master, nodes - 1 Workers, `nprocPerNode` the plan's processes per node).
    `volume` "CLAIM:PATH": a PersistentVolumeClaim mounted at PATH that holds the plan and model
    files under their own names (no ConfigMap)."""
    if not image or any(c.isspace() for c in image):
        raise BadInput("--k8s needs --image IMAGE: a container image with torch and this planner installed")
    nodes, per_node = node_shape(plan)
    job = job_name(plan_path, name)
    plan_path, model_path = Path(plan_path), Path(model_path)
    docs: list[dict[str, Any]] = []
    metadata = {"name": job, **({"namespace": namespace} if namespace else {})}
    if volume is None:
        files = {"plan.json": plan_path.read_text()}
        for path in local_imports(model_path):
            files[path.name] = path.read_text()
        size = sum(len(v.encode()) for v in files.values())
        if size > CONFIGMAP_LIMIT_BYTES:
            raise BadInput(f"the plan and model files take {size:,} bytes, over a ConfigMap's 1 MiB: put them on a "
                           "volume and pass --k8s-volume CLAIM:PATH")
        config = f"{job}-files"
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**metadata, "name": config}, "data": files})
        source, mount = {"configMap": {"name": config}}, "/plan"
        plan_file, model_file = "plan.json", model_path.name
    else:
        claim, sep, mount = volume.partition(":")
        if not sep or not claim or not mount.startswith("/"):
            raise BadInput(f"--k8s-volume {volume!r}: expected CLAIM:/absolute/path (a PersistentVolumeClaim and where to mount it)")
        source = {"persistentVolumeClaim": {"claimName": claim}}
        plan_file, model_file = plan_path.name, model_path.name
    # the files are copied to a writable folder: plan run writes its report next to the plan
    run = _run_args(f"/work/{plan_file}", f"/work/{model_file}", steps, checkpoint_dir, checkpoint_every)
    command = (f"mkdir -p /work && cp -rL {mount}/. /work/ && cd /work && exec plan run {shlex.join(run)} "
               '--nnodes "$PET_NNODES" --node-rank "$PET_NODE_RANK" --rdzv-endpoint "$PET_MASTER_ADDR:$PET_MASTER_PORT"')
    resources = ({"limits": {"nvidia.com/gpu": per_node}} if _on_gpus(plan)
                 else {"requests": {"cpu": str(per_node)}, "limits": {"cpu": str(per_node)}})

    def replica(count: int) -> dict[str, Any]:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": {
                "containers": [{
                    "name": "pytorch",  # the operator finds the training container by this name
                    "image": image,
                    "command": ["bash", "-c", command],
                    "ports": [{"name": "pytorchjob-port", "containerPort": port}],
                    "resources": resources,
                    "volumeMounts": [{"name": "plan-files", "mountPath": mount}, {"name": "dshm", "mountPath": "/dev/shm"}],
                }],
                # PyTorch's workers share tensors through /dev/shm: the container default (64 MB) is too small
                "volumes": [{"name": "plan-files", **source}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
            }},
        }

    specs = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    docs.append({
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {**metadata, "annotations": {"parallel-planner/plan": plan.parallel.one_line()}},
        "spec": {
            "nprocPerNode": str(per_node),
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    })
    return docs


def dump_yaml(docs: list[dict[str, Any]]) -> str:
    """Documents as one YAML stream (`kubectl apply -f` reads it); files as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return "---\n".join(yaml.dump(d, Dumper=Dumper, sort_keys=False, width=10_000, allow_unicode=True) for d in docs)


