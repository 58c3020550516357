"""ModelProfile: what the profiler knows about a model, the input of the search.

All FLOPs and bytes are for the profiled batch (`batch_size` samples); divide by it for per-sample
figures (the `per_sample` helpers do). Times are seconds on the device that measured them, or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from planner import schema

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True)
class LayerProfile:
    """One schedulable block, in execution order."""

    index: int
    name: str
    """Qualified name of the block (``transformer.h.3``), or of its first module when merged."""
    modules: tuple[str, ...]
    """The modules this layer is made of (parameter-free neighbours are merged in)."""
    kind: str
    """Identical layers (same module types, parameter shapes and measured costs) share a kind."""
    num_params: int
    param_bytes: int
    fwd_flops: int
    bwd_flops: int
    activation_bytes: int
    """Bytes of tensors this layer saves for backward (deduplicated by storage, parameters excluded)."""
    output_bytes: int
    """Bytes of the tensors that cross a pipeline cut right after this layer."""
    cut_after_ok: bool
    """Whether a pipeline stage may end after this layer: what crosses the cut is exactly what
    this layer returned (a tensor or a tuple), so the next stage can start from it alone; or the
    model's ``pipeline_split`` is "traced": torch.distributed.pipelining's tracer splits it there
    and sends whatever crosses (masks, position embeddings, ...; all counted in output_bytes)."""
    fwd_s: Optional[float] = None
    bwd_s: Optional[float] = None
    cut_plain: Optional[bool] = None
    """Whether what crosses the cut after this layer is exactly what it returned (a split there
    needs no tracer), whatever cut_after_ok says. None in profiles made before the field: read
    as cut_after_ok where the split is sequential."""
    # -- what the cost model needs beyond the headline figures --------------------------------
    activation_matmul_bytes: int = 0
    """Bytes of the forward's matmul-like outputs: what selective recompute (save matmuls, recompute
    the rest) keeps besides the layer's input. Every such output, including those autograd would
    not save, as PyTorch's selective checkpointing policy stores them all."""
    fwd_matmul_io_bytes: int = 0
    """Bytes read and written by the forward's matmul-like ops (their arithmetic intensity)."""
    fwd_other_io_bytes: int = 0
    """Bytes read and written by the forward's other ops: memory-bound work."""
    bwd_matmul_io_bytes: int = 0
    bwd_other_io_bytes: int = 0
    fwd_fused_io_bytes: int = 0
    """What fwd_other_io_bytes comes to were each chain of memory-bound ops one fused kernel
    (Transformer Engine's and Megatron-LM's kernels, torch.compile's): the tensors each chain reads
    from outside it and writes for a matmul, the next unit or no reader (trace._Fusion). 0 in a
    profile from before it: read as fwd_other_io_bytes. bwd_fused_io_bytes likewise."""
    bwd_fused_io_bytes: int = 0
    fwd_ops: int = 0
    """Ops that move data in the forward (each a kernel launch on a GPU); bwd_ops likewise."""
    bwd_ops: int = 0
    tp: Optional["TPInfo"] = None
    """How tensor parallelism splits this layer, or None when it cannot."""
    linears: tuple[tuple[int, int, int, str], ...] = ()
    """Its nn.Linear matmuls: (rows over the forward's calls at the profiled batch, out features,
    in features, "col" | "row" | "": which side tensor parallelism splits, per `tp`, after "moe:"
    inside a mixture-of-experts block, which expert parallelism leaves whole); the cost
    model reads the shapes' speed from a measured table (planner.cost.gemm_shapes)."""
    # -- what tensor parallelism splits without sequence parallelism -----------------------------
    activation_tp_bytes: int = 0
    """Of activation_bytes, the tensors made inside a column-wise -> row-wise region (from a
    column-wise Linear's output up to the row-wise Linear): split by TP with or without sequence
    parallelism. The rest (norms, residuals, dropout, the column-wise inputs) is split only with
    it (Korthikanti et al. 2022: sbh(10 + 24/t + 5as/(ht)) without, sbh(34 + 5as/h)/t with)."""
    activation_matmul_tp_bytes: int = 0
    """Of activation_matmul_bytes, the outputs made inside such a region."""
    fwd_other_io_tp_bytes: int = 0
    """Of fwd_other_io_bytes, the memory-bound traffic inside such a region."""
    # -- what FP8 training converts -------------------------------------------------------------
    fwd_linear_flops: int = 0
    """Of fwd_flops, the Linear layers' matmuls (FP8 training runs them at the FP8 rate)."""
    bwd_linear_flops: int = 0
    fwd_linear_operand_bytes: int = 0
    """Bytes of those matmuls' 16-bit operands (inputs and weights), what FP8 training casts."""
    bwd_linear_operand_bytes: int = 0
    fwd_linear_weight_bytes: int = 0
    """Of fwd_linear_operand_bytes, the weights': the same whatever the micro-batch (0 in a profile
    from before the split, which then scales them with it)."""
    bwd_linear_weight_bytes: int = 0
    fwd_grouped_flops: int = 0
    """Of fwd_flops, grouped GEMMs' (a mixture of experts' experts run as one kernel per
    projection): 8-bit under Transformer Engine's FP8 (its GroupedLinear), 16-bit under torchao's."""
    bwd_grouped_flops: int = 0
    fwd_grouped_operand_bytes: int = 0
    """Bytes of those GEMMs' operands other than the experts' weights, what that FP8 casts."""
    bwd_grouped_operand_bytes: int = 0
    grouped_gemms: tuple[tuple[int, int, int, int], ...] = ()
    """Its grouped GEMMs by shape: (rows of all groups over the forward's calls at the profiled
    batch, out features n, in features k, groups), each group's rows x k @ k x n; the cost model
    reads a group's GEMM speed from the measured table as the Linears' (planner.cost.gemm_shapes)."""
    # -- what the alternate recompute policy keeps and recomputes ---------------------------------
    activation_alternate_bytes: Optional[int] = None
    """Of activation_matmul_bytes, what the alternate policy (torchtitan's per-op selective
    checkpointing) keeps: the outputs of matmul-like ops except every second Linear matmul.
    None in a profile written before the policy existed: read as activation_matmul_bytes."""
    activation_alternate_tp_bytes: Optional[int] = None
    """Of activation_alternate_bytes, the outputs made inside a column-wise -> row-wise region."""
    activation_fused_bytes: Optional[int] = None
    """What activation_bytes comes to where each chain of memory-bound ops is one fused kernel
    (Training.fused_kernels: Transformer Engine's and Megatron's kernels, torch.compile's): a
    kernel saves the tensors it read from outside it, not those it made and read itself (a norm's
    fp32 copy, SiLU's output inside SwiGLU). None in a profile written before it: as
    activation_bytes."""
    activation_fused_tp_bytes: Optional[int] = None
    """Of activation_fused_bytes, what tensor parallelism splits (as activation_tp_bytes)."""
    activation_linear_input_bytes: Optional[int] = None
    """Of activation_bytes, the inputs of Linear (and grouped) matmuls that only those matmuls
    save for backward: what Transformer Engine's FP8 and NVFP4 Linears keep quantized instead
    (each caches its own low-precision copy of its input for the weight gradient, the 16-bit one
    freed). None in a profile written before it: nothing replaced."""
    activation_linear_input_tp_bytes: Optional[int] = None
    """Of activation_linear_input_bytes, what tensor parallelism splits (as activation_tp_bytes)."""
    activation_linear_input_copies: Optional[int] = None
    """activation_linear_input_bytes counted once per matmul that saved it: the inputs several
    Linears read (a model's separate q, k and v projections) are cached once by each."""
    fwd_alternate_flops: int = 0
    """FLOPs of the Linear matmuls the alternate policy recomputes (every second one)."""
    fwd_alternate_io_bytes: int = 0
    """Bytes those matmuls read and write."""
    fwd_selective_flops: int = 0
    """FLOPs of the matmul-like ops selective (and alternate) recompute reruns: an unfused
    attention's batched matmuls (Q K^T, scores x V), which Megatron-LM's selective recompute and
    the save-matmuls policy drop with the attention core."""
    fwd_selective_io_bytes: int = 0
    """Bytes those ops read and write."""
    # -- what full recompute does not rerun -------------------------------------------------------
    # The forward's work after the last tensor it saves for backward (trace._Tail): torch's
    # non-reentrant checkpoint stops its rerun there, and a compiled recompute reruns only what
    # backward reads (a block's last matmul and residual add are not rerun). Of the fwd_ figures.
    fwd_tail_flops: int = 0
    fwd_tail_matmul_io_bytes: int = 0
    fwd_tail_other_io_bytes: int = 0
    fwd_tail_ops: int = 0
    fwd_tail_linear_flops: int = 0
    fwd_tail_attention_flops: int = 0
    fwd_tail_causal_attention_flops: int = 0
    fwd_tail_alternate_flops: int = 0
    """Of fwd_alternate_flops, in the tail: the alternate policy does not rerun them either."""
    fwd_tail_alternate_io_bytes: int = 0
    fwd_tail_rowwise_linears: int = 0
    """Row-wise Linear matmuls in the tail: their TP collectives are not rerun either."""
    activation_matmul_tail_bytes: int = 0
    """Of activation_matmul_bytes, the outputs of the tail's matmul-like ops (a block's last
    Linear, whose output only a residual add reads): selective checkpointing keeps them, backward
    reads them nowhere, and a compiled graph's partitioner does not keep them (Training.compiled)."""
    activation_alternate_tail_bytes: int = 0
    """Of activation_alternate_bytes, likewise."""
    tp_role: Optional["TPRole"] = None
    """What tensor parallelism does to this layer besides its TPInfo (tp_roles.py); None when the
    model has no TPInfo, or its roles could not be found."""
    # -- what context parallelism exchanges -------------------------------------------------------
    fwd_attention_flops: int = 0
    """Of fwd_flops, the fused attention kernels' (scaled_dot_product_attention)."""
    bwd_attention_flops: int = 0
    fwd_causal_attention_flops: int = 0
    """Of fwd_attention_flops, the calls with a causal mask: counted whole (the MFU convention of
    Megatron-LM and PaLM), though the kernels skip the masked half (the cost model's time)."""
    bwd_causal_attention_flops: int = 0
    attention_kv_bytes: int = 0
    """Bytes of the keys and values those kernels read in forward: what a context-parallel ring
    passes around (each rank's shard to every other rank of the group)."""
    attention_kv_unique_bytes: int = 0
    """Of those, the key/value heads themselves: less where grouped-query attention repeats them for
    the kernel (repeat_interleave, HF's repeat_kv), which a kernel with grouped-query attention of
    its own (Transformer Engine's) does not, nor its ring. 0: not recorded (an older profile)."""
    # -- what expert parallelism splits (mixture-of-experts blocks: moe.py) ----------------------
    moe_experts: int = 0
    """Experts of each mixture-of-experts block in this layer (the gcd when its blocks differ;
    0: none): the expert-parallel degree must divide it."""
    moe_top_k: int = 0
    """Experts each token is sent to (the block's top-k: its attribute, else rows / tokens
    measured); 0 when unknown or no MoE."""
    expert_params: int = 0
    """Of num_params, those of the experts: what expert parallelism divides."""
    moe_dispatch_bytes: int = 0
    """Bytes of the rows the forward sends into the experts (each token once per expert it
    chose), for the profiled batch: what each of expert parallelism's all-to-alls moves."""
    # -- how a ZeRO-3 trainer may gather them (Training.zero3_gathers) ---------------------------
    param_tensors: int = 0
    """Parameter tensors of this layer (0: a profile from before the field)."""
    param_modules: int = 0
    """Modules that hold this layer's parameters directly (0: a profile from before the field)."""


