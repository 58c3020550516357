"""Context parallelism (CP) as PyTorch runs it, made to run on CPU with gloo as well.

CP shards the sequence of every activation over the ranks of a CP mesh and runs attention as ring
attention: each rank keeps its query shard and sees every key/value shard in turn, merging the
partial results by their logsumexp. PyTorch implements this in
``torch.distributed.tensor.experimental.context_parallel``: it monkey-patches
``F.scaled_dot_product_attention`` to wrap q/k/v in DTensors sharded on the sequence (dim 2), and a
DTensor custom-op handler turns the SDPA kernel that the dispatcher picks into
``_templated_ring_attention`` (and its backward). It also re-orders the sequence for causal masks
("head-tail" load balancing: rank r holds chunks r and 2*cp-1-r of 2*cp chunks) so every rank does
the same amount of attention work.

Torch only wires up the CUDA kernels (flash, memory-efficient, cuDNN). On CPU, SDPA dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``..._for_cpu_backward``), which has no
DTensor sharding strategy and no CP handler, so CP fails with "does not have a sharding strategy
registered". ``support_cpu_sdpa`` registers both: the strategies mirror torch's CUDA flash ones
(replicate, heads, batch, plus the CP-only sequence shard), and the handlers call torch's own
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU kernel, which
returns (out, logsumexp) exactly as the CUDA flash kernel does, so torch's ring, merger and load
balancing are reused unchanged.

``sequence_sharded`` is the per-step entry point: it shards the caller's sequence tensors in place
(load-balanced order) and runs the step's forward and backward with CP attention, leaving no state
behind so it can be entered once per step for a whole run.

Torch internals touched (all in ``torch.distributed.tensor.experimental._context_parallel``):
``_attention.custom_ops`` (two entries added; torch merges it into the DTensor dispatcher's custom
handlers when CP is entered), ``_attention._templated_ring_attention[_backward]``,
``_attention._cp_options`` (rotate method, load balancing), ``_attention._replaced_functions``
(cleaned of the stale SDPA wrappers torch leaves there on every exit),
``_sharding_rules._op_strategy_context`` / ``_cp_strategy_contexts`` (our strategies are registered
with torch's own helper into torch's table, so torch's ``unregister_cp_sharding_rules`` removes them
again when CP is left), and ``DTensor._op_dispatcher._custom_op_handlers``.

Tried on torch 2.13 (gloo, 2 and 4 ranks): causal and non-causal (the latter without load
balancing, as torch requires), ``scale``, ``enable_gqa`` (fewer kv heads), odd and large head dims,
fp32 and bf16 all match one process; "allgather" and "alltoall" rotation both work. Not supported,
as in torch's CUDA CP: ``attn_mask`` (fails in torch's SDPA wrapper) and attention dropout
(dropout_p > 0 makes CPU SDPA take the math kernel, which DTensor cannot run on sequence shards).
The sequence length must split into 2 * cp equal chunks (cp without load balancing).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves, tree_map

from planner.plan import Plan
from planner.profile.materialize import one_sequence_per_row, packed_rows
from runtime.phases import CP_SCOPE, scope

log = logging.getLogger(__name__)

__all__ = ["CP_TORCH_VERSION", "ContextParallel", "load_balanced_order", "sequence_sharded", "support_cpu_sdpa"]

aten = torch.ops.aten

#: The torch release this module was verified against; older ones lack pieces it relies on.
CP_TORCH_VERSION = "2.13"

# Torch's CP always shards q/k/v [batch, heads, seq, head_dim] on dim 2 (hard-coded in torch too).
_SEQ_DIM = 2

# Rotation of the key/value shards around the ring (torch's set_rotate_method; sequence_sharded
# sets it per step). "allgather" (torch's default) gathers all kv shards with one
# all_gather_into_tensor per attention call; "alltoall" passes them on with all_to_all_single, one
# collective per ring step. Both run on gloo (tested on 2.13), and torch's
# backward always uses all-to-all for the kv gradients whatever is chosen here. We pin "allgather":
# it is the fewest collectives (gloo collectives are synchronous, so there is no compute/transfer
# overlap for the ring to gain), and pinning it keeps a run independent of whatever another caller
# left in torch's process-wide option (restored on exit).


@dataclass(frozen=True)
class _TorchCP:
    """The torch internals this module needs, looked up once (see the module docstring)."""

    attention: ModuleType
    sharding_rules: ModuleType
    expand_to_full_mesh_op_strategy: Callable[..., Any]
    forward_op: torch._ops.OpOverload
    backward_op: torch._ops.OpOverload


_torch_cp: _TorchCP | None = None


def _torch_internals() -> _TorchCP:
    """Find the torch internals, or fail with one clear error on a torch that lacks them."""
    global _torch_cp
    if _torch_cp is not None:
        return _torch_cp
    try:
        from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
        from torch.distributed.tensor.experimental._context_parallel import _attention, _sharding_rules

        needed = {
            _attention: ("custom_ops", "existing_custom_ops", "_templated_ring_attention",
                         "_templated_ring_attention_backward", "_cp_options", "_replaced_functions",
                         "context_parallel", "_RotateMethod"),
            _sharding_rules: ("_op_strategy_context", "_cp_strategy_contexts", "SEQ_DIM"),
        }
        missing = [f"{m.__name__}.{a}" for m, names in needed.items() for a in names if not hasattr(m, a)]
        forward_op = aten._scaled_dot_product_flash_attention_for_cpu.default
        backward_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        ring = inspect.signature(_attention._templated_ring_attention).parameters
        ring_bwd = inspect.signature(_attention._templated_ring_attention_backward).parameters
        if list(ring)[:6] != ["group", "seq_dim", "op", "query", "key", "value"] or "grad_out_name" not in ring_bwd:
            missing.append("the ring attention signatures of torch 2.13")
        if getattr(_sharding_rules, "SEQ_DIM", _SEQ_DIM) != _SEQ_DIM:
            missing.append(f"sequence dim {_SEQ_DIM}")
    except (ImportError, AttributeError) as e:
        missing = [str(e)]
    if missing:
        raise RuntimeError(
            f"context parallelism on CPU needs the CPU SDPA support of torch >= {CP_TORCH_VERSION} "
            f"(this is torch {torch.__version__}; missing: {', '.join(missing)})"
        )
    _torch_cp = _TorchCP(_attention, _sharding_rules, expand_to_full_mesh_op_strategy, forward_op, backward_op)
    return _torch_cp


# ---------------------------------------------------------------------------------------------
# Sharding strategies: the CUDA flash ones (torch.distributed.tensor._ops._matrix_ops and
# _context_parallel._sharding_rules) with the CPU kernel's shorter outputs: (out, logsumexp)
# instead of 9 outputs, and no cum_seq/philox inputs. logsumexp is [batch, heads, seq] as on CUDA.
# ---------------------------------------------------------------------------------------------


def _forward_strategy(op_schema: Any) -> Any:
    """q, k, v -> out, logsumexp: replicated, sharded on heads, on batch, or (CP) on the sequence."""
    cp = _torch_internals()
    placements = _placement_lists(n_outputs=2, n_inputs=3)  # attn_mask is refused before this
    mesh = op_schema.get_mesh_from_args()
    return cp.expand_to_full_mesh_op_strategy(mesh, op_schema, placements, input_index=2)


def _backward_strategy(op_schema: Any) -> Any:
    """grad_out, q, k, v, out, logsumexp -> grad q, k, v: the same four shardings as forward."""
    cp = _torch_internals()
    placements = _placement_lists(n_outputs=3, n_inputs=6)
    mesh = op_schema.get_mesh_from_args(validate=False)  # as torch: forward already validated it
    return cp.expand_to_full_mesh_op_strategy(mesh, op_schema, placements, input_index=3)


def _placement_lists(n_outputs: int, n_inputs: int) -> list[list[Any]]:
    """[outputs..., inputs...] for one mesh dim; every tensor is [batch, heads, seq(, dim)], so
    each strategy places all of them alike."""
    from torch.distributed.tensor import Replicate, Shard

    return [[p] * (n_outputs + n_inputs) for p in (Replicate(), Shard(1), Shard(0), Shard(_SEQ_DIM))]


def _register_strategies() -> None:
    """Register our strategies in torch's CP table, with torch's helper, while CP is on.

    Torch registers its sequence-sharded strategies only while CP is active (Shard(2) is wrong for
    SDPA outside ring attention) and ``unregister_cp_sharding_rules`` exits every context in
    ``_cp_strategy_contexts`` when CP is left. Adding ours to that table makes torch remove them at
    the same moment. Called from the handlers, so it runs only under CP and re-registers after
    every re-entry.
    """
    cp = _torch_internals()
    table = cp.sharding_rules._cp_strategy_contexts  # torch rebinds it on unregister: look up each time
    for op, strategy in ((cp.forward_op, _forward_strategy), (cp.backward_op, _backward_strategy)):
        if op not in table:
            ctx = cp.sharding_rules._op_strategy_context(op, strategy, None)
            ctx.__enter__()
            table[op] = ctx


# ---------------------------------------------------------------------------------------------
# CP handlers: torch's _sdpa_handler, with the CPU kernels in its call map.
# ---------------------------------------------------------------------------------------------


def _ring_forward(mesh: DeviceMesh, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> tuple[torch.Tensor, ...]:
    cp = _torch_internals()
    with scope(CP_SCOPE):
        return cp.attention._templated_ring_attention(
            mesh.get_group(), _SEQ_DIM, cp.forward_op, query=query, key=key, value=value,
            is_causal=is_causal, dropout_p=dropout_p, scale=scale,
        )


def _ring_backward(mesh: DeviceMesh, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float,
                   is_causal: bool, *, attn_mask: torch.Tensor | None = None,
                   scale: float | None = None) -> tuple[torch.Tensor, ...]:
    cp = _torch_internals()
    with scope(CP_SCOPE):
        return cp.attention._templated_ring_attention_backward(
            mesh.get_group(), _SEQ_DIM, cp.backward_op, grad_out=grad_out, grad_out_name="grad_out",
            query=query, key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal,
            dropout_p=dropout_p, scale=scale,
        )


def _refuse_unsupported(dropout_p: float, attn_mask: torch.Tensor | None) -> None:
    """A guard: torch's ring only knows causal / not causal per kv block, so a mask would have to be
    sliced to each block's rows and columns (in load-balanced order); torch refuses attn_bias on
    CUDA likewise. Dropout would draw unrelated masks in forward and backward. (Through
    ``context_parallel`` neither normally gets here: torch's SDPA wrapper fails on a mask first,
    and CPU SDPA picks the math kernel when dropout_p > 0.)"""
    if attn_mask is not None:
        raise NotImplementedError("context parallel attention on CPU does not support attn_mask (use is_causal)")
    if dropout_p:
        raise NotImplementedError("context parallel attention on CPU does not support attention dropout")


def _cpu_sdpa_handler(op_call: torch._ops.OpOverload, args: tuple[object, ...],
                      kwargs: dict[str, object]) -> object:
    """DTensor custom-op handler for the CPU flash SDPA kernels under CP (torch's _sdpa_handler,
    whose call map is closed, with the CPU kernels)."""
    from torch.distributed.tensor import DTensor

    cp = _torch_internals()
    dropout_at = 3 if op_call == cp.forward_op else 6  # positional index of dropout_p in the schema
    _refuse_unsupported(args[dropout_at] if len(args) > dropout_at else kwargs.get("dropout_p", 0.0),
                        kwargs.get("attn_mask"))
    _register_strategies()
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError(f"context parallel SDPA needs q, k, v sharded on the sequence (dim {_SEQ_DIM})")
    ring = _ring_forward if op_call == cp.forward_op else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def support_cpu_sdpa() -> None:
    """Let torch's context parallelism run attention on CPU (gloo); idempotent, CUDA unaffected.

    Adds the CPU flash SDPA kernels to the handlers torch installs when CP is entered
    (``_attention.custom_ops``) and, when called inside an active ``context_parallel``, to the
    handlers already installed. Sharding strategies follow lazily, under CP only.

    Raises:
        RuntimeError: this torch lacks the internals used (verified with torch ``CP_TORCH_VERSION``).
    """
    from torch.distributed.tensor import DTensor

    cp = _torch_internals()
    ops = {cp.forward_op: _cpu_sdpa_handler, cp.backward_op: _cpu_sdpa_handler}
    cp.attention.custom_ops.update(ops)
    live = DTensor._op_dispatcher._custom_op_handlers
    if live is not cp.attention.existing_custom_ops:  # CP is active: torch installed a merged copy
        live.update(ops)


# ---------------------------------------------------------------------------------------------
# Per-step entry point
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def sequence_sharded(mesh: DeviceMesh, tensors: list[torch.Tensor], seq_dims: list[int], *,
                     load_balance: bool = True) -> Iterator[None]:
    """Shard ``tensors`` on their sequence dims over ``mesh`` and run CP attention inside.

    Each tensor (inputs, position ids, targets: anything indexed by sequence position) is resized
    in place to this rank's shard and stays sharded after the block (``no_restore_buffers``):
    a training step shards its fresh batch, runs forward and backward inside, and drops the batch.
    Backward must run inside too: the saved attention DTensors need the CP handlers.

    With ``load_balance`` (torch's default, right for causal attention), the sequence is cut into
    2 * cp chunks and rank r holds chunks r and 2*cp-1-r, so positions are not contiguous: a model
    must take position ids as an input sharded with the rest (``load_balanced_order`` gives them),
    not compute ``arange`` in forward. Non-causal attention needs ``load_balance=False`` (torch's
    ring refuses the pair). Only ``F.scaled_dot_product_attention`` looked up at call time is
    replaced (torch patches the module attribute): ``from torch.nn.functional import
    scaled_dot_product_attention`` bound earlier escapes CP.

    Raises:
        ValueError: the tensors' sequence lengths differ or do not divide into 2*cp (cp without
            load balancing) equal chunks; torch would silently drop balancing or mis-shard.
        RuntimeError: the torch internals are missing (see ``support_cpu_sdpa``).
    """
    cp = _torch_internals()
    if len(tensors) != len(seq_dims) or not tensors:
        raise ValueError("sequence_sharded needs one seq dim per tensor, and at least one tensor")
    lengths = {t.shape[d] for t, d in zip(tensors, seq_dims)}
    size = mesh.size()
    chunks = 2 * size if load_balance else size
    if len(lengths) != 1 or next(iter(lengths)) % chunks:
        raise ValueError(f"context parallelism over {size} ranks needs one sequence length divisible "
                         f"by {chunks} (got {sorted(lengths)})")
    support_cpu_sdpa()

    options = cp.attention._cp_options
    saved = (options.rotate_method, options.enable_load_balance)
    wrappers_before = set(cp.attention._replaced_functions)
    # set directly: torch's set_rotate_method logs an INFO line on every call, i.e. every step
    options.rotate_method = cp.attention._RotateMethod.ALL_GATHER
    options.enable_load_balance = load_balance
    try:
        with cp.attention.context_parallel(mesh, buffers=list(tensors), buffer_seq_dims=list(seq_dims),
                                           no_restore_buffers=set(tensors)):
            yield
    finally:
        options.rotate_method, options.enable_load_balance = saved
        # Torch's _restore_function puts F.scaled_dot_product_attention back but keeps the
        # wrapper -> original entry (with its mesh) in _replaced_functions: one leak per step.
        for wrapper in set(cp.attention._replaced_functions) - wrappers_before:
            if wrapper is not F.scaled_dot_product_attention:
                del cp.attention._replaced_functions[wrapper]


def load_balanced_order(seq_len: int, cp_size: int, cp_rank: int) -> list[int]:
    """The original positions this rank holds under torch's head-tail load balancing, in order
    (what ``sequence_sharded`` leaves in a tensor of ``arange(seq_len)``)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2 * {cp_size}")
    k = seq_len // (2 * cp_size)
    head = range(cp_rank * k, (cp_rank + 1) * k)
    tail = range(seq_len - (cp_rank + 1) * k, seq_len - cp_rank * k)
    return [*head, *tail]


