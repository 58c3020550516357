"""The `plan` pipeline: request -> profile -> cluster -> search -> Plan (or Infeasible).

Everything the CLI needs beyond parsing lives here, so `plan whatif` and the tests call the same
code for every point they report.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Callable

from planner import default_batch
from planner.cost import constants
from planner.cost.setup import EP_DISPATCHES, LOW_PRECISIONS, TRAINER_NOTES, TRAINERS, Training, tensor_dtype
from planner.errors import BadInput, Infeasible
from planner.hardware import Cluster, load_catalogue, make_cluster
from planner.model_file import ModelHandle
from planner.plan import Plan
from planner.profile import ModelProfile, profile_model
from planner.report.units import fmt_bytes
from planner.search.explain import build_plan
from planner.search.search import SearchResult, busy_share, run_search
from planner.search.space import Fixed, cp_blocker, divisors

DEFAULT_GPU = "h100-sxm-80gb"


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    gpu: str = DEFAULT_GPU
    gpus_per_node: int | None = None
    global_batch: int | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    memory_limit_gib: float | None = None
    inter_node_gbps: float | None = None
    """The network between nodes, Gb/s per GPU (default: the GPU type's catalogue figure)."""
    trainer: str = "this"
    """The trainer that will run the plan (planner.cost.setup.TRAINERS): its kernels and overlaps."""
    compile: bool = False
    """The trainer runs the model and its loss under torch.compile (torchtitan's --compile)."""
    ep_dispatch: str | None = None
    """How expert-parallel tokens cross nodes (Training.ep_dispatch); None: the trainer's."""
    expert_node_limit: int | None = None
    """The most nodes a token's experts come from (Training.expert_node_limit); None: any."""
    fixed: Fixed = Fixed()
    top_k: int = 3


def profile_for(handle: ModelHandle, request: PlanRequest) -> ModelProfile:
    """The profile the plan needs: in the training precision; timed only for the local CPU."""
    return profile_model(handle, batch_size=1, dtype=tensor_dtype(request.precision), measure=request.gpu.lower() == "cpu")


def cluster_for(request: PlanRequest) -> Cluster:
    return make_cluster(request.gpu, request.gpus, request.gpus_per_node, request.inter_node_gbps)


def _check(request: PlanRequest, cluster: Cluster) -> list[str]:
    f, n = request.fixed, request.gpus
    warnings = []
    degrees = [d for d in (f.tp, f.pp, f.dp, f.cp) if d is not None]
    prod = 1
    for d in degrees:
        prod *= d
    if n % prod:
        raise BadInput(f"--tp/--pp/--dp/--cp: their product ({prod}) does not divide --gpus {n}")
    if len(degrees) == 4 and prod != n:
        raise BadInput(f"--tp {f.tp} x --pp {f.pp} x --dp {f.dp} x --cp {f.cp} = {prod}, not --gpus {n}")
    if f.ep is not None and f.ep > 1:
        # an EP group is ep consecutive ranks of a pipeline stage (its dp x cp x tp ranks): some
        # stage the degrees given leave must be a multiple of it
        given = [(flag, d) for flag, d in (("--dp", f.dp), ("--cp", f.cp), ("--tp", f.tp)) if d is not None]
        part = math.prod(d for _, d in given)
        stages = [n // f.pp] if f.pp is not None else [part] if len(given) == 3 else divisors(n)
        if (given or f.pp is not None) and not any(s % part == 0 and s % f.ep == 0 for s in stages):
            said = " x ".join(f"{flag} {d}" for flag, d in given)
            where = f"the {n // f.pp} ranks of a stage that --pp {f.pp} leaves" if f.pp is not None else (
                f"{said}" if len(given) == 3 else f"any stage with {said} that --gpus {n} leaves")
            raise BadInput(f"--ep {f.ep}: expert parallelism splits the experts over consecutive ranks of a pipeline stage "
                           f"(its data-, context- and tensor-parallel ranks), and {where} is not a multiple of it")
    if f.virtual_stages is not None and f.schedule not in (None, "interleaved"):
        raise BadInput(f"--virtual-stages needs --schedule interleaved, not {f.schedule}")
    if f.zero and f.dp == 1 and (f.cp or 1) == 1:
        raise BadInput(f"--zero {f.zero} shards over data-parallel (and context-parallel) ranks, but --dp is 1")
    if request.global_batch is not None and request.global_batch < 1:
        raise BadInput(f"--global-batch must be at least 1, got {request.global_batch}")
    if request.precision in LOW_PRECISIONS and request.precision not in cluster.gpu.peak_flops:
        have = ", ".join(sorted(cluster.gpu.peak_flops))
        needs = {"fp8": "FP8 training needs FP8 tensor cores (H100, H200, L40S, MI300X, ...)",
                 "fp4": "NVFP4 training needs Blackwell's FP4 tensor cores (B200, B300, GB200, GB300)"}[request.precision]
        raise BadInput(f"--precision {request.precision}: {cluster.gpu.name} ({cluster.gpu.display_name}) has no "
                       f"{request.precision.upper()} matmul peak (it has {have}); {needs}")
    if request.precision == "fp4" and request.trainer != "megatron":
        raise BadInput("--precision fp4: NVFP4 training is Transformer Engine's recipe (Megatron-LM, NeMo, Megatron-Bridge); "
                       "plan it with --trainer megatron")
    if f.hsdp and f.zero is not None and f.zero < 2:
        raise BadInput(f"--hsdp on shards with FSDP (ZeRO-2/3), not --zero {f.zero}")
    if f.tp_overlap and f.sequence_parallel is False:
        raise BadInput("--tp-overlap on overlaps the sequence-parallel collectives: it needs --sequence-parallel on")
    if f.tp_overlap and f.tp == 1:
        warnings.append("--tp-overlap on has no effect with --tp 1")
    if f.ep_overlap and f.recompute == "full":
        raise BadInput("--ep-overlap on pairs each layer's forward with another micro-batch's backward, which full "
                       "recompute reruns apart (Megatron-Core refuses the two together): use another --recompute")
    if f.ep_overlap and f.ep == 1:
        warnings.append("--ep-overlap on has no effect with --ep 1")
    if f.sequence_parallel and f.tp == 1:
        warnings.append("--sequence-parallel on has no effect with --tp 1 (it splits tensor-parallel blocks)")
    if f.tp is not None and f.tp > cluster.gpus_per_node:
        warnings.append(
            f"--tp {f.tp} spans nodes of {cluster.gpus_per_node} GPUs: its all-reduces cross the "
            "network; tensor parallelism belongs inside a node (NVLink)"
        )
    return warnings


def check_compile(trainer: str, compile: bool) -> None:
    """--compile is torchtitan's (the runtime runs eager; Megatron-LM its own fused kernels)."""
    if compile and trainer != "torchtitan":
        raise BadInput(f"--compile: plan for --trainer torchtitan (its --compile); {trainer!r} "
                       + ("runs eager PyTorch" if trainer == "this" else "runs its own fused kernels"))


def _training(request: PlanRequest, cluster: Cluster, global_batch: int) -> Training:
    limit = cluster.gpu.memory_bytes
    if request.memory_limit_gib is not None:
        if request.memory_limit_gib <= 0:
            raise BadInput(f"--memory-limit must be positive, got {request.memory_limit_gib}")
        limit = int(request.memory_limit_gib * 2**30)
    if request.trainer not in TRAINERS:
        raise BadInput(f"--trainer must be one of {', '.join(TRAINERS)}, got {request.trainer!r}")
    check_compile(request.trainer, request.compile)
    # inductor's fused memory-bound kernels, what its partitioner keeps, and the loss compiled with the model
    compiled = {"fused_kernels": True, "compiled": True, "compiled_loss": True} if request.compile else {}
    if request.ep_dispatch is not None and request.ep_dispatch not in EP_DISPATCHES:
        raise BadInput(f"--ep-dispatch must be one of {', '.join(EP_DISPATCHES)}, got {request.ep_dispatch!r}")
    if request.expert_node_limit is not None and request.expert_node_limit < 1:
        raise BadInput(f"--expert-node-limit must be at least 1, got {request.expert_node_limit}")
    moe = {"expert_node_limit": request.expert_node_limit}
    if request.ep_dispatch is not None:
        moe["ep_dispatch"] = request.ep_dispatch
    return Training.for_trainer(request.trainer, request.precision, request.optimizer, global_batch, limit,
                                sdpa_cudnn=torch_release() >= constants.SDPA_CUDNN_FROM_TORCH, **compiled, **moe)


def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch installed: the one `plan run` runs with, whose SDPA picks the
    attention kernels (Training.sdpa_cudnn)."""
    import torch

    major, minor = (torch.__version__.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _cpu_factor(profile: ModelProfile, cluster: Cluster, busy: float = 1.0) -> float | None:
    """Measured CPU seconds scaled to a process of the run: N processes share C cores, each with
    p = max(1, C // N) threads (runtime/launch.py). The profile measured with T threads; p threads
    take speedup(T) / speedup(p) times as long, speedup interpolated in log-log between one thread
    (1) and T (the profile's thread_speedup, else T: linear); processes beyond the cores take
    turns: times k p / C, or what `plan calibrate --gpu cpu` measured for k (GPUSpec.slowdown),
    where k = 1 + (N - 1) x `busy` is how many processes a computing one shares the cores with on
    average, when each computes a share `busy` of the step (a rank waiting in gloo for a pipeline
    neighbour takes no CPU: a 3 s wait in a gloo recv or all-reduce took 0.01 s of CPU here).
    A mean-field estimate: on this 2-core VM, 8 single-thread processes timing 256 x 256 matmuls and
    sleeping between them ran their matmuls 3.9x slower than one alone when busy all the time (k = 8:
    4x), 2.6x when busy half of it (k = 4.5: 2.25x), 1.5x a quarter of it (k = 2.75: 1.4x); random
    overlaps make it a little low."""
    if cluster.gpu.origin != "measured" or not profile.timed:
        return None
    cores = os.cpu_count() or 1
    threads = profile.num_threads or 1
    n = cluster.num_gpus
    per = max(1, cores // n)
    measured = profile.thread_speedup if profile.thread_speedup is not None else float(threads)

    def speedup(p: int) -> float:
        if threads <= 1 or p <= 1:
            return 1.0
        return measured ** (math.log(min(p, threads)) / math.log(threads))

    sharing = 1 + (n - 1) * min(1.0, max(0.0, busy))
    oversubscribed = max(1.0, sharing * per / cores)
    if cluster.gpu.process_slowdown and n > cores:  # calibrated: turns taken as measured
        oversubscribed = cluster.gpu.slowdown(max(sharing, cores)) / cluster.gpu.slowdown(cores)
    return speedup(threads) / speedup(per) * oversubscribed


def _cpu_scaling(profile: ModelProfile, cluster: Cluster) -> Callable[[float], float] | None:
    """`_cpu_factor` as a function of `busy` (run_search settles it per plan); None off the CPU.
    Constant unless more processes than cores take turns."""
    if _cpu_factor(profile, cluster) is None:
        return None
    return lambda busy: _cpu_factor(profile, cluster, busy)


def global_batch_of(profile: ModelProfile, request: PlanRequest, cluster: Cluster) -> tuple[int, str | None]:
    """The request's global batch, or the default one (planner/default_batch.py) with its basis.
    With a fixed micro-batch b and no global batch, the default is rounded to a multiple of
    GPUs x b, so that every data-parallel degree can run micro-batches of b."""
    if request.global_batch is not None:
        return request.global_batch, None
    default = default_batch.for_cluster(profile, request.gpus, on_cpu=cluster.gpu.origin == "measured")
    b = request.fixed.micro_batch
    if b is None or default.global_batch % (request.gpus * b) == 0:
        return default.global_batch, default.basis
    batch = default_batch.for_count(default.global_batch, request.gpus * b)
    return batch, f"{default.basis}, rounded to {batch:,} for --micro-batch {b} on {request.gpus} GPUs"


def search(profile: ModelProfile, request: PlanRequest, cluster: Cluster) -> tuple[SearchResult, Training]:
    """Run the search at the request's global batch (or the default one): every other choice the
    user did not fix, the micro-batch included, is searched."""
    batch, _ = global_batch_of(profile, request, cluster)
    training = _training(request, cluster, batch)
    return run_search(profile, cluster, training, request.fixed, request.top_k, _cpu_scaling(profile, cluster)), training


def make_plan(handle: ModelHandle, request: PlanRequest, profile: ModelProfile | None = None) -> Plan:
    cluster = cluster_for(request)
    warnings = _check(request, cluster)
    profile = profile or profile_for(handle, request)
    _check_pipeline_cuts(profile, request)
    _check_cp_remainder(profile, request)
    result, training = search(profile, request, cluster)
    if result.best is None:
        raise Infeasible(_infeasible_message(profile, request, cluster, result, training))
    attention = cluster.gpu.attention_share(training.attention_kernel, training.sdpa_cudnn)
    sdpa_cudnn = training.attention_kernel == "sdpa" and cluster.gpu.sdpa_runs_cudnn(training.sdpa_cudnn) \
        and cluster.gpu.cudnn_attention_efficiency is not None
    low_share = cluster.gpu.matmul_share(request.precision)
    assumptions = [
        f"trainer: {TRAINER_NOTES[training.trainer]}"
        + ("; with --compile: torch.compile's fused memory-bound kernels instead, and the loss compiled (its logits "
           "kept in their dtype)"
           if request.compile else "")
        + (" (plan run executes it with its own runtime)" if training.trainer != "this" else " (--trainer says another)"),
        f"{cluster.describe()}; dense peak {cluster.gpu.peak(tensor_dtype(request.precision)) / 1e12:,.1f} TFLOP/s "
        f"({tensor_dtype(request.precision)})"
        + (f", {cluster.gpu.peak(request.precision) / 1e12:,.1f} for the {request.precision.upper()} Linear matmuls "
           f"(their casts streaming at {constants.STREAM_EFFICIENCY:.0%} of HBM bandwidth"
           + (", the output projection's kept in 16 bits as the trainer keeps it" if not training.fp8_head else "")
           + ")" if request.precision in LOW_PRECISIONS else "")
        + f", HBM {cluster.gpu.hbm_bandwidth_Bps / 1e9:,.0f} GB/s, "
        f"links {cluster.gpu.intra_node_bandwidth_Bps / 1e9:,.0f} GB/s in a node and "
        f"{cluster.gpu.inter_node_bandwidth_Bps / 1e9:,.1f} GB/s ({cluster.gpu.inter_node_bandwidth_Bps * 8 / 1e9:,.0f} Gb/s) "
        f"across nodes per GPU" + (" (--inter-node-gbps)" if request.inter_node_gbps else "") + " (plan gpus: sources)",
        f"efficiencies: matmuls {constants.MATMUL_EFFICIENCY:.0%} of this GPU's best measured matmul rate "
        f"({cluster.gpu.matmul_efficiency:.1%} of peak: {cluster.gpu.matmul_efficiency * constants.MATMUL_EFFICIENCY:.0%} in all"
        + (f"; {request.precision.upper()} ones {low_share:.1%} of the {request.precision.upper()} peak"
           + (" (what its bf16 and FP8 ceilings give)" if request.precision == "fp4" else "")
           + f": {low_share * constants.MATMUL_EFFICIENCY:.0%}" if request.precision in LOW_PRECISIONS else "") + "), "
        + (f"fused attention {attention:.0%} of peak at long sequences ("
           + (f"torch {'.'.join(map(str, torch_release()))}'s SDPA runs cuDNN's kernels on this GPU; " if sdpa_cudnn else "")
           + f"causal: half its FLOPs; each query row's fixed work: {constants.ATTENTION_ROW_KEYS} keys' worth), "
           if attention is not None else "") +
        f"memory-bound ops {constants.MEMORY_EFFICIENCY:.0%} of HBM bandwidth, data-parallel traffic beside compute "
        + (f"{training.dp_overlap:.0%} hidden (the trainer's), " if training.dp_overlap is not None else
           f"{result.best.costs.dp_share:.0%} hidden (the rest is its contention: {constants.OVERLAP_CONTENTION:g} x "
           "its link's bandwidth / HBM bandwidth), ")
        + f"links {constants.LINK_EFFICIENCY:.0%} (fitted on published runs, bench/bench_published.py)",
        f"memory reserve per device: {fmt_bytes(constants.RESERVE_GPU_BYTES if cluster.gpu.origin != 'measured' else constants.RESERVE_CPU_BYTES)} "
        f"(runtime, communication buffers) + {constants.FRAGMENTATION_GPU if cluster.gpu.origin != 'measured' else constants.FRAGMENTATION_CPU:.0%} "
        "allocator fragmentation",
        "tensor parallelism is Megatron-style (column-wise then row-wise Linears), with or without sequence "
        "parallelism as parallel.sequence_parallel says"
        + ("; on batch-first tensors (DTensor), so with sequence parallelism each collective also copies its "
           "tensor along the sequence (a read and a write at a copy's rate)" if training.tp_batch_first else
           "; on sequence-first tensors, gathered in place")
        + "; ranks ordered tp, cp, dp, pp",
    ]
    gpu = cluster.gpu
    for field_name in ("process_slowdown", "collectives", "optimizer_steps", "loss_parallel_steps", "phase_factors"):
        if getattr(gpu, field_name):  # plan calibrate's figures: say which were used, and from where
            what = (", ".join(f"{k} x{v:.2f}" for k, v in gpu.phase_factors) + ": ") if field_name == "phase_factors" else ""
            assumptions.append(f"calibration: {field_name} {what}{gpu.sources.get(field_name, gpu.origin)}")
    if result.best.cand.tp > 1 and (gpu.tp_forward_overhead_s or gpu.tp_backward_overhead_s):
        assumptions.append(f"tensor parallelism costs the host {gpu.tp_forward_overhead_s * 1e6:.0f} us forward, "
                           f"{gpu.tp_backward_overhead_s * 1e6:.0f} us backward per sharded Linear per micro-batch "
                           f"(DTensor): {gpu.sources.get('tp_forward_overhead_s', gpu.origin)}")
    best = result.best.cand
    scaling = _cpu_scaling(profile, cluster)
    if scaling is not None and scaling(0.0) != scaling(1.0):  # processes take turns on the cores
        share = busy_share(result.best)
        head = f"{cluster.num_gpus} processes on {os.cpu_count() or 1} cores"
        assumptions.append(f"{head}: each computes {share:.0%} of the step (the rest it waits in gloo for pipeline "
                           "neighbours and collectives, taking no CPU), so "
                           f"{1 + (cluster.num_gpus - 1) * share:.1f} of them compute at once on average, "
                           "taking turns on the cores as measured for that many")
    if result.tight:
        peak = result.best.evaluation.peak_bytes
        warnings.append(
            f"tight: its tensors take {fmt_bytes(peak)} per GPU of {fmt_bytes(training.memory_limit_bytes)}, leaving "
            f"less than the {constants.FRAGMENTATION_GPU:.0%} the caching allocator holds unused on average; it then "
            "frees its cached blocks and retries (slower steps) or the step runs out of memory. "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True fragments less; more GPUs or recompute leave room")
    if any(l.moe_experts for l in profile.layers):
        overlap = ("beside another micro-batch's compute (--ep-overlap on)" if best.ep_overlap else
                   "not overlapped with compute (--ep-overlap on: a trainer that overlaps them)")
        across = ("; between nodes as DeepEP sends them (--ep-dispatch deepep): a token crosses the network once to "
                  "each other node of its experts, forwarded there over NVLink" if training.ep_dispatch == "deepep" else "")
        limit = (f"; a token's experts on at most {training.expert_node_limit} node(s) of its group (--expert-node-limit)"
                 if training.expert_node_limit is not None else "")
        assumptions.append("mixture-of-experts routing balanced (every expert gets its share of the tokens x top-k, "
                           f"what a load-balancing loss aims at){limit}; expert-parallel all-to-alls {overlap}{across}")
    if request.fixed.ep_overlap and best.ep > 1 and not best.ep_overlap:
        warnings.append("--ep-overlap on: this plan runs one micro-batch a step, with no other to pair it with, "
                        "so its all-to-alls are priced without the overlap")
    if best.ep > 1 and best.pp > 1 and profile.tracer_splits(best.tp):
        warnings.append("plan run does not run expert parallelism on pipeline stages split by the pipelining tracer "
                        "(this model's): planned because --ep and --pp were both fixed")
    _, basis = global_batch_of(profile, request, cluster)
    if basis is not None:
        assumptions.append(f"{basis} (set --global-batch)")
    return build_plan(
        result, profile, cluster, request.precision, request.optimizer, training.global_batch,
        training.memory_limit_bytes, str(handle.path), assumptions, warnings + list(profile.warnings), training.trainer,
        request.compile, training.ep_dispatch, training.expert_node_limit,
    )


def _check_cp_remainder(profile: ModelProfile, request: PlanRequest) -> None:
    """--tp, --pp and --dp fixed to a product below --gpus leave the rest to context parallelism:
    one line when the model cannot run it."""
    f, n = request.fixed, request.gpus
    if None in (f.tp, f.pp, f.dp) or f.cp is not None:
        return
    prod = f.tp * f.pp * f.dp
    blocker = cp_blocker(profile)
    if prod != n and blocker:
        raise BadInput(f"--tp {f.tp} x --pp {f.pp} x --dp {f.dp} = {prod}, not --gpus {n} (context parallelism "
                       f"could take the other {n // prod}, but this model cannot run it: {blocker})")


def _check_pipeline_cuts(profile: ModelProfile, request: PlanRequest) -> None:
    """A fixed --pp needs pp - 1 cuts the runtime can split at (pp x virtual stages - 1 with
    --virtual-stages; ModelProfile.pipeline_cuts: with --tp > 1, or without the tracer, only where
    the layers run in sequence): one line why not."""
    f = request.fixed
    if f.pp is None or f.pp <= 1:
        return
    stages = f.pp * (f.virtual_stages or 1)
    tp = f.tp or 1
    cuts = len(profile.pipeline_cuts(tp))
    if cuts + 1 >= stages:
        return
    what = f"--pp {f.pp}" + (f" --virtual-stages {f.virtual_stages}" if f.virtual_stages else "")
    if tp > 1 and profile.pipeline_split == "traced" and len(profile.cut_points()) + 1 >= stages:
        raise BadInput(
            f"{what} --tp {tp}: {profile.model_name}'s forward is a plain sequence of its layers only after "
            f"{profile.layers[profile.plain_from()].name} ({cuts} cut(s) there, {stages} stages need "
            f"{stages - 1}); earlier cuts need the pipelining tracer, whose stages the runtime does not run with tensor "
            "parallelism yet: fix --tp 1 or fewer stages"
        )
    if cuts == 0:
        why = profile.pipeline_split_note or "no layer boundary from which its layers run in sequence"
        raise BadInput(f"{what}: {profile.model_name} cannot be split into pipeline stages: {why}")
    why = f"; {profile.pipeline_split_note}" if profile.pipeline_split_note else ""
    raise BadInput(f"{what}: {profile.model_name} has {cuts} valid pipeline cut(s), {stages} stages need {stages - 1}{why}")


def feasible(profile: ModelProfile, request: PlanRequest) -> bool:
    """Whether `plan` would find a plan for `request` (the same search, no Plan built). Where all
    the GPUs' memory cannot hold the training state (`state_bytes`: the least any plan holds, ZeRO-3
    over every GPU), no: without a search."""
    try:
        cluster = cluster_for(request)
        _check(request, cluster)
    except BadInput:
        return False
    training = _training(request, cluster, global_batch_of(profile, request, cluster)[0])
    if state_bytes(profile, training) > training.memory_limit_bytes * cluster.num_gpus:
        return False
    return search(profile, request, cluster)[0].best is not None


def state_bytes(profile: ModelProfile, training: Training) -> float:
    """Weights, gradients and optimizer state of the whole model (before any sharding)."""
    return profile.num_params * sum(training.bytes_per_param())


def _flag(field: str, value: object) -> str:
    """The command-line flag that fixes `field` of Fixed at `value`."""
    flag = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return f"{flag} {'on' if value else 'off'}"
    return f"{flag} {value}"


def _infeasible_message(profile, request: PlanRequest, cluster: Cluster, result: SearchResult, training: Training) -> str:
    limit = training.memory_limit_bytes
    need = result.min_need_bytes
    state = state_bytes(profile, training)
    head = (
        f"nothing fits on {cluster.describe()} with {fmt_bytes(limit)} per GPU (weights, gradients and "
        f"optimizer state alone take {fmt_bytes(state)}, against {fmt_bytes(limit * cluster.num_gpus)} in all)"
    )
    if need is not None and result.min_need_cand is not None:
        c = result.min_need_cand
        head += (
            f": memory binds; the leanest candidate (dp={c.dp} tp={c.tp} pp={c.pp}, ZeRO-{c.zero}, "
            f"micro-batch {c.micro_batch}, full recompute) needs {fmt_bytes(need)} per GPU"
        )
    fixes = []
    # what the user fixed, as the flags they gave (the overlaps are off unless asked for: off is no choice)
    given = [_flag(k, v) for k, v in vars(request.fixed).items() if v is not None and not (k.endswith("_overlap") and v is False)]
    free = bool(given) and feasible(profile, replace(request, fixed=Fixed()))
    if free:
        fixes.append(f"drop {' '.join(given)}")
    # the other fixes leave the search every choice, unless the fixed choices alone keep it from fitting:
    # then each is one that fits with them
    keep = request.fixed if free else Fixed()
    n = request.gpus * 2
    while n <= 16384:
        if feasible(profile, replace(request, gpus=n, fixed=keep)):
            fixes.append(f"{n} GPUs of this type")
            break
        n *= 2
    # a GPU with more memory, where the GPU's memory is what binds (not the user's --memory-limit)
    bigger = [] if request.memory_limit_gib is not None else [
        g for g in load_catalogue().values() if g.memory_bytes > cluster.gpu.memory_bytes and request.precision in g.peak_flops]
    for gpu in sorted(bigger, key=lambda g: g.memory_bytes):
        if feasible(profile, replace(request, gpu=gpu.name, gpus_per_node=None, memory_limit_gib=None, fixed=keep)):
            fixes.append(f"{request.gpus} x {gpu.name} ({gpu.memory_gb:.0f} GB)")
            break
    if request.optimizer == "adamw" and feasible(profile, replace(request, optimizer="sgd", fixed=keep)):
        fixes.append("--optimizer sgd (8 bytes of optimizer state per parameter instead of 12)")
    return head + ". Smallest changes that fit: " + ("; ".join(fixes) if fixes else "none found up to 16,384 GPUs") + "."
