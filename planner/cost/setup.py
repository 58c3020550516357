"""What the cost model is asked about: the training setup and one candidate configuration."""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.constants import ASYNC_TP_OVERLAP

PRECISIONS = ("bf16", "fp16", "fp32", "fp8", "fp4")
LOW_PRECISIONS = ("fp8", "fp4")
"""Training precisions that run the Linear matmuls (and grouped GEMMs, under Transformer Engine)
below 16 bits, over bf16 tensors: FP8 (torchao's Float8 or Transformer Engine's), NVFP4
(Transformer Engine's only)."""
EP_DISPATCHES = ("all_to_all", "deepep")
"""How expert-parallel tokens cross nodes (Training.ep_dispatch)."""
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "alternate", "full")
"""Recompute choices, in the order of planner.cost.stage_costs.KINDS."""


def tensor_dtype(precision: str) -> str:
    """The dtype of weights and activations for a training precision: FP8 and FP4 training keep
    bf16 tensors and run only their Linear matmuls in 8 or 4 bits. Also the peak MFU is quoted
    against (torchtitan reports its Float8 runs' MFU against the bf16 peak)."""
    return "bf16" if precision in LOW_PRECISIONS else precision


TRAINERS: dict[str, dict] = {
    # plan run's runtime: eager PyTorch, SDPA, torchao's Float8, torch's non-reentrant checkpoint
    # (early stop) with a save-the-matmuls selective policy
    "this": {},
    # torchtitan as its configs run it (eager; torch_compile adds fused kernels): the same kernels,
    # and its per-op selective checkpointing keeps reduce-scatter outputs
    "torchtitan": {"recompute_collectives": "all_gathers", "tp_overlap_share": ASYNC_TP_OVERLAP, "fp8_head": False,
                   "fp8_cast_scope": "op"},
    # Megatron-LM, NeMo and Megatron-Bridge on Transformer Engine, with the overlaps their
    # performance recipes turn on (--overlap-grad-reduce) and the distributed optimizer's
    # reduce-scatter
    "megatron": {"recompute_whole_forward": True, "fused_kernels": True, "attention_kernel": "te", "fp8_recipe": "te",
                 "recompute_collectives": "none", "dp_overlap": 1.0, "zero1_reduce_scatter": True,
                 "fused_loss": True, "p2p_overlap": True,
                 "p2p_scatter_gather": True, "tp_saves_gathered": False, "fp8_head": False, "tp_batch_first": False},
    # DeepSpeed's ZeRO (eager PyTorch kernels): ZeRO-3 gathers module by module, and its
    # activation checkpointing is reentrant (reruns a layer's whole forward); its tensor
    # parallelism Megatron-LM's (Megatron-DeepSpeed)
    "deepspeed": {"zero3_gathers": "module", "recompute_whole_forward": True, "tp_saves_gathered": False,
                  "p2p_scatter_gather": True, "tp_batch_first": False},
    # NeMo AutoModel (NVIDIA's PyTorch backend: FSDP2, torch pipelining, expert parallelism with
    # DeepEP) on Transformer Engine's kernels (its BackendConfig: TE Linear, RMSNorm and attention,
    # fused RoPE); the Hugging Face model's 16-bit parameters are what FSDP2 shards and
    # torch.optim.Adam steps, with its state in their dtype (no fp32 master copy); DeepEP's
    # dispatch; the loss on the bf16 logits (every config of its published benchmarks,
    # examples/benchmark/configs, sets MaskedCrossEntropy's fp32_upcast to false)
    "automodel": {"master_weights": False, "fused_kernels": True, "attention_kernel": "te", "fp8_recipe": "te",
                  "ep_dispatch": "deepep", "loss_upcast": False},
}
"""The trainers a plan can be made for (`plan --trainer`): the Training fields each sets."""
TRAINER_NOTES = {
    "this": "plan run's runtime: eager PyTorch (memory-bound ops one kernel each), SDPA attention, torchao "
            "Float8 (each Linear compiled: each tensor cast once), fused optimizer on CUDA, non-reentrant recompute",
    "torchtitan": "torchtitan: eager PyTorch, SDPA attention, torchao Float8 (each cast at each use; with --compile "
                  "each tensor once), per-op selective recompute "
                  "that keeps reduce-scatter outputs",
    "megatron": "Megatron-LM / NeMo / Megatron-Bridge on Transformer Engine: fused memory-bound kernels, cuDNN "
                "attention, TE's FP8 casts, full recompute of whole layers, selective recompute of the attention "
                "core, the distributed optimizer's gradient reduce-scatter hidden behind the backward, pipeline sends "
                "beside the compute under "
                "the interleaved schedule",
    "deepspeed": "DeepSpeed (eager PyTorch kernels): ZeRO-3 gathers each module's parameters with a collective of "
                 "its own, reentrant activation checkpointing",
    "automodel": "NeMo AutoModel (PyTorch FSDP2, torch pipelining, DeepEP) on Transformer Engine's kernels: fused "
                 "norms, cuDNN attention, TE's FP8 casts, DeepEP's dispatch (a token crosses the network once to "
                 "each node of its experts); 16-bit parameters with the optimizer state in their dtype "
                 "(no fp32 master copy)",
}