# ---------------------------------------------------------------------------------------------
# A training run's use: the model's sequence buffers once, each micro-batch's tensors per step
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextParallel:
    """How a run with context parallelism (plan.parallel.cp > 1) splits the sequence on this rank.

    At set-up, every model buffer with seq_len rows (RoPE tables, position tables: what a model
    indexes by position and the plan's profile allowed, planner.profile.profiler.cp_blocker) keeps
    this rank's rows in the load-balanced order, once. Each micro-batch, `sharded` gives copies of
    the inputs and targets with this rank's positions of every [batch, seq_len, ...] tensor, and
    forward and backward run inside it (torch's ring attention). The loss is then a mean over this
    rank's tokens: averaged over the CP group (as data parallelism averages over dp), it is the
    micro-batch's mean, and so are the gradients."""

    mesh: DeviceMesh
    """The "cp" axis of the run's mesh."""
    seq_len: int
    buffers: tuple[str, ...]
    """The model buffers sharded at set-up."""

    @classmethod
    def setup(cls, modules: list[torch.nn.Module], plan: Plan, mesh: DeviceMesh) -> "ContextParallel":
        """Shard the sequence buffers of `modules` (the model, or this rank's pipeline stages: a
        buffer two of them share is sharded once) over `mesh`'s "cp" axis."""
        cp_mesh = mesh["cp"]
        seq = plan.model.seq_len
        rows = torch.tensor(load_balanced_order(seq, cp_mesh.size(), cp_mesh.get_local_rank()))
        names, done = [], set()
        for module in modules:
            for name, buf in sequence_buffers(module, seq):
                if id(buf) not in done:
                    done.add(id(buf))
                    buf.data = buf.data.index_select(0, rows.to(buf.device))
                    names.append(name)
        support_cpu_sdpa()
        if dist.get_rank() == 0:  # a seq_len-row buffer not indexed by position would go wrong: say which
            log.info("context parallel over %d ranks: sequence buffers sharded: %s", cp_mesh.size(),
                     ", ".join(_patterns(names)) or "none")
        return cls(cp_mesh, seq, tuple(names))

    @contextlib.contextmanager
    def sharded(self, inputs: Any, targets: Any) -> Iterator[tuple[Any, Any]]:
        """(inputs, targets) with this rank's share of each sequence; run forward and backward inside."""
        if packed_rows(inputs):
            raise RuntimeError("context parallelism: a row of this micro-batch packs several sequences (its position_ids "
                               "restart), which needs a mask; the ring splits one causal sequence per row only")
        inputs, targets = _cloned(inputs), _cloned(targets)
        tensors = [t for t in _tensors((inputs, targets)) if t.dim() >= 2 and t.shape[1] == self.seq_len]
        # the whole rows are one sequence each: so are this rank's shards, whose positions jump
        # where its two chunks meet (Hugging Face's mask builder would take them for packed ones)
        with one_sequence_per_row(every_call=True), sequence_sharded(self.mesh, tensors, [1] * len(tensors)):
            yield inputs, targets


def sequence_buffers(module: torch.nn.Module, seq_len: int) -> list[tuple[str, torch.Tensor]]:
    """The buffers a CP rank keeps its own rows of: those with seq_len rows (RoPE tables)."""
    return [(name, buf) for name, buf in module.named_buffers() if buf.dim() >= 1 and buf.shape[0] == seq_len]


def _patterns(names: list[str]) -> list[str]:
    """Buffer names with block indices folded (layers.*.self_attn.rope_cos), each once."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _cloned(tree: Any) -> Any:
    """Copies that own their storage: the batch's tensors are views of the step's global batch,
    and sharding resizes them in place."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)
