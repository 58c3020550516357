"""One instrumented training step (forward, loss, backward) that measures every unit.

Attribution: a forward op belongs to the unit whose forward is running, or, between units, to the
last unit that ran (glue after the first unit, such as a residual or position-id computation,
belongs to it; glue before any unit to the first one). A backward op belongs to the unit whose
outputs last received their gradient (a multi-grad hook on each unit's outputs).

Per unit it records:
- FLOPs, forward and backward, with torch's formula registry (flops.py), via a dispatch mode;
- bytes saved for backward, through `saved_tensors_hooks`: each storage counted once (views of it
  too), parameters and buffers excluded, and charged to the unit that created the storage. So a
  block's output, saved by the next block's first norm, is charged to the block that made it:
  stacked blocks come out identical (each owns one such tensor, as in Korthikanti et al.'s count),
  and a tensor shared by all blocks (RoPE's cos/sin) is charged once, to where it was made;
- the tensors it creates and who consumes them, so that a pipeline cut's crossing tensors are known.
Works on real tensors and under FakeTensorMode alike (the mode sees the same ops in both).
"""

from __future__ import annotations

import inspect
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from planner.model_file import ModelHandle
from planner.profile.flops import (
    ATTENTION_CORE,
    formula_for,
    is_attention,
    is_cheap,
    is_grouped_matmul,
    is_linear_matmul,
    kept_by_selective,
    op_name,
)
from planner.profile.layers import Unit
from planner.profile.moe import find_moe
from planner.profile.tp_plan import find_tp_plan

