"""Checks a saved plan against the model file and the devices before any process starts.

Every refusal is one line (`BadInput`, exit code 2): a pipeline plan whose stages or schedule
the runtime cannot run, a model
file changed since the plan was made, layers that differ from the plan's, a world size the devices
cannot host. The layers, their tensor-parallel split and roles come from the plan (the profiler
found them): the runtime checks the model file's hash and that every layer names a module of the
model, and profiles nothing, so the runtime and the planner always agree on what a "layer" is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from planner.errors import BadInput
from planner.model_file import ModelHandle, load_model_file
from planner.plan import Plan
from runtime.float8 import float8_blocker
from runtime.types import LayerSplit, Prepared  # noqa: F401 (re-exported)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_layers(handle: ModelHandle, plan: Plan) -> tuple[LayerSplit, ...]:
    """The plan's layers (with the TP split and roles the profiler found), once each names a module
    of the model built on the meta device; BadInput otherwise (the model file imports code that
    changed, or the plan was edited). Nothing is profiled again."""
    modules = dict(handle.build_model("meta").named_modules())
    missing = [layer.name for layer in plan.model.layers if layer.name not in modules]
    if missing:
        raise BadInput(f"{Path(handle.path).name}: its layers differ from the plan's (missing {', '.join(missing[:3])}): re-plan")
    return plan.model.layers


def check_devices(plan: Plan, plan_path: Path, world_size: int, per_node: int | None = None) -> str:
    """The device type the plan runs on; BadInput when this machine cannot host its world size, or
    with `per_node` (one node of a multi-node run: runtime.multinode) its share of the ranks."""
    if plan.cluster.gpu.lower() == "cpu":
        return "cpu"  # one process per planned device, any count
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = world_size if per_node is None else per_node
    if available == wanted or (per_node is not None and available > per_node):
        return "cuda"  # a node with more GPUs than the plan's node uses the first per_node of them
    if available == 0:
        share = "" if per_node is None else f" ({per_node} on each node)"
        raise BadInput(
            f"this plan is for {world_size} x {plan.cluster.gpu} GPUs{share} and this machine has no GPU; "
            "run it where the GPUs are (or plan with --gpu cpu to try it here)"
        )
    if per_node is not None:
        raise BadInput(f"this plan runs {per_node} GPUs on each node and this machine has {available}: re-plan with "
                       f"--gpus-per-node {available}, or run it on nodes of {per_node} GPUs")
    if world_size % available:
        raise BadInput(
            f"this plan needs {world_size} GPUs and this machine has {available}, which does not divide it; re-plan"
        )
    num_nodes = world_size // available
    if plan.cluster.gpus_per_node != available:
        raise BadInput(
            f"this plan needs {world_size} GPUs in nodes of {plan.cluster.gpus_per_node} and this machine has "
            f"{available}: re-plan with --gpus-per-node {available} to run it on {num_nodes} such nodes"
        )
    raise BadInput(
        f"this plan needs {world_size} GPUs and this machine has {available}: run on each of its {num_nodes} nodes "
        f"`plan run {plan_path} --nnodes {num_nodes} --node-rank <0..{num_nodes - 1}> "
        f"--rdzv-endpoint <node 0's address>:29500`"
    )


def prepare(plan_path: str | Path, model_path: str | Path | None = None, *, on_launcher: bool = True) -> Prepared:
    """Load the plan and the model file and run every check that needs no process group.

    `on_launcher`: also check that this machine hosts the plan's devices (workers skip it: on
    several nodes each sees only its own GPUs)."""
    plan_path = Path(plan_path)
    plan = Plan.load(plan_path)  # BadInput naming the file and the field: planner.schema checks every plan it loads
    p = plan.parallel
    world_size = p.world_size
    if world_size != plan.cluster.num_gpus:  # Plan.load refuses it already (planner.schema.check_plan)
        raise BadInput(
            f"{plan_path}: parallel: dp {p.dp} x tp {p.tp} x pp {p.pp} x cp {p.cp} = {world_size}, "
            f"not cluster.num_gpus {plan.cluster.num_gpus}"
        )
    if plan.training.precision == "fp8":
        capability = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
        blocker = float8_blocker(capability)
        if blocker:
            raise BadInput(f"{plan_path}: FP8 training {blocker}; re-plan with --precision bf16 to run it here")
    if plan.training.precision == "fp4":
        raise BadInput(
            f"{plan_path}: NVFP4 training (Transformer Engine's recipe) is planned, not run by this runtime; "
            "re-plan with --precision bf16 to run it here"
        )
    if p.tp_overlap:
        raise BadInput(
            f"{plan_path}: the plan overlaps TP collectives with the GEMMs (--tp-overlap on, as Megatron-LM's "
            "--tp-comm-overlap or torchtitan's async TP run it), which this runtime does not; re-plan without it to run it here"
        )
    if p.ep_overlap:
        raise BadInput(
            f"{plan_path}: the plan runs the expert all-to-alls beside another micro-batch's compute (--ep-overlap on, "
            "as Megatron-Core's combined 1F1B or DeepSeek's DualPipe run it), which this runtime does not; re-plan "
            "without it to run it here"
        )
    if p.cp > 1:
        check_context_parallel(plan, plan_path)
    if p.dp_replicate > 1 and (p.zero < 2 or p.dp % p.dp_replicate):
        raise BadInput(f"{plan_path}: parallel.dp_replicate {p.dp_replicate} needs ZeRO-2/3 and must divide dp {p.dp}")
    path = Path(model_path if model_path is not None else plan.model.path).expanduser()
    if not path.is_file():
        raise BadInput(f"{path}: no such model file (pass --model MODEL.py)")
    if _sha256(path) != plan.model.source_sha256:
        raise BadInput(f"{path.name} changed since the plan was made: re-plan")
    handle = load_model_file(path)
    layers = check_layers(handle, plan)
    if p.ep > 1:
        check_expert_parallel(plan, plan_path, handle, layers)
    if p.pp > 1:
        from runtime.pipeline import check_pipeline, traced_reason

        check_pipeline(plan, layers)
        why = traced_reason(plan)  # BadInput when the cut needs the tracer and it fails on this model
        if why is not None and p.cp > 1:
            raise BadInput(
                f"{plan_path}: context parallelism on pipeline stages split by the tracer is not supported yet "
                f"(the split is traced because {why}): re-plan with --cp 1 or --pp 1"
            )
        if why is not None and p.ep > 1:
            raise BadInput(
                f"{plan_path}: expert parallelism on pipeline stages split by the tracer is not supported yet "
                f"(the split is traced because {why}): re-plan with --ep 1 or --pp 1"
            )
        if why is not None and p.tp > 1:
            raise BadInput(
                f"{plan_path}: tensor parallelism on pipeline stages split by the tracer is not supported yet "
                f"(the split is traced because {why}): re-plan with --tp 1 or --pp 1"
            )
    if on_launcher:
        device_type = check_devices(plan, plan_path, world_size)
    else:
        device_type = "cpu" if plan.cluster.gpu.lower() == "cpu" else "cuda"
    return Prepared(plan, plan_path, handle, layers, device_type)


def check_context_parallel(plan: Plan, plan_path: Path) -> None:
    """A plan with cp > 1 runs where the model's attention can be split (the profile's verdict,
    carried in the plan) and its sequence splits into 2 cp load-balanced shards; BadInput otherwise."""
    p, model = plan.parallel, plan.model
    if model.cp_blocker != "":
        why = model.cp_blocker or "the plan does not say whether its attention can be split (re-plan)"
        raise BadInput(f"{plan_path}: parallel.cp {p.cp}: context parallelism cannot run on this model: {why}")
    if not model.seq_len or model.seq_len % (2 * p.cp):
        raise BadInput(f"{plan_path}: parallel.cp {p.cp}: the sequence ({model.seq_len}) does not split into "
                       f"2 x {p.cp} equal shards")


def check_expert_parallel(plan: Plan, plan_path: Path, handle: ModelHandle, layers: tuple[LayerSplit, ...]) -> None:
    """A plan with ep > 1 runs on a model with mixture-of-experts blocks (found as the profiler and
    the runtime find them: planner.profile.moe), ep dividing dp x cp x tp and every block's experts,
    with tensor parallelism only under sequence parallelism (each tp rank routes its own sequence
    shard; without it every tp rank would route the same tokens), without hybrid-sharded data
    parallelism (not yet), on a model built whole (not the meta-device build); BadInput otherwise."""
    import os

    from planner.profile.moe import find_moe
    from runtime.expert_parallel import META_REFUSAL, NO_MOE
    from runtime.layout import sequence_parallel_blocker
    from runtime.meta_init import ENV as META_ENV

    p = plan.parallel
    if p.tp > 1 and not p.sequence_parallel:
        raise BadInput(f"{plan_path}: parallel.ep {p.ep} with tp {p.tp} needs sequence parallelism (each tp rank routes "
                       "its own sequence shard through the experts; without it every tp rank would route the same "
                       "tokens): re-plan with --sequence-parallel on")
    if p.tp > 1:
        blocker = sequence_parallel_blocker(layers, p.tp, p.ep)
        if blocker:
            raise BadInput(f"{plan_path}: parallel.ep {p.ep} with tp {p.tp} needs sequence parallelism, which cannot run "
                           f"on this model ({blocker}): re-plan with --tp 1")
    if p.stage_ranks % p.ep:
        raise BadInput(f"{plan_path}: parallel.ep {p.ep} does not divide dp x cp x tp {p.stage_ranks} (an "
                       "expert-parallel group is ep consecutive ranks of a pipeline stage): re-plan")
    if p.dp_replicate > 1:
        raise BadInput(f"{plan_path}: parallel.ep {p.ep} with HSDP (parallel.dp_replicate {p.dp_replicate}) is not "
                       "supported yet: re-plan with --hsdp off")
    if os.environ.get(META_ENV) == "1":
        raise BadInput(META_REFUSAL)
    blocks = find_moe(handle.build_model("meta"))
    if not blocks:
        raise BadInput(f"{plan_path}: parallel.ep {p.ep}: {Path(handle.path).name} {NO_MOE}")
    for block in blocks:
        if block.num_experts % p.ep:
            raise BadInput(f"{plan_path}: parallel.ep {p.ep} does not divide the {block.num_experts} experts of "
                           f"{block.experts}: re-plan with an ep that divides it")


def _check_sequence_buffers_not_saved(prepared: Prepared) -> None:
    """Context parallelism keeps each rank's rows of the model buffers with seq_len rows (RoPE
    tables): one saved with the model's state (persistent) would go into a checkpoint different on
    every rank under one name, and a resume would load one rank's rows everywhere. Refused, with
    the remedy."""
    from runtime.context_parallel import sequence_buffers

    model = prepared.handle.build_model("meta")
    seq = prepared.plan.model.seq_len
    saved = set(model.state_dict())
    bad = [name for name, _ in sequence_buffers(model, seq) if name in saved]
    if bad:
        raise BadInput(
            f"{Path(prepared.handle.path).name}: with --checkpoint-dir, context parallelism cannot checkpoint buffer "
            f"{bad[0]} ({seq} rows, sharded by sequence on each rank, saved with the model's state): register it "
            "with persistent=False (it is rebuilt, not loaded), or run without checkpoints"
        )


def load_for_worker(plan_path: str | Path, model_path: str | Path | None) -> Prepared:
    """What a worker needs: the same checks (cheap), so every rank shards the same layers."""
    return prepare(plan_path, model_path, on_launcher=False)


def check_checkpointing(prepared: Prepared, checkpoint_dir: str | Path | None, resume: bool, steps: int) -> list[str]:
    """Refuse, before anything starts, a resume that cannot be honoured; returns the lines to tell
    the user (which checkpoint a resume starts from, which ones were skipped).

    The checkpoint a resume would load is verified here too (the workers verify it again), so a
    tampered, unsigned, foreign or too-recent checkpoint is a one-line error rather than a failed
    launch."""
    if checkpoint_dir is None:
        if resume:
            raise BadInput("plan run: --resume needs --checkpoint-dir DIR")
        return []
    if prepared.plan.parallel.cp > 1:
        _check_sequence_buffers_not_saved(prepared)
    if not resume:
        return []
    from runtime.checkpoint import find_latest, plan_sha256, sha256_file

    found = find_latest(Path(checkpoint_dir), plan_sha256(prepared.plan_path), sha256_file(Path(prepared.handle.path)))
    if found is None:
        return [f"--resume: no checkpoint in {checkpoint_dir}; starting from step 0"]
    if found.step >= steps:
        raise BadInput(f"{found.path} is at step {found.step}: --steps {steps} leaves nothing to run")
    return [*(f"skipped {line}" for line in found.skipped), f"resuming from {found.path} (step {found.step})"]


# A slow shared filesystem (NFS over 1 GbE moves ~110 MB/s): a rank writes, then hashes, its share
# of a checkpoint at no less than this while the others wait for it in a collective.
CHECKPOINT_MIN_BPS = 50e6
# Steps a rank may lag behind another (the first step's warm-up, a slow rank) before a collective
# waiting for it counts as hung.
STEPS_OF_SLACK = 10


def work_timeout_s(plan: Plan, checkpointing: bool, floor_s: float) -> float:
    """The process-group timeout from the work: at least `floor_s`, STEPS_OF_SLACK predicted steps,
    and with checkpoints the time to write and hash the largest rank's state (its weights and
    optimizer state) at CHECKPOINT_MIN_BPS, so no collective times out while a large checkpoint is
    written or verified."""
    timeout = max(floor_s, STEPS_OF_SLACK * plan.predicted.step_time_s)
    if checkpointing:
        state = max(s.memory_bytes.weights + s.memory_bytes.optimizer for s in plan.stages)
        timeout = max(timeout, floor_s + 2 * state / CHECKPOINT_MIN_BPS)
    return timeout