@dataclass(frozen=True)
class Training:
    precision: str
    """bf16/fp16: mixed precision (16-bit weights, gradients and activations, fp32 master weights
    and optimizer state); fp32: everything in fp32; fp8: bf16 mixed precision whose Linear matmuls
    run in FP8 with dynamic scaling (torchao Float8 training, as torchtitan runs it): weights,
    gradients, optimizer state and saved activations as bf16."""
    optimizer: str
    global_batch: int
    memory_limit_bytes: int
    """Usable memory per device (the GPU's memory, or --memory-limit)."""
    recompute_whole_forward: bool = False
    """Full recompute reruns a layer's whole forward: a reentrant checkpoint (Megatron-LM's own,
    Composer's FSDP default). False: it stops once backward has every tensor it reads (torch's
    non-reentrant checkpoint with early stop, which this runtime and torchtitan run; a compiled
    recompute likewise): a block's last matmul is not rerun (LayerProfile.fwd_tail_*)."""

    tp_saves_gathered: bool = True
    """With sequence parallelism, what a block's column-wise Linears save of the input they share
    (the attention's, the MLP's, gathered from the sequence shards): DTensor's tensor parallelism
    (this runtime, runtime/tensor_parallel.py; torchtitan) keeps the all-gathered input whole, as
    autograd saves any matmul input; Megatron-LM's (Transformer Engine's Linears with
    sequence_parallel) keeps the rank's shard and gathers it again in backward (Korthikanti et al.
    2022, Sec. 4.2.2): False."""
    tp_batch_first: bool = True
    """The trainer's activations are batch-first ([batch, sequence, hidden]) and its tensor
    parallelism is DTensor's (this runtime, torchtitan, NeMo AutoModel), so with sequence
    parallelism its collectives gather and scatter along dimension 1, which NCCL cannot: torch's
    functional collectives copy each reduce-scatter's input into rank order first and each
    all-gather's output into place after (torch.cat over chunks: _chunk_or_narrow_cat and
    _maybe_view_chunk_cat in torch/distributed/_functional_collectives.py; torch 2.13's makes no copy
    after the all-gather of a micro-batch of one sequence, whose order is already right).
    False: sequence-first tensors (Megatron-LM, Megatron-DeepSpeed), gathered along dimension 0
    in place."""
    dp_overlap: float | None = None
    """The share of the data-parallel traffic that the trainer hides behind compute (the shorter of
    the two, as comm.overlapped_s has it); None: what the traffic's contention leaves
    (constants.OVERLAP_CONTENTION x its link's bandwidth over HBM's exposed), fitted on the published
    runs. Megatron's distributed optimizer with --overlap-grad-reduce (the default of
    Megatron-Bridge and NeMo with dp > 1) hides its gradient reduce-scatter behind the backward: 1."""
    zero1_reduce_scatter: bool = False
    """ZeRO-1 reduce-scatters the gradients (each rank receives the sum of the shard its optimizer
    steps), beside the last backward, and all-gathers the updated weights after the step:
    Megatron-LM's distributed optimizer (megatron/core/distributed: each bucket's reduce-scatter,
    then the parameters' all-gather; docs/source/api-guide/dist_optimizer.md). False: an
    all-reduce of whole gradients before a sharded optimizer (DDP with torch's
    ZeroRedundancyOptimizer, as this runtime runs ZeRO-1), twice the reduce-scatter's bytes.
    The all-gather stays after the step even where the trainer overlaps it with the next forward
    (Megatron's --overlap-param-gather): credited with that overlap (beside the first micro-batch's
    forward, a bucket ahead of the layer that needs it), the Megatron runs of
    bench/reference came out faster than they ran: Megatron-LM's H100 weak-scaling rows median 12.2%
    (worst 21%) against 8.9% (12%) without it, the 214 NeMo runs of dgxc_runs.yaml 4.0% against 3.1%,
    Megatron-Bridge's 25 dense ones 4.3% against 4.0% (with the search's 2-4 interleaved chunks of
    2026-12-07)."""
    recompute_collectives: str = "all"
    """The forward TP collectives selective and alternate recompute run again: those whose outputs
    backward reads (a column-wise Linear's gathered input, the residual after a row-wise one),
    which a policy that saves only matmul-like outputs does not keep. "all": this runtime's
    save-matmuls policy (runtime/recompute.py). "all_gathers": torchtitan's per-op policy, whose
    save list keeps reduce-scatter outputs (with sequence parallelism, half the forward's
    collectives; its all-reduces without). "none": Megatron-LM's selective recompute, which reruns
    the attention core only. Full recompute reruns them all whatever this says."""
    fused_kernels: bool = False
    """The trainer runs each chain of memory-bound ops (norms, activation functions, RoPE, residual
    adds) as one fused kernel: Megatron-LM, NeMo and Megatron-Bridge (Transformer Engine's and
    Megatron's fused kernels), a torch.compile'd model. Their HBM traffic is then the profile's
    fused figure (LayerProfile.fwd_fused_io_bytes) instead of op by op, and what they save for
    backward what each kernel reads, not the tensors it makes and reads itself
    (LayerProfile.activation_fused_bytes: a Llama block's 27.1 hidden-size tensors become 19.6,
    what torch 2.13's inductor keeps for it, tests/unit/test_compiled_memory.py). False: eager
    PyTorch, as this runtime runs a plan."""
    fused_loss: bool = False
    """The trainer runs the default loss (cross-entropy on the logits) without copies of the logits
    beyond one: Megatron-LM's cross-entropy keeps the fp32 softmax it computes in place and
    writes the gradient into it (tensor_parallel.vocab_parallel_cross_entropy). False: as
    F.cross_entropy on logits.float() runs it eagerly (this runtime; torchtitan before April 2025,
    whose train.py left it uncompiled even with --compile: "compiling loss function causes CUDA
    errors"; since, `compiled_loss`),
    holding two more fp32 copies in backward, as the profile measured
    (ModelProfile.loss_working_bytes)."""
    fragmentation: float | None = None
    """The caching allocator's unused share counted on top of what tensors need; None: the cost
    model's (constants.FRAGMENTATION_*). The search sets 0.0 when nothing fits with it
    (search.run_search: a tight plan)."""
    compiled: bool = False
    """The trainer runs the model's layers under torch.compile (torchtitan's --compile). Besides
    the fused kernels (`fused_kernels`), AOTAutograd's partitioner keeps what backward reads: under
    selective checkpointing it does not keep the matmul outputs backward never reads, which eager
    selective checkpointing keeps (a block's last Linear's, read only by the residual add:
    LayerProfile.activation_*_tail_bytes; measured on torch 2.13's inductor, one Llama block: 11.5
    -> 10.5 hidden-size tensors kept). Without checkpointing it saves what each fused chain of
    memory-bound ops reads, as `fused_kernels` (27.1 -> 19.6 there, LayerProfile.activation_fused_bytes
    19.6)."""
    loss_bytes_per_logit: tuple[float, float] | None = None
    """(forward, backward) HBM bytes the default loss moves per logit where the trainer computes it
    with its own kernels, not as the profile traced it: Megatron-LM's unfused vocabulary-parallel
    cross-entropy (constants.VOCAB_PARALLEL_CE_BYTES). None: as traced (op by op, or as one fused
    kernel with `fused_kernels`). Not for a model file's own loss_fn."""
    compiled_loss: bool = False
    """The trainer compiles the default loss (torch.compile of F.cross_entropy on logits.float():
    torchtitan with --compile since its loss builder compiles it, PR #1033, April 2025). Inductor
    fuses the upcast, log-softmax and their backward: the loss saves the logits in their own dtype
    and two fp32 figures per row (not the fp32 log-probabilities), and backward writes one
    gradient of the logits in their dtype (as `fused_loss`). Measured on torch 2.13's inductor
    (tests/unit/test_compiled_memory.py)."""
    attention_kernel: str = "sdpa"
    """The fused attention kernels the trainer runs. "sdpa": PyTorch's scaled_dot_product_attention
    (FlashAttention-2's kernel on NVIDIA GPUs, or cuDNN's: `sdpa_cudnn`), as this runtime and
    torchtitan run it, at the GPU's `attention_efficiency`. "te": Transformer Engine's DotProductAttention, as Megatron-LM, NeMo
    and Megatron-Bridge run it: cuDNN's fused kernels (its get_attention_backend disables
    FlashAttention "to give FusedAttention preference on Hopper+"), at the GPU's `cudnn_attention_efficiency`
    where the catalogue has one (H100: 58% of the peak, against FlashAttention-2's 34%), with
    grouped-query attention of their own: a context-parallel ring moves the key/value heads, not
    copies repeated to the query heads (LayerProfile.attention_kv_unique_bytes). "triton":
    FlashAttention written in Triton, as llm-foundry's MPT runs it for ALiBi (attn_impl "triton"):
    FlashAttention-2's share over constants.TRITON_FLASH_SLOWDOWN (1.85)."""
    sdpa_cudnn: bool = False
    """The trainer's torch puts cuDNN's attention kernels first in scaled_dot_product_attention on
    the GPUs that prefer them (torch 2.11 on: constants.SDPA_CUDNN_FROM_TORCH, GPUSpec.attention_share):
    "sdpa" attention there runs at `cudnn_attention_efficiency`. Planning sets it from the torch
    installed (`plan run` runs the same); the bench from a row's publication month."""
    fp8_recipe: str = "torchao"
    """How FP8 training casts (precision fp8; fp4, NVFP4, is Transformer Engine's only: "te"). "torchao": torchao's Float8Linear, which this
    runtime and torchtitan run: every matmul operand cast at each use, weights in every forward
    and backward. "te": Transformer Engine, as Megatron-LM and NeMo run it: the weights cast (with
    their transpose) once per step after the optimizer and cached across the micro-batches, each
    forward input cast once and kept in FP8 for the weight gradient, each output gradient cast
    once with its transpose (cast_transpose) for both backward matmuls."""
    fp8_cast_scope: str = "linear"
    """What torch.compile sees of torchao's casts (fp8_recipe "torchao"), so which of them run once.
    "op": eager, every operand cast at each use: backward casts each output gradient twice (for
    the input and the weight gradients) and each input and weight again (torchao's
    float8_linear.py, matmul_with_hp_or_float8_args.backward). "linear": each Float8Linear compiled
    on its own, forward and backward one graph (this runtime: runtime/float8.py): AOTAutograd's
    common-subexpression pass (functorch config cse, on by default) merges identical casts, so each
    output gradient is cast once and backward reuses the forward's casts of the input and the
    weight. A trainer compiling whole layers (`compiled`) merges more: an input several Linears
    read (separate q, k and v projections) is cast once."""
    fp8_head: bool = True
    """Under FP8 (or NVFP4) the output projection (the head's Linear) runs in low precision too, as
    this runtime converts every Linear whose shape allows. False: it stays in 16 bits, casts and
    all, as torchtitan keeps it (torchtitan's Float8 converter swaps every Linear but the one named
    "output": module_filter_fn=lambda mod, fqn: fqn != "output") and Megatron-LM keeps it (its
    output_layer is Megatron's own ColumnParallelLinear, not a Transformer Engine module; Megatron-
    Bridge's performance guide: "The default low-precision LLM training recipe applies FP8
    computation exclusively to the linear layers within the Transformer block")."""
    tp_overlap_share: float = 1.0
    """With TP overlap (Candidate.tp_overlap), the share of the TP collectives its GEMMs hide where
    they last longer (comm.exposed_after_s). 1: Megatron-LM's --tp-comm-overlap (Transformer
    Engine's userbuffers). torchtitan's async TP: constants.ASYNC_TP_OVERLAP, what its published
    gains come to."""
    p2p_overlap: bool = False
    """Under the interleaved schedule, the trainer runs each chunk's pipeline sends and receives
    beside the next chunk's compute (Megatron-LM's overlap_p2p_comm: on by default with virtual
    stages since Megatron-Core's 2023 releases, --no-overlap-p2p-communication turns it off;
    Megatron-Bridge and NeMo set it whenever virtual stages are on, and batch the sends
    otherwise): exposed only past that compute (stage_costs._exposed_sends). False: sent between
    the compute, as torch's pipeline schedules (this runtime's, torchtitan's) and Megatron-LM
    before it (SC'21, Korthikanti et al. 2022) run them."""
    p2p_scatter_gather: bool = False
    """With tensor parallelism and no sequence parallelism, each TP rank sends 1/tp of the tensor
    that crosses a pipeline cut (replicated on the TP ranks) and the receiving ranks all-gather it:
    Megatron-LM's scatter/gather optimisation (Narayanan et al. 2021, sec. 4.1; on by default) and
    DeepSpeed's PipelineEngine, which partitions its first output and its gradient over the
    model-parallel group (is_pipe_partitioned, is_grad_partitioned). False: each rank sends what its
    stage returns, the whole tensor, as torch.distributed.pipelining (this runtime, torchtitan)
    does. With sequence parallelism every trainer's cut tensor is already the rank's 1/tp."""
    zero3_gathers: str = "layer"
    """What ZeRO-3 gathers (and reduce-scatters) with one collective, each paying its startup
    latency every micro-batch (AtomCost.gathers). "layer": a layer's parameters together (FSDP
    and FSDP2 wrapping each block, as this runtime, torchtitan and llm-foundry run it). "module":
    each module's own (DeepSpeed's ZeRO-3 since v0.5, September 2021, fetches each submodule's
    parameters with one coalesced all-gather: DeepSpeed PR 1188). "tensor": each parameter's
    (DeepSpeed's ZeRO-3 before it: one all-gather per parameter, DeepSpeed issue 1069)."""
    master_weights: bool = True
    """Mixed precision keeps an fp32 copy of the weights that the optimizer steps, its state in fp32
    (PyTorch AMP, FSDP2's MixedPrecisionPolicy over fp32 parameters, Megatron's and DeepSpeed's
    optimizers). False: the 16-bit parameters are stepped in place and the optimizer's state is
    in their dtype (a model loaded in bf16, as NeMo AutoModel trains it)."""
    loss_upcast: bool = True
    """The default loss (cross-entropy on the logits) runs on the logits cast to fp32, as
    F.cross_entropy(logits.float()) does and the profile measures it. False: on the 16-bit logits
    themselves (NeMo AutoModel's benchmark configs: MaskedCrossEntropy with fp32_upcast false):
    its log-softmax saved in their dtype (the logits' size, as a compiled loss keeps), and two
    gradients of the logits in it in backward (nll_loss's and log_softmax's)."""
    ep_dispatch: str = "all_to_all"
    """How expert parallelism moves tokens between nodes. "all_to_all": one all-to-all that sends each
    of a token's top-k rows to its expert's GPU, a row for every expert on another node crossing the
    network (torch's all_to_all_single: this runtime, torchtitan; Megatron-Core's alltoall
    dispatcher). "deepep": DeepSeek's dispatch and combine kernels (DeepSeek-V3, arXiv 2412.19437,
    Sec. 3.2.2; DeepEP; Megatron-Core's flex dispatcher; NeMo AutoModel): a token crosses the network
    once to each other node that holds any of its experts, to the GPU of its own in-node index,
    which forwards it over NVLink to the experts' GPUs, the network and NVLink traffic running at
    once (planner.cost.topology.deepep_all_to_all). Inside one node the two are the same."""
    expert_node_limit: int | None = None
    """The most nodes of its expert-parallel group a token's experts are chosen from: DeepSeek-V3's
    node-limited routing (at most 4 nodes, its Sec. 2.1.2; Hugging Face's topk_group), 1 for a router
    that picks k consecutive experts (NeMo AutoModel's FakeBalancedGate: expert i k + j for token
    i). None: a router's choice spread evenly over all the experts. What a "deepep" dispatch sends
    over the network depends on it."""
    trainer: str = "this"
    """The trainer the plan is for (TRAINERS: what it set above); "this": plan run's runtime."""

    @staticmethod
    def for_trainer(trainer: str, *args, **kwargs) -> "Training":
        """A Training as `trainer` runs it (TRAINERS), `kwargs` over its settings."""
        return Training(*args, **{**TRAINERS[trainer], **kwargs}, trainer=trainer)

    def bytes_per_param(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer state) bytes per parameter before any sharding.

        Mixed precision with AdamW: 2 + 2 + 12 (fp32 master copy, momentum, variance: ZeRO paper,
        Rajbhandari et al. 2020, Sec. 3.1, K = 12); SGD with momentum: 2 + 2 + 8 (master copy,
        momentum). fp32: AdamW 4 + 4 + 8, SGD 4 + 4 + 4. Without master weights (16-bit parameters
        stepped in place, the state in their dtype): AdamW 2 + 2 + 4, SGD 2 + 2 + 2.
        """
        mixed = self.precision != "fp32"
        w = g = 2 if mixed else 4
        if mixed and not self.master_weights:
            return w, g, {"adamw": 4, "sgd": 2}[self.optimizer]
        opt = {"adamw": 8, "sgd": 4}[self.optimizer] + (4 if mixed else 0)
        return w, g, opt

    def optimizer_traffic_per_param(self) -> int:
        """HBM bytes an optimizer step reads and writes per parameter (a memory-bound kernel):
        AdamW reads the gradient, master weight, momentum and variance and writes all but the
        gradient back, plus the 16-bit weight copy; SGD likewise without the variance. Transformer
        Engine's FP8 then casts the new weights once for the step: the 16-bit copy read twice
        (amax, cast), one FP8 byte written and one for its transpose (NVFP4: half a byte each)."""
        w, g, opt = self.bytes_per_param()
        low = {"fp8": 2, "fp4": 1}.get(self.precision, 0)
        te_cast = 2 * w + low if low and self.fp8_recipe == "te" else 0
        return g + 2 * opt + (w if self.precision != "fp32" else 0) + te_cast


@dataclass(frozen=True)
class Candidate:
    """One point of the discrete search space."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    zero: int
    """0: plain data parallel (DDP); 1: optimizer state sharded; 2: + gradients; 3: + parameters
    (FSDP full sharding)."""
    schedule: str
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B); 1 otherwise."""
    sequence_parallel: bool = False
    """With tp > 1: norms, dropout and residuals split along the sequence over the TP ranks
    (Korthikanti et al. 2022), their activations and work divided by tp; without it they run
    replicated on every TP rank. Same communication volume either way (all-gather +
    reduce-scatter in place of each all-reduce)."""
    tp_overlap: bool = False
    """With tp > 1 and sequence parallelism: TP's all-gathers and reduce-scatters run in chunks
    beside the Linear GEMMs they feed (Megatron-LM --tp-comm-overlap, torchtitan's async TP),
    exposed only where they outlast those GEMMs, and never below one chunk (1/tp of them)."""
    ep_overlap: bool = False
    """With ep > 1 and several micro-batches: one micro-batch's forward runs beside another's
    backward, layer by layer, so that each phase's expert all-to-alls run beside the other phase's
    compute (Megatron-Core's combined 1F1B, --overlap-moe-expert-parallel-comm; DeepSeek-V3's
    DualPipe), exposed only where they outlast it. The micro-batches of the warm-up and cool-down,
    which have no partner (one each way without a pipeline, pp - 1 with one), are priced as the
    rest."""
    dp_replicate: int = 1
    """HSDP (ZeRO-2/3 only): the dp ranks form dp_replicate groups of dp_shard = dp / dp_replicate
    (one node's data-parallel ranks); FSDP shards inside a group, and the groups hold replicas
    whose gradients are all-reduced across nodes (FSDP2 on a 2-D mesh, torchtitan's
    data_parallel_replicate_degree). 1: one shard group over all dp ranks."""
    cp: int = 1
    """Context parallelism: each sample's sequence split over cp ranks (ranks ordered tp fastest,
    then cp, then dp, then pp, as torchtitan's mesh), every fused attention a ring over their keys
    and values (torch's context_parallel, load-balanced for causal attention). The cp ranks hold
    the same weights: gradients are averaged, and ZeRO shards, over dp x cp ranks (torchtitan's
    dp_shard_cp mesh). The batch is split over dp only."""
    ep: int = 1
    """Expert parallelism (mixture-of-experts models): each MoE block's experts split over ep
    consecutive ranks of a pipeline stage, cp and tp ranks included (ep divides dp x cp x tp; no
    HSDP, as the runtime runs it: Megatron-Core's MoE parallel folding, torchtitan's EP borrowing
    the tp ranks), tokens sent to their experts and back with two all-to-alls per block in forward
    and two in backward. An expert's weights are held by dp x cp x tp / ep ranks
    (`expert_replicas`), which average its gradients and over which ZeRO shards its state. Each cp
    rank routes its own sequence shard (a block of tokens as a dp rank's are); with tp > 1 (and
    sequence parallelism, which it needs) tensor parallelism leaves the MoE blocks whole
    (TPInfo.under_ep): each tp rank routes its own 1/tp of the tokens."""

    @property
    def grad_ranks(self) -> int:
        """The ranks that hold the same weights and average their gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """The ranks ZeRO shards over: dp x cp, or one HSDP group of them."""
        return self.grad_ranks // self.dp_replicate

    @property
    def expert_replicas(self) -> int:
        """The ranks that hold the same experts (ZeRO's group for their state): dp_shard (dp x cp) x tp / ep."""
        return self.dp_shard * self.tp // self.ep

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def label(self) -> str:
        sched = self.schedule if self.pp > 1 else "no pipeline"
        if self.schedule == "interleaved" and self.pp > 1:
            sched += f" x{self.virtual_stages}"
        if self.tp > 1:
            sched += " · SP" if self.sequence_parallel else " · no SP"
            sched += " · TP overlap" if self.tp_overlap else ""
        sched += " · EP overlap" if self.ep_overlap and self.ep > 1 else ""
        hsdp = f" · HSDP {self.dp_replicate} x {self.dp_shard}" if self.dp_replicate > 1 else ""
        cp = (f" cp={self.cp}" if self.cp > 1 else "") + (f" ep={self.ep}" if self.ep > 1 else "")
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp}{cp} · micro-batch {self.micro_batch} x "
            f"{self.num_microbatches} · {sched} · ZeRO-{self.zero}{hsdp}"
        )