@dataclass(frozen=True)
class TPInfo:
    """Megatron-style tensor parallelism of a layer (column-wise then row-wise Linear pairs)."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    sharded_params: int
    """Parameters divided by the TP degree (the rest, norms and row-wise biases, are replicated)."""
    allreduce_bytes: int
    """Bytes all-reduced per forward (the row-wise outputs, for the profiled batch); as many in backward."""
    divisors: tuple[int, ...]
    """The TP degree must divide each (head counts, sharded feature sizes)."""
    required: bool = True
    """False for a vocabulary-parallel embedding or head: with a TP degree that does not divide the
    vocabulary it is replicated instead, where a block that cannot be split rules the degree out."""
    moe: tuple[str, ...] = ()
    """The mixture-of-experts blocks in this layer (the modules holding a router and its experts,
    planner.profile.moe; names relative to the layer). With expert parallelism tensor parallelism
    leaves them whole (`under_ep`): EP splits their experts, not TP (torchtitan's ETP = 1)."""
    moe_sharded_params: int = 0
    """Of sharded_params, those of Linears inside `moe` (an expert's pair, a shared expert's)."""
    moe_allreduce_bytes: int = 0
    """Of allreduce_bytes, those of row-wise Linears inside `moe`."""

    def legal(self, tp: int) -> bool:
        return all(d % tp == 0 for d in self.divisors)

    def under_ep(self) -> "TPInfo":
        """The split with expert parallelism (ep > 1): the Linears inside the mixture-of-experts
        blocks stay whole (out of colwise / rowwise, their parameters and all-reduced bytes too),
        the rest as it is. The divisors keep their sizes (a tp they rule out stays out)."""
        if not self.moe:
            return self

        def kept(name: str) -> bool:
            return not any(m == "" or name == m or name.startswith(m + ".") for m in self.moe)

        return TPInfo(
            tuple(c for c in self.colwise if kept(c)), tuple(r for r in self.rowwise if kept(r)),
            self.sharded_params - self.moe_sharded_params, self.allreduce_bytes - self.moe_allreduce_bytes,
            self.divisors, self.required,
        )


NO_BLOCK = "the model has no block with a column/row-wise Linear pair"
"""The sp_blocker of a model where only embeddings and the head split (nothing to run sequence-parallel)."""


def moe_sp_blocker(layers: Iterable[tuple[str, Optional[TPInfo]]], ep: int) -> str:
    """Why sequence parallelism cannot run at expert-parallel degree `ep` on account of the
    mixture-of-experts blocks of `layers` ((name, TPInfo) pairs), "" when they do not stop it.

    A layer's TPRole.sp_blocker is found with its MoE blocks run as expert parallelism with tensor
    parallelism runs them: each tp rank's own sequence shard routed through the experts, which stay
    whole (TPInfo.under_ep). Without EP (ep 1) tensor parallelism splits a list of experts' Linears,
    which see routed rows, not [batch, seq, hidden], and the runtime runs no MoE block on the shards."""
    if ep > 1:
        return ""
    for name, tp in layers:
        if tp is not None and tp.moe:
            block = ".".join(p for p in (name, tp.moe[0]) if p)
            return (f"the mixture-of-experts block {block} runs on the sequence shards only with expert "
                    "parallelism (ep > 1), which keeps its experts whole")
    return ""


@dataclass(frozen=True)
class TPRole:
    """How tensor parallelism treats one layer besides its TPInfo (names relative to the layer,
    but shard_dropout's, which are the model's): found by tp_roles.py on fake tensors."""

    kind: str
    """"embedding", "block", "norm", "head" or "other"."""
    seq_len: Optional[int] = None
    """The model's sequence length (the second dim of its 2-D integer input), None without one."""
    seq_dim: Optional[int] = None
    """embedding: the dim of its output that is the sequence (1 for [batch, seq, hidden], 0 for
    position embeddings [seq, hidden]); None when it has none."""
    norms: tuple[str, ...] = ()
    """block: norm-like submodules on the hidden states, run sequence-parallel."""
    norm_params: int = 0
    """block: the parameter tensors of `norms`: with sequence parallelism each one's gradient is
    all-reduced over the TP group in backward (0 in a profile from before the count: one per norm)."""
    gathers: tuple[str, ...] = ()
    """block: submodules whose one input feeds all their column-wise Linears: gathered once."""
    gather_kwargs: tuple[tuple[str, str], ...] = ()
    """block: (gathered submodule, the keyword it takes the hidden states by) for those of
    `gathers` called with them as a keyword argument (Hugging Face's ``self_attn(hidden_states=...)``);
    the others take them as their first positional argument."""
    shard_at: str = ""
    """The block whose input is cut to this rank's sequence shard under sequence parallelism ("":
    the embeddings hand on their shards). Set where the model computes from the embeddings' sequence
    length (Hugging Face's cache positions, masks and rotary tables): the embeddings hand on their
    whole output and the first block takes its shard (tp_roles.sp_check). The same in every layer."""
    sp_blocker: str = ""
    """Why sequence parallelism cannot run in this model ("" when it can): the same in every layer,
    so every pipeline stage, which sees only its own layers, decides the same. Found with the
    mixture-of-experts blocks (TPInfo.moe) as expert parallelism runs them, on the sequence shards;
    without EP they block it too (`moe_sp_blocker`)."""
    tied: str = ""
    """embedding/head: the parameter of another layer that shares its weight ("" when none)."""
    loss_blocker: str = ""
    """head: why its logits cannot stay vocabulary-sharded into the loss ("" when they can)."""
    shard_dropout: tuple[str, ...] = ()
    """Dropout modules (p > 0) that with sequence parallelism run on each rank's sequence shard:
    this layer's, and those called after it before the next layer (glue), by their names in the model."""
    local_heads: tuple[str, ...] = ()
    """block: attributes of its modules ("sub.attr", relative to the layer) that count heads and
    size its views (OPT's ``self.num_heads``): the runtime divides each by the TP degree, so a rank
    views its shard as its own heads (tp_roles.split_check)."""
    cloned: tuple[str, ...] = ()
    """The modules of this layer that tensor parallelism converts (a block's column- and row-wise
    Linears; "" for an embedding or head itself) whose output the model writes in place (Falcon's
    `mlp_output += attention_output`): DTensor hands their outputs on as views of its own autograd
    function, which autograd forbids writing in place, so the runtime hands on a copy."""
    split_blocker: str = ""
    """Why a layer with a TPInfo cannot run split: a block whose forward on fake tensors fails or
    gives other shapes with its Linear pairs split (tp_roles.split_blocker), an embedding that looks
    up indices other than its input (tp_roles.lookup_blocker). The profiler takes its TPInfo away,
    so tensor parallelism leaves it whole on every rank."""


@dataclass(frozen=True)
class ProfileTotals:
    num_params: int
    param_bytes: int
    fwd_flops: int
    bwd_flops: int
    activation_bytes: int
    fwd_s: Optional[float]
    bwd_s: Optional[float]


@dataclass(frozen=True)
class Edge:
    """A tensor produced by layer `src` and consumed by layer `dst` (src < dst)."""

    src: int
    dst: int
    num_bytes: int


@dataclass(frozen=True)
class ModelProfile(schema.Versioned):
    SCHEMA = "planner.ModelProfile"
    VERSION = 1

    model_name: str
    source_sha256: str
    batch_size: int
    dtype: str
    mode: str
    """``materialized`` (real tensors, timed on `device`) or ``meta`` (fake tensors, no timings)."""
    device: str
    input_shapes: dict[str, tuple[int, ...]]
    seq_len: Optional[int]
    layers: tuple[LayerProfile, ...]
    edges: tuple[Edge, ...]
    totals: ProfileTotals
    uncounted_ops: tuple[str, ...] = ()
    """Ops that ran but have no FLOP formula (their FLOPs count as 0)."""
    warnings: tuple[str, ...] = ()
    profile_s: float = 0.0
    num_threads: Optional[int] = None
    """torch's intra-op threads when the times were measured (None: not timed)."""
    thread_speedup: Optional[float] = None
    """The step's measured seconds with one thread over those with num_threads (None: not timed,
    or timed with one thread): how this model's time grows when processes share the cores."""
    pipeline_split: str = "sequential"
    """How the runtime splits this model into pipeline stages: "sequential" (the valid cuts hand
    over one layer's output; the tracer was not needed, or it failed and some such cuts remain;
    profiles made before this field existed read so), "traced" (some cuts carry other tensors
    too: torch.distributed.pipelining's tracer splits the model, and it succeeded on the
    meta-built model at every layer boundary, so every cut is valid) or "none" (no valid cut: the
    tracer failed, see pipeline_split_note). The tracer is tried only when a cut next to a block
    of a stack (ModuleList/Sequential) is not a plain hand-over."""
    pipeline_split_note: Optional[str] = None
    """Why the tracer could not split the model (one line), when it was tried and failed."""
    cp_blocker: Optional[str] = None
    """Why context parallelism (the sequence split over ranks, attention as a ring: torch's
    context_parallel) cannot run on this model, "" when it can; None in a profile made before the
    profiler looked (read as blocked)."""
    output_bytes: Optional[int] = None
    """The model's output (what the loss takes: the logits of a language model) at this profile's
    batch; None: not measured (a profile made before)."""
    loss_working_bytes: Optional[int] = None
    """What the loss holds at its peak beyond what its forward leaves alive for backward, at this
    profile's batch (trace.loss_memory): the gradient of the model's output and the loss's
    temporaries (F.cross_entropy on logits.float(): two fp32 copies of the logits). None: not
    measured (the cost model then counts two copies of the last layer's activations)."""
    loss_saved_bytes: Optional[int] = None
    """What the loss's forward leaves alive for backward, at this profile's batch
    (trace.loss_memory; counted in the last layer's activations too): F.cross_entropy on
    logits.float() keeps the fp32 log-probabilities. None: not measured."""
    own_loss: bool = False
    """The model file defines loss_fn (False: the default loss, which a trainer may run fused:
    Training.fused_loss)."""
    schema: str = field(default="planner.ModelProfile")
    version: int = field(default=1)

    # -- derived views ------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return self.totals.num_params

    @property
    def timed(self) -> bool:
        return all(layer.fwd_s is not None for layer in self.layers)

    def kinds(self) -> dict[str, list[int]]:
        """Kind -> indices of the layers of that kind, in order."""
        out: dict[str, list[int]] = {}
        for layer in self.layers:
            out.setdefault(layer.kind, []).append(layer.index)
        return out

    def per_sample(self, value: float) -> float:
        return value / self.batch_size

    def graph(self) -> nx.DiGraph:
        """Layers as nodes (with their profile as attributes), tensors between them as edges."""
        import networkx as nx  # here: its import takes 0.4 s of every `plan`, and only this reads it

        g = nx.DiGraph()
        for layer in self.layers:
            g.add_node(layer.index, name=layer.name, kind=layer.kind)
        for e in self.edges:
            if g.has_edge(e.src, e.dst):
                g[e.src][e.dst]["num_bytes"] += e.num_bytes
            else:
                g.add_edge(e.src, e.dst, num_bytes=e.num_bytes)
        return g

    def cut_points(self) -> list[int]:
        """Indices i such that a pipeline stage may end after layer i."""
        return [layer.index for layer in self.layers[:-1] if layer.cut_after_ok]

    def tracer_splits(self, tp: int) -> bool:
        """Whether the runtime splits this model with the pipelining tracer, at any valid cut: only
        a "traced" profile (the profiler ran the tracer wherever a cut is not followed by a plain
        sequence of layers, and it succeeded) without tensor parallelism (the runtime applies TP
        only to stages it splits itself). Otherwise stages run as a plain sequence of layers from
        the first cut on."""
        return self.pipeline_split == "traced" and tp == 1

    def pipeline_cuts(self, tp: int) -> list[int]:
        """The cuts the runtime can split this model at with tensor-parallel degree `tp`: every
        valid cut under the tracer, else those from which the layers run in sequence."""
        cuts = self.cut_points()
        return cuts if self.tracer_splits(tp) else [i for i in cuts if i >= self.plain_from()]

    @property
    def sp_blocker(self) -> Optional[str]:
        """Why sequence parallelism cannot run on this model without expert parallelism ("" when it
        can; NO_BLOCK when there is nothing to split); None when the profile has no TP roles (none
        found, or an old file). `sp_blocker_at` for an expert-parallel degree."""
        return self.sp_blocker_at(1)

    def sp_blocker_at(self, ep: int) -> Optional[str]:
        """`sp_blocker` with expert parallelism of degree `ep` (mixture-of-experts blocks run on the
        sequence shards only with ep > 1: `moe_sp_blocker`)."""
        roles = [layer.tp_role for layer in self.layers if layer.tp is not None]
        if not roles or any(r is None for r in roles):
            return None
        return roles[0].sp_blocker or moe_sp_blocker(((l.name, l.tp) for l in self.layers), ep)  # type: ignore[union-attr]

    def plain_from(self) -> int:
        """The first layer index i from which every cut (after i, i + 1, ...) is a plain hand-over:
        a pipeline whose first stage ends at or after layer i runs its stages as a plain sequence
        of layers, without the tracer (the runtime's tensor parallelism needs that)."""
        return plain_from(self.layers, self.pipeline_split)


def plain_from(layers: Sequence[LayerProfile], pipeline_split: str = "sequential") -> int:
    """ModelProfile.plain_from over `layers` (a profile's, or the profiler's before it is made)."""
    start = len(layers) - 1
    for layer in reversed(layers[:-1]):
        plain = layer.cut_plain if layer.cut_plain is not None else (layer.cut_after_ok and pipeline_split != "traced")
        if not plain:
            break
        start = layer.index
    return start