BEFORE_ANY = -1  # segment of glue that runs before the first unit


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensors_in(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


@dataclass
class TensorFlow:
    creator: int
    num_bytes: int
    consumers: set[int] = field(default_factory=set)


@dataclass
class TraceResult:
    order: list[int]
    """Unit indices in the order of their first call."""
    fwd: PhaseCosts
    bwd: PhaseCosts
    saved_bytes: Counter
    matmul_out_bytes: Counter
    """Bytes of every output the forward's matmul-like ops made (with grad enabled): what selective
    recompute keeps, since its save-matmuls policy stores each one whether or not autograd saves it
    (a projection feeding a residual add too)."""
    flows: list[TensorFlow]
    loose_param_use: dict[int, int]
    """Storage key of a parameter owned by no unit -> first unit whose ops used it."""
    uncounted_by_unit: Counter
    """(unit, op name) -> calls of ops that have no FLOP formula (and are not cheap by nature)."""
    returned: dict[int, set[int]] = field(default_factory=dict)
    """Unit -> the flows (tensor ids) its forward returned."""
    called_with_more: Counter = field(default_factory=Counter)
    """Unit -> its calls with more than one tensor (`called_alone`: arguments beside it other than
    its forward's defaults): a pipeline stage that starts at it cannot call it with the tensor
    handed over alone."""
    io_bytes: dict[int, tuple[int, int]] = field(default_factory=dict)
    """id(module) of each nn.Linear / nn.Embedding -> (input bytes, output bytes) summed over calls."""
    saved_tp_bytes: Counter = field(default_factory=Counter)
    """Of saved_bytes, what tensor parallelism shards with or without sequence parallelism:
    tensors made inside a column-wise -> row-wise region (``tp_regions``)."""
    saved_fused_bytes: Counter = field(default_factory=Counter)
    """What saved_bytes comes to were each chain of memory-bound ops one fused kernel (_Fusion):
    such a kernel saves what it read from outside it, never a tensor made and consumed inside it
    (a norm's fp32 copy, SiLU's output before SwiGLU's product); `_fused_saved`."""
    saved_fused_tp_bytes: Counter = field(default_factory=Counter)
    """Of saved_fused_bytes, what tensor parallelism shards (as saved_tp_bytes)."""
    saved_linear_in_bytes: Counter = field(default_factory=Counter)
    """Of saved_bytes, the inputs of Linear (and grouped) matmuls that only those matmuls save
    for backward (every op that saved the storage a matmul with a weight operand): what
    Transformer Engine keeps in FP8 instead (`_linear_saved`)."""
    saved_linear_in_tp_bytes: Counter = field(default_factory=Counter)
    """Of saved_linear_in_bytes, what tensor parallelism shards (as saved_tp_bytes)."""
    saved_linear_in_copies: Counter = field(default_factory=Counter)
    """saved_linear_in_bytes counted once per matmul that saved it (one low-precision copy each)."""
    matmul_out_tp_bytes: Counter = field(default_factory=Counter)
    """Of matmul_out_bytes, the outputs made inside such a region."""
    fwd_other_io_tp_bytes: Counter = field(default_factory=Counter)
    """Of fwd.other_io_bytes, the memory-bound traffic inside such a region."""
    tail: PhaseCosts = field(default_factory=lambda: PhaseCosts())
    """Per unit, the forward's work after the last tensor it saved for backward (summed over its
    calls): what torch's non-reentrant checkpoint does not rerun (_Tail)."""
    tail_rowwise: Counter = field(default_factory=Counter)
    """Per unit, the row-wise Linear matmuls in that tail (their TP collectives are not rerun)."""
    tail_kept: Counter = field(default_factory=Counter)
    """Per unit, the outputs of matmul-like ops in that tail (selective checkpointing keeps them;
    backward reads them nowhere, so a compiled graph does not)."""
    tail_kept_alternate: Counter = field(default_factory=Counter)
    """Of tail_kept, what the alternate policy keeps."""
    loss_memory: tuple[int, int, int] | None = None
    """The model output's bytes, what the loss holds at its peak beyond what its forward leaves
    alive, and what its forward leaves alive (`loss_memory`); None: not measured."""

    @property
    def uncounted_ops(self) -> Counter:
        """Op name -> calls, over all units."""
        out: Counter = Counter()
        for (_, name), n in self.uncounted_by_unit.items():
            out[name] += n
        return out


class _Segments:
    """Which unit is running, in forward and in backward."""

    def __init__(self) -> None:
        self.stack: list[int] = []
        self.last = BEFORE_ANY
        self.backward = False
        self.bwd_unit = BEFORE_ANY

    def current(self) -> int:
        if self.backward:
            return self.bwd_unit
        return self.stack[-1] if self.stack else self.last


@dataclass
class PhaseCosts:
    """Per unit, for one phase (forward or backward): what the ops cost."""

    flops: Counter = field(default_factory=Counter)
    matmul_io_bytes: Counter = field(default_factory=Counter)
    """Bytes read and written by ops with a FLOP formula (matmuls, convolutions, attention)."""
    other_io_bytes: Counter = field(default_factory=Counter)
    """Bytes read and written by the other ops (elementwise, norms, copies): memory-bound work.
    Parameters read by them are left out (an embedding reads rows, not its whole table)."""
    fused_io_bytes: Counter = field(default_factory=Counter)
    """What other_io_bytes comes to were each chain of memory-bound ops one fused kernel (_Fusion)."""
    ops: Counter = field(default_factory=Counter)
    """Ops that move data (views excluded): each costs a kernel launch on a GPU."""
    linear_flops: Counter = field(default_factory=Counter)
    """Of flops, the Linear layers' matmuls (what FP8 training runs in 8 bits)."""
    linear_operand_bytes: Counter = field(default_factory=Counter)
    """Bytes of those matmuls' operands (what FP8 training casts)."""
    linear_weight_bytes: Counter = field(default_factory=Counter)
    """Of linear_operand_bytes, the parameters' (weights and biases)."""
    grouped_flops: Counter = field(default_factory=Counter)
    """Of flops, grouped GEMMs' (a mixture of experts' experts: what Transformer Engine's FP8 runs
    in 8 bits besides the Linears, flops.is_grouped_matmul)."""
    grouped_operand_bytes: Counter = field(default_factory=Counter)
    """Bytes of those GEMMs' operands other than parameters (the rows routed to the experts and
    their gradients: what that FP8 casts every micro-batch)."""
    grouped_shapes: Counter = field(default_factory=Counter)
    """Per unit, a tuple of the forward's grouped GEMMs of rows x (k -> n) per group: (rows of all
    groups, n, k, groups), one per call (a tuple, not a count: repeats.py copies it as the rest)."""
    # What the alternate recompute policy (torchtitan's per-op selective checkpointing: keep every
    # other Linear matmul's output) recomputes beyond selective's memory-bound ops: the forward's
    # second, fourth, ... Linear matmul of each unit (runtime/recompute.py counts the same way).
    alternate_flops: Counter = field(default_factory=Counter)
    alternate_io_bytes: Counter = field(default_factory=Counter)
    """Bytes those matmuls read and write."""
    alternate_out_bytes: Counter = field(default_factory=Counter)
    """Their outputs: what the alternate policy does not keep of matmul_out_bytes."""
    alternate_out_tp_bytes: Counter = field(default_factory=Counter)
    """Of alternate_out_bytes, the outputs made inside a column-wise -> row-wise region."""
    selective_flops: Counter = field(default_factory=Counter)
    """FLOPs of the forward's matmul-like ops selective recompute does not keep (an unfused
    attention's batched matmuls, kept_by_selective): it reruns them."""
    selective_io_bytes: Counter = field(default_factory=Counter)
    """Bytes those ops read and write."""
    # What context parallelism does to attention (it splits the sequence: each rank keeps its
    # queries and receives every other rank's keys and values, planner.cost.stage_costs).
    attention_flops: Counter = field(default_factory=Counter)
    """Of flops, the fused attention kernels' (scaled_dot_product_attention)."""
    causal_attention_flops: Counter = field(default_factory=Counter)
    """Of attention_flops, the calls with is_causal (counted whole: the kernels skip the masked half)."""
    attention_kv_bytes: Counter = field(default_factory=Counter)
    """Bytes of the keys and values those kernels read (what a context-parallel ring exchanges)."""
    attention_kv_unique_bytes: Counter = field(default_factory=Counter)
    """The same before grouped-query attention repeated them for the kernel (repeat_interleave,
    expand): the key/value heads themselves."""
    masked_attention: Counter = field(default_factory=Counter)
    """Fused attention calls given an explicit mask (context parallelism splits causal or
    unmasked attention only)."""
    square_scores: Counter = field(default_factory=Counter)
    """The largest n of a batched matmul's n x n output: attention scores computed without the
    fused kernel when n is the sequence length."""
    aranges: Counter = field(default_factory=Counter)
    """The longest torch.arange the forward made: positions made inside the model when it is the
    sequence length (a context-parallel rank holds a reordered shard of the sequence)."""


def _arg(func, args: tuple, kwargs: dict, name: str):
    """An op's argument by its schema name (positional or keyword), None when it has none."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs[name] if name in kwargs else (args[i] if i < len(args) else a.default_value)
    return None


_REPEATS = (torch.ops.aten.expand, torch.ops.aten.repeat, torch.ops.aten.repeat_interleave)


def _is_view(func, args: tuple, kwargs: dict, out) -> bool:
    """An op that runs no kernel: a view, or one that returns its input's storage without writing
    it (aten._unsafe_view, which reshapes a matmul's output, is not marked a view)."""
    if getattr(func, "is_view", False):
        return True
    made = tensors_in(out)
    if not made or func._schema.is_mutable:
        return False
    inputs = {storage_key(t) for t in tensors_in((args, kwargs))}
    return all(storage_key(t) in inputs for t in made)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Tail:
    """What a unit's forward runs after the last tensor it saves for backward.

    torch's non-reentrant checkpoint (``use_reentrant=False``, early stop on by default; torchtitan
    and this runtime) reruns a checkpointed forward only until the last saved tensor is rebuilt,
    and compiled recompute (AOTAutograd's partitioner) reruns only what backward reads: a block's
    last matmul (its inputs are saved before it runs) and the residual add after it are not rerun,
    nor a checkpointed head's matmul. The autograd layer saves an op's inputs before the dispatch
    mode sees the op and its outputs after, so the ops recorded since the unit's last ``pack`` are
    its tail, with the glue charged to the unit after it returns (a loss: outside any checkpoint).
    A unit's tail closes when it is called again and at the end of the forward."""

    FIGURES = 12

    def __init__(self) -> None:
        self.costs = PhaseCosts()
        self.rowwise: Counter = Counter()
        self.kept: Counter = Counter()
        """Matmul-like outputs in the tail: selective checkpointing keeps them, autograd does not need them."""
        self.kept_alternate: Counter = Counter()
        """Of `kept`, what the alternate policy keeps."""
        # unit -> [flops, matmul io, other io, ops, linear, attention, causal, alternate, alternate io, rowwise,
        #          kept, kept by alternate]
        self.pending: dict[int, list[int]] = {}

    def enter(self, unit: int) -> None:
        self.close(unit)
        self.pending[unit] = [0] * self.FIGURES

    def saved(self, unit: int) -> None:
        if unit in self.pending:
            self.pending[unit] = [0] * self.FIGURES

    def add(self, unit: int, *figures: int) -> None:
        row = self.pending.get(unit)
        if row is not None:
            for i, v in enumerate(figures):
                row[i] += v

    def close(self, unit: int | None = None) -> None:
        """Add `unit`'s open tail (every unit's: None) to the costs."""
        for u in list(self.pending) if unit is None else [unit]:
            row = self.pending.pop(u, None)
            if row is None:
                continue
            c = self.costs
            for counter, v in zip((c.flops, c.matmul_io_bytes, c.other_io_bytes, c.ops, c.linear_flops, c.attention_flops,
                                   c.causal_attention_flops, c.alternate_flops, c.alternate_io_bytes, self.rowwise,
                                   self.kept, self.kept_alternate), row):
                if v:
                    counter[u] += v


@dataclass
class _Made:
    phase: PhaseCosts
    unit: int
    level: int
    """Matmul-like ops on the longest path to it from the unit's inputs in this phase."""
    nbytes: int
    memory_bound: bool
    random: bool = False
    """Made by a seeded random op (dropout)."""
    consumed: bool = False
    materialized: bool = False

    @property
    def kernel(self) -> tuple[int, int, int]:
        """The fused kernel that made it: its phase, unit and level."""
        return id(self.phase), self.unit, self.level

    @property
    def internal(self) -> bool:
        """Made and read inside one forward kernel only (none of its readers outside it)."""
        return self.memory_bound and not self.materialized and not self.random


def _generation(key: int, made: _Made | None) -> tuple:
    """One generation of a storage: what made it (a storage freed and reused is made again), or
    the storage itself where no op of the trace made it (an input, a parameter)."""
    return ("made", id(made)) if made is not None else ("storage", key)


class _Fusion:
    """The memory-bound traffic of each unit and phase were its memory-bound ops fused as trainers
    run them: Transformer Engine's and Megatron-LM's fused kernels (norms, activation functions,
    RoPE, bias-dropout-add), torch.compile's generated ones. Ops of a unit and phase with as many
    matmul-like ops (matmuls, attention) on the longest path to them from the unit's inputs are
    one kernel (no matmul runs between them, so nothing stops their fusion: the norm and the
    residual add before it, SwiGLU's SiLU and product though the up projection runs between
    them). A kernel reads once each tensor it takes from outside it and writes only what leaves
    it: a tensor a matmul or attention reads, one another kernel of the phase reads, and one
    nothing reads (a gradient). A tensor only the other phase's kernels read (a norm's fp32 copy
    saved for backward) is not written: the fused backward rebuilds it from what it reads,
    charged there at the saved tensor's size; but a random one (a dropout mask) is: it cannot be
    rebuilt without the generator's state (Megatron-LM and Transformer Engine keep the mask)."""

    def __init__(self, sharded: set[int] | None = None) -> None:
        self.made: dict[int, _Made] = {}
        self.read: dict[int, set[tuple]] = {}  # storage -> the kernels that read (a view of) it
        # kernel -> what it read from outside it: (its maker, or the storage when none made it) ->
        # (bytes, maker, TP-sharded); the maker tells a storage's generations apart (freed, reused)
        self.inputs: dict[tuple, dict[tuple, tuple[int, _Made | None, bool]]] = {}
        self.sharded = sharded if sharded is not None else set()  # storages made inside a TP region

    def op(self, phase: PhaseCosts, unit: int, memory_bound: bool, inputs: list[torch.Tensor],
           outputs: list[torch.Tensor], random: bool = False) -> None:
        made = [self.made.get(storage_key(t)) for t in inputs]
        ours = [m is not None and m.phase is phase and m.unit == unit for m in made]  # this unit and phase's
        level = max((m.level for m, o in zip(made, ours) if o), default=0) + (0 if memory_bound else 1)
        for t, m, o in zip(inputs, made, ours):
            inside = memory_bound and o and m.memory_bound and m.level == level
            if m is not None and m.memory_bound:
                m.consumed = True
                m.materialized |= not inside and (m.phase is phase or m.random)
            if memory_bound and not inside:
                key = storage_key(t)
                self.inputs.setdefault((id(phase), unit, level), {})[_generation(key, m)] = (
                    t.untyped_storage().nbytes(), m, key in self.sharded)
                seen = (id(phase), unit, level, t.storage_offset(), tuple(t.shape))
                readers = self.read.setdefault(storage_key(t), set())
                if seen not in readers:
                    readers.add(seen)
                    phase.fused_io_bytes[unit] += _nbytes(t)
        for t in outputs:  # a new storage (at a freed one's address, maybe), or one written in place
            key = storage_key(t)
            self._settle(self.made.pop(key, None))
            self.read.pop(key, None)
            self.made[key] = _Made(phase, unit, level, _nbytes(t), memory_bound, random=random)

    @staticmethod
    def _settle(m: _Made | None) -> None:
        if m is not None and m.memory_bound and (m.materialized or not m.consumed):
            m.phase.fused_io_bytes[m.unit] += m.nbytes

    def close(self) -> None:
        for m in self.made.values():
            self._settle(m)
        self.made.clear()


class _Recorder(TorchDispatchMode):
    def __init__(self, seg: _Segments, param_keys: set[int], loose_keys: set[int]) -> None:
        super().__init__()
        self.seg = seg
        self.param_keys = param_keys
        self.loose_keys = loose_keys
        self.fwd = PhaseCosts()
        self.bwd = PhaseCosts()
        self.uncounted: Counter = Counter()  # (unit, op name) -> calls
        self.ids: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.flows: list[TensorFlow] = []
        self.loose_use: dict[int, int] = {}
        self.storage_creator: dict[int, int] = {}
        self.matmul_out: Counter = Counter()
        self.linear_inputs: Counter = Counter()  # storage -> the forward's matmuls with a weight that read it
        # tensor-parallel regions: storages made inside one, and the column/row-wise module depth
        self.sharded: set[int] = set()
        self.in_colwise = 0
        self.in_rowwise = 0
        self.matmul_out_tp: Counter = Counter()
        self.linear_calls: Counter = Counter()  # per unit, the forward's Linear matmuls so far
        self.other_io_tp: Counter = Counter()
        self.tail = _Tail()
        self.fusion = _Fusion(self.sharded)
        self.repeated: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # tensor -> copies of each element

    def _track_repeats(self, func, args: tuple, kwargs: dict, out) -> None:
        """How many copies of each element a tensor holds, through the ops that repeat one (expand,
        repeat, repeat_interleave: grouped-query attention's keys and values made as many as the
        query heads) and those that move it whole (views, reshapes, copies)."""
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func.overloadpacket not in _REPEATS and (first is None or first not in self.repeated):
            return  # most ops: nothing repeated comes in or goes out (the profiler's hot path)
        made = tensors_in(out)
        given = tensors_in((args, kwargs))
        if len(made) != 1 or len(given) != 1:
            return
        copies = self.repeated.get(given[0], 1)
        if func.overloadpacket in _REPEATS:
            copies *= made[0].numel() / max(1, given[0].numel())
        elif made[0].numel() != given[0].numel():
            return
        if copies > 1:
            self.repeated[made[0]] = copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata queries (prim.device) that fake tensors answer
            return out
        seg = self.seg.current()
        costs = self.bwd if self.seg.backward else self.fwd
        if not self.seg.backward:
            self._track_repeats(func, args, kwargs, out)
        formula = formula_for(func)
        view = formula is None and _is_view(func, args, kwargs, out)
        other_io = flops = matmul_io = 0
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            matmul_io = sum(map(_nbytes, tensors_in((args, kwargs, out))))
            costs.flops[seg] += flops
            costs.matmul_io_bytes[seg] += matmul_io
            costs.ops[seg] += 1
            self.fusion.op(costs, seg, False, tensors_in((args, kwargs)), tensors_in(out))
            if is_linear_matmul(func):
                costs.linear_flops[seg] += flops
                operands = tensors_in((args, kwargs))
                costs.linear_operand_bytes[seg] += sum(map(_nbytes, operands))
                costs.linear_weight_bytes[seg] += sum(_nbytes(t) for t in operands if storage_key(t) in self.param_keys)
            if (is_linear_matmul(func) or is_grouped_matmul(func)) and not self.seg.backward and torch.is_grad_enabled():
                keyed = [(storage_key(t), t) for t in tensors_in((args, kwargs))]
                if any(key in self.param_keys for key, _ in keyed):  # a matmul with a weight: its other operands
                    for key, t in keyed:
                        if key not in self.param_keys and t.is_floating_point():
                            self.linear_inputs[key] += 1
            if is_grouped_matmul(func):
                costs.grouped_flops[seg] += flops
                costs.grouped_operand_bytes[seg] += sum(
                    _nbytes(t) for t in tensors_in((args, kwargs)) if t.is_floating_point() and storage_key(t) not in self.param_keys)
                rows, weights = args[0], args[1]
                if not self.seg.backward and rows.dim() == 2 and weights.dim() == 3:
                    # (rows, k) @ (groups, k, n): every group's rows in one operand, split by offsets
                    shape = (rows.shape[0], weights.shape[2], rows.shape[1], weights.shape[0])
                    costs.grouped_shapes[seg] = costs.grouped_shapes.get(seg, ()) + (tuple(map(int, shape)),)
            if is_attention(func):
                costs.attention_flops[seg] += flops
                if _arg(func, args, kwargs, "is_causal"):
                    costs.causal_attention_flops[seg] += flops
                if not self.seg.backward:
                    costs.attention_kv_bytes[seg] += _nbytes(args[1]) + _nbytes(args[2])
                    costs.attention_kv_unique_bytes[seg] += sum(_nbytes(t) / self.repeated.get(t, 1) for t in args[1:3])
                    if kwargs.get("attn_mask") is not None or any(isinstance(a, torch.Tensor) for a in args[3:]):
                        costs.masked_attention[seg] += 1
            elif func.overloadpacket in ATTENTION_CORE and not self.seg.backward:
                shape = tuple(tensors_in(out)[0].shape) if tensors_in(out) else ()
                if len(shape) >= 2 and shape[-1] == shape[-2]:
                    costs.square_scores[seg] = max(costs.square_scores[seg], int(shape[-1]))
        elif not view:
            if func.overloadpacket is torch.ops.aten.arange and not self.seg.backward:
                made = tensors_in(out)
                if made and made[0].dim() == 1:  # glue's (outside every unit's forward) on its own
                    where = seg if self.seg.stack else BEFORE_ANY
                    costs.aranges[where] = max(costs.aranges[where], int(made[0].shape[0]))
            if not is_cheap(func):
                self.uncounted[(seg, op_name(func))] += 1
            ins = [t for t in tensors_in((args, kwargs)) if storage_key(t) not in self.param_keys]
            other_io = sum(map(_nbytes, ins)) + sum(map(_nbytes, tensors_in(out)))
            costs.other_io_bytes[seg] += other_io
            costs.ops[seg] += 1
            self.fusion.op(costs, seg, True, ins, tensors_in(out), torch.Tag.nondeterministic_seeded in func.tags)
        if not self.seg.backward:
            alternate = False
            kept = 0
            sharded = self._in_region(args, kwargs)
            if sharded:
                self.other_io_tp[seg] += other_io
            new = self._track(seg, args, kwargs, out)
            if sharded:  # new storages only: a view of a column-wise input stays whole
                self.sharded.update(new)
            else:  # a new storage at a freed one's address is not the old one
                self.sharded.difference_update(new)
            for key in new:  # nor has it been read by the old one's matmuls
                self.linear_inputs.pop(key, None)
            if formula is not None and not kept_by_selective(func) and torch.is_grad_enabled():
                costs.selective_flops[seg] += flops  # rerun by selective recompute
                costs.selective_io_bytes[seg] += matmul_io
            # what selective recompute keeps: every new output of a matmul-like op (not the
            # attention core's batched matmuls), whether or not autograd saves it
            if kept_by_selective(func) and torch.is_grad_enabled():
                made = {storage_key(t): t.untyped_storage().nbytes() for t in tensors_in(out)}
                kept = sum(made[k] for k in new if k in made)
                self.matmul_out[seg] += kept
                if sharded:
                    self.matmul_out_tp[seg] += kept
                if is_linear_matmul(func):
                    self.linear_calls[seg] += 1
                    alternate = self.linear_calls[seg] % 2 == 0
                    if alternate:  # what the alternate policy recomputes
                        costs.alternate_flops[seg] += flops
                        costs.alternate_io_bytes[seg] += matmul_io
                        costs.alternate_out_bytes[seg] += kept
                        if sharded:
                            costs.alternate_out_tp_bytes[seg] += kept
            if formula is not None or not view:
                linear = is_linear_matmul(func)
                attention = flops if formula is not None and is_attention(func) else 0
                causal = attention if attention and _arg(func, args, kwargs, "is_causal") else 0
                self.tail.add(seg, flops, matmul_io, other_io, 1, flops if linear else 0, attention, causal,
                              flops if alternate else 0, matmul_io if alternate else 0, int(linear and self.in_rowwise > 0),
                              kept, 0 if alternate else kept)
        return out

    def _in_region(self, args, kwargs) -> bool:
        """Whether an op runs inside a column-wise -> row-wise region, where tensor parallelism
        splits its tensors whether or not sequence parallelism is on: in a column-wise Linear, or
        on a tensor made in the region, outside the row-wise Linear that closes it."""
        if self.in_rowwise:
            return False
        if self.in_colwise:
            return True
        return any(storage_key(t) in self.sharded for t in tensors_in((args, kwargs)))

    def _track(self, seg: int, args, kwargs, out) -> set[int]:
        """Record who made and who uses each tensor; return the keys of new storages."""
        inputs = tensors_in((args, kwargs))
        input_storages = {storage_key(t) for t in inputs}
        new: set[int] = set()
        for t in tensors_in(out):
            key = storage_key(t)
            if key in input_storages:  # a view or an in-place result: the storage keeps its maker
                self.storage_creator.setdefault(key, seg)
            else:  # a new storage (its address may be a freed one's: overwrite)
                self.storage_creator[key] = seg
                new.add(key)
        for t in inputs:
            tid = self.ids.get(t)
            if tid is not None:
                flow = self.flows[tid]
                if seg != flow.creator:
                    flow.consumers.add(seg)
            elif self.loose_keys:
                key = storage_key(t)
                if key in self.loose_keys and key not in self.loose_use:
                    self.loose_use[key] = seg
        for t in tensors_in(out):
            if t not in self.ids:
                self.ids[t] = len(self.flows)
                self.flows.append(TensorFlow(seg, _nbytes(t)))
        return new


@contextmanager
def watch_units(
    units: list[Unit],
    enter: Callable[[int], None],
    leave: Callable[[int, Any], None] | None,
    backward: Callable[[int], None],
) -> Iterator[None]:
    """Call enter(i)/leave(i, output) around unit i's forward, and backward(i) when its outputs' first
    gradient arrives (the start of its backward)."""

    def hooks(index: int):
        def pre(module, args):
            enter(index)

        def post(module, args, output):
            if leave is not None:
                leave(index, output)
            outs = [t for t in tensors_in(output) if t.requires_grad]
            if outs:
                register_multi_grad_hook(outs, lambda _grad: backward(index), mode="any")

        return pre, post

    handles = []
    try:
        for i, unit in enumerate(units):
            pre, post = hooks(i)
            handles.append(unit.module.register_forward_pre_hook(pre))
            handles.append(unit.module.register_forward_hook(post))
        yield
    finally:
        for h in handles:
            h.remove()


def forward_signature(module: torch.nn.Module) -> inspect.Signature | None:
    """The signature of `module`'s forward, None where Python cannot read one."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def called_alone(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> bool:
    """Whether a module whose forward has `signature` was called with one tensor and nothing
    else that matters, so that calling it with the tensor alone, as a later pipeline stage does,
    is the same call: any other argument that is not a tensor is what its forward takes when not
    given (nn.TransformerEncoder hands its layers src_mask=None, is_causal=False,
    src_key_padding_mask=None). Other tensors are the profiler's tensor flows to judge: one the
    module reads crosses the cut before it, which is then no plain hand-over."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    if signature is None:
        return len(args) == 1 and not kwargs
    params = list(signature.parameters.values())
    named = {p.name: p for p in params}
    given = [(params[i] if i < len(params) else None, v) for i, v in enumerate(args[1:], 1)]
    given += [(named.get(k), v) for k, v in kwargs.items()]

    def default(param: inspect.Parameter | None, value: Any) -> bool:
        if param is None or param.default is inspect.Parameter.empty:
            return False
        if value is None or param.default is None:
            return value is param.default
        return type(value) in (bool, int, float, str) and type(value) is type(param.default) and value == param.default

    return all(isinstance(v, torch.Tensor) or default(p, v) for p, v in given)


@contextmanager
def watch_calls(units: list[Unit], counter: Counter) -> Iterator[None]:
    """Count, per unit, its calls with more than one tensor (`called_alone`)."""

    def hook(index: int, signature: inspect.Signature | None):
        def pre(module, args, kwargs):
            if not called_alone(signature, args, kwargs):
                counter[index] += 1

        return pre

    handles = [u.module.register_forward_pre_hook(hook(i, forward_signature(u.module)), with_kwargs=True)
               for i, u in enumerate(units)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run_trace(
    handle: ModelHandle,
    model: torch.nn.Module,
    units: list[Unit],
    inputs: Any,
    targets: Any,
) -> TraceResult:
    """One forward + loss + backward of `model` on the batch, instrumented per unit."""
    seg = _Segments()
    tp_saved: Counter = Counter()
    order: list[int] = []
    param_keys = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    owned = {storage_key(p) for u in units for p in u.module.parameters()}
    loose = {storage_key(p) for p in model.parameters()} - owned
    saved: Counter = Counter()
    seen_storages: set[int] = set()
    packed: list[tuple[int, int, int, _Made | None, bool]] = []  # (storage, unit, bytes, maker, TP-sharded)
    packs: Counter = Counter()  # storage -> tensors of it saved (one per saving op and operand)

    def pack(t: torch.Tensor) -> torch.Tensor:
        for unit in seg.stack:  # parameters too: a checkpoint waits for every tensor saved inside it
            recorder.tail.saved(unit)
        key = storage_key(t)
        packs[key] += 1
        if key not in param_keys and key not in seen_storages:
            seen_storages.add(key)
            unit = recorder.storage_creator.get(key, seg.current())
            saved[unit] += t.untyped_storage().nbytes()
            if key in recorder.sharded:
                tp_saved[unit] += t.untyped_storage().nbytes()
            packed.append((key, unit, t.untyped_storage().nbytes(), recorder.fusion.made.get(key), key in recorder.sharded))
        return t

    def enter(index: int) -> None:
        if index not in order:
            order.append(index)
        seg.stack.append(index)
        recorder.tail.enter(index)

    def leave(index: int, output: Any) -> None:
        seg.stack.pop()
        seg.last = index
        returned.setdefault(index, set()).update(
            recorder.ids[t] for t in tensors_in(output) if t in recorder.ids
        )

    def entered_backward(index: int) -> None:
        seg.bwd_unit = index

    recorder = _Recorder(seg, param_keys, loose)
    returned: dict[int, set[int]] = {}
    called_with_more: Counter = Counter()
    with watch_units(units, enter, leave, entered_backward), linear_io(model) as io_bytes, \
            watch_regions(recorder, *tp_regions(model, units)), watch_calls(units, called_with_more), recorder:
        with saved_tensors_hooks(pack, lambda t: t):
            outputs = handle.forward(model, inputs)
            loss = handle.loss(outputs, targets)
        recorder.tail.close()
        seg.backward = True
        seg.bwd_unit = seg.last
        if loss.requires_grad:
            loss.backward()
        recorder.fusion.close()
    fused, fused_tp = _fused_saved(packed, recorder, param_keys)
    linear_in, linear_in_tp, linear_copies = _linear_saved(packed, packs, recorder.linear_inputs)
    loss_held = loss_memory(handle, outputs, targets)
    return TraceResult(
        order=order,
        fwd=recorder.fwd,
        bwd=recorder.bwd,
        saved_bytes=saved,
        matmul_out_bytes=recorder.matmul_out,
        flows=recorder.flows,
        loose_param_use=recorder.loose_use,
        uncounted_by_unit=recorder.uncounted,
        io_bytes=io_bytes,
        returned=returned,
        called_with_more=called_with_more,
        saved_tp_bytes=tp_saved,
        saved_fused_bytes=fused,
        saved_fused_tp_bytes=fused_tp,
        saved_linear_in_bytes=linear_in,
        saved_linear_in_tp_bytes=linear_in_tp,
        saved_linear_in_copies=linear_copies,
        matmul_out_tp_bytes=recorder.matmul_out_tp,
        fwd_other_io_tp_bytes=recorder.other_io_tp,
        tail=recorder.tail.costs,
        tail_rowwise=recorder.tail.rowwise,
        tail_kept=recorder.tail.kept,
        tail_kept_alternate=recorder.tail.kept_alternate,
        loss_memory=loss_held,
    )


def _linear_saved(packed: list[tuple[int, int, int, _Made | None, bool]], packs: Counter,
                  linear_inputs: Counter) -> tuple[Counter, Counter, Counter]:
    """Per unit, the saved storages that only Linear (and grouped) matmuls saved: each such
    matmul saved it once (a matmul with a weight saves its input for the weight gradient), and
    nothing else did (an attention output that its kernel saves too stays whole). Their bytes,
    the part tensor parallelism shards, and the bytes once per matmul that saved them."""
    out, out_tp, copies = Counter(), Counter(), Counter()
    for key, unit, nbytes, _, sharded in packed:
        uses = linear_inputs.get(key, 0)
        if uses and packs[key] == uses:
            out[unit] += nbytes
            out_tp[unit] += nbytes if sharded else 0
            copies[unit] += nbytes * uses
    return out, out_tp, copies


def _fused_saved(packed: list[tuple[int, int, int, _Made | None, bool]], recorder: _Recorder,
                 param_keys: set[int]) -> tuple[Counter, Counter]:
    """Per unit, what the forward saves for backward were each chain of its memory-bound ops one
    fused kernel (_Fusion): the tensors autograd saved, less those made and read inside one kernel
    of the forward (`_Made.internal`: a norm's fp32 copy, SiLU's output that SwiGLU's product
    reads), plus, for each kernel one of those came from, what it read from outside it (its
    inputs, not parameters), which its backward rebuilds them from; each storage once. And the
    part of it that tensor parallelism shards."""
    out, out_tp = Counter(), Counter()
    counted: set[tuple] = set()
    kernels: dict[tuple, int] = {}
    for key, unit, nbytes, made, sharded in packed:
        if made is not None and made.phase is recorder.fwd and made.internal:
            kernels.setdefault(made.kernel, unit)
            continue
        counted.add(_generation(key, made))
        out[unit] += nbytes
        out_tp[unit] += nbytes if sharded else 0
    for kernel, unit in kernels.items():
        for generation, (nbytes, _, sharded) in recorder.fusion.inputs.get(kernel, {}).items():
            if generation not in counted and not (generation[0] == "storage" and generation[1] in param_keys):
                counted.add(generation)
                out[unit] += nbytes
                out_tp[unit] += nbytes if sharded else 0
    return out, out_tp


def loss_memory(handle: ModelHandle, outputs: Any, targets: Any) -> tuple[int, int, int] | None:
    """The loss's memory (the model file's loss_fn, or the default): (the model output's bytes,
    the bytes the loss holds at its peak, forward and backward, beyond what its forward leaves
    alive for backward, and what its forward leaves alive): its input, its working set (the
    gradient of the model's output, its temporaries), and what it saves for backward (which the
    trace counts as the last unit's activations too).
    F.cross_entropy on logits.float() saves fp32 log-probabilities and holds two more fp32 copies
    of the logits at its peak; a fused cross-entropy saves a log-sum-exp per row and holds one
    gradient in the logits' dtype. Measured by torch's
    MemTracker (live tensors, on fake tensors too) on leaves shaped as the model's output; None
    where it cannot run."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.utils._pytree import tree_map

        def leaf(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return t.detach().requires_grad_(t.is_floating_point() and t.requires_grad)

        leaves = tree_map(leaf, outputs)
        tracker = MemTracker()
        tracker.track_external(*tensors_in(leaves))
        with tracker:
            before = _total(tracker.get_tracker_snapshot())
            loss = handle.loss(leaves, targets)
            after = _total(tracker.get_tracker_snapshot())
            if loss.requires_grad:
                loss.backward()
        return before, max(0, _total(tracker.get_tracker_snapshot("peak")) - after), max(0, after - before)
    except Exception:  # noqa: BLE001 - a measurement the cost model can do without
        return None


def _total(snapshot: dict) -> int:
    return sum(int(d.get("Total", 0)) for d in snapshot.values())


def tp_regions(model: torch.nn.Module, units: list[Unit]) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """The column-wise and the row-wise Linears of every unit's tensor-parallel plan (tp_plan.py)."""
    colwise: list[torch.nn.Module] = []
    rowwise: list[torch.nn.Module] = []
    for unit in units:
        plan = find_tp_plan(unit.module, model, unit.name)
        if plan is not None:
            subs = dict(unit.module.named_modules())
            colwise += [subs[n] for n in plan.colwise]
            rowwise += [subs[n] for n in plan.rowwise]
    return colwise, rowwise


@contextmanager
def watch_regions(recorder: _Recorder, colwise: list[torch.nn.Module], rowwise: list[torch.nn.Module]) -> Iterator[None]:
    """Keep the recorder's column-wise / row-wise depth while those modules' forwards run."""

    def depth(attr: str, step: int):
        def hook(module, *_):
            setattr(recorder, attr, getattr(recorder, attr) + step)
        return hook

    handles = []
    try:
        for modules, attr in ((colwise, "in_colwise"), (rowwise, "in_rowwise")):
            for m in modules:
                handles.append(m.register_forward_pre_hook(depth(attr, 1)))
                handles.append(m.register_forward_hook(depth(attr, -1)))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def linear_io(model: torch.nn.Module) -> Iterator[dict[int, tuple[int, int]]]:
    """id(module) -> (input bytes, output bytes), summed over the forward calls of every
    nn.Linear and nn.Embedding: what tensor parallelism would communicate around them; and of
    every mixture-of-experts expert (moe.py: each expert of a list, or a stacked experts module,
    whose input counts each token once per expert it chose): the rows expert parallelism sends."""
    io_bytes: dict[int, tuple[int, int]] = {}

    def record(module, args, output) -> None:
        ins = sum(_nbytes(t) for t in tensors_in(args) if t.is_floating_point())
        outs = sum(_nbytes(t) for t in tensors_in(output))
        a, b = io_bytes.get(id(module), (0, 0))
        io_bytes[id(module)] = (a + ins, b + outs)

    def routed(module, args, output) -> None:
        # a stacked experts module gets each token once with its top-k choices: k rows each
        rows = tensors_in(args)
        ins = _nbytes(rows[0]) * (rows[1].shape[-1] if len(rows) > 1 and rows[1].dim() > 1 else 1)
        a, b = io_bytes.get(id(module), (0, 0))
        io_bytes[id(module)] = (a + ins, b + sum(_nbytes(t) for t in tensors_in(output)))

    handles = [
        m.register_forward_hook(record)
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
    ]
    for block in find_moe(model):
        experts = model.get_submodule(block.experts)
        if block.stacked:
            handles.append(experts.register_forward_hook(routed))
        else:  # an expert that is itself a Linear has its hook already
            handles += [e.register_forward_hook(record) for e in experts if not isinstance(e, (torch.nn.Linear, torch.nn.Embedding))]
    try:
        yield io_bytes
    finally:
        for h in handles:
            h.remove()
