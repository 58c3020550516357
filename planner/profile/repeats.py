"""Trace a model with long stacks of identical blocks through a few of them, and reuse their figures.

Why: the trace costs per op (FakeTensorMode's dispatch and the recorder of trace.py), so a stack of
96 identical blocks costs 96 blocks' worth of tracing for one block's worth of information
(examples/gpt_175b.py: about 2.6 s of trace for 96 blocks against 0.4 s for the two short runs
below, on the 2-core CPU of the design notes; bench/bench_profile.py prints the figures).

A stack is the children of one ModuleList/Sequential (the units of layers.py that share a parent).
Its interior members (all but the first and the last, which are always traced) must be
interchangeable (``find_stacks``):

- the same module classes, parameter and buffer shapes, dtypes and requires_grad, hooks, and plain
  attributes; an int attribute is either the same in every interior block or different in each (an
  index, as Hugging Face's layer_idx); an int that repeats but varies (a per-layer 0/1 flag), a
  differing bool, float or string (alternating sliding-window attention, stochastic-depth rates)
  keeps the stack whole;
- no parameter, Linear or Embedding of theirs registered anywhere else: a tied weight's gradient
  is accumulated by whichever block runs backward later, and trace.io_bytes sums a module's calls.

The model is then traced twice with every such stack cut down in place (the container's module
dict holds a few members, so ``for block in self.blocks`` runs only those; the modules keep their
names and attributes; the blocks no run calls keep meta tensors, materialize.make_fake):

- run A: the first member, the second (the representative of the interior) and the last;
- run B: the same plus one member from the middle (of even index; the representative's is odd).

Run A's trace is grown to run B's stack and must equal run B's trace exactly: the call order, every
unit's FLOPs, bytes and op counts, each tensor that crosses between units (its maker, bytes and
readers), what each unit returned, the Linear inputs and outputs, and each unit's input shapes and
non-tensor arguments. Only then is run A grown to the whole stack (``grow``): copies of the
representative follow it, with its costs, the tensors it made (what it handed to the next member
goes to the copy's next one) and its Linear inputs and outputs; a tensor that the representative
and the last member both read (a mask, RoPE tables, a first block's output) is read by every
interior member. The profile assembled from the grown trace is the profile of a trace of every
block, field by field (tests/unit/test_profile_fast.py).

Anything else gives None, and the caller traces every block of a freshly built model: a forward
that indexes the container (``self.layers[i]`` past the kept ones), stacks called interleaved, a
block called twice, a tensor that one stack's representative hands to another stack, glue that
depends on the number of blocks (it changes between runs A and B), a mismatch of any figure.

What the check cannot see: code that treats one block differently by an index that neither run
touches (``if self.layer_idx == 50``, or the loop counter of the model's forward) while nothing
stored in the blocks differs. ``profile_model(..., reuse_min_blocks=None)`` traces every block.
"""

from __future__ import annotations

import dataclasses

import enum
import functools
import logging
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from planner.model_file import ModelHandle
from planner.profile.layers import Unit
from planner.profile.trace import PhaseCosts, TensorFlow, TraceResult, run_trace

log = logging.getLogger(__name__)

MIN_BLOCKS = 16
"""Stacks shorter than this are traced whole: the two runs trace 7 blocks and the rest of the model
twice, which saves little below it (measured on fake tensors, 2 cores: GPT-2 small's 12 blocks
0.60 s against 0.68 s, examples/gpt_1b.py's 16 blocks 0.63 s against 0.77 s, Llama-2 7B's 32
blocks 1.05 s against 3.30 s)."""

_WEIGHTED = (nn.Linear, nn.Embedding)  # the modules trace.io_bytes keys by identity


class NotRepeatable(Exception):
    """The stacks' blocks did not behave as copies of each other; str() says where."""


@dataclass(frozen=True)
class Stack:
    """The children of one ModuleList/Sequential whose interior members are interchangeable."""

    container: nn.Module
    keys: tuple[str, ...]
    """The container's module keys, in order (member i is container._modules[keys[i]])."""
    modules: tuple[nn.Module, ...]
    members: tuple[int, ...]
    """Unit index of each member."""

    @property
    def mid(self) -> int:
        """The middle position run B adds: even, between the representative (1) and the last."""
        return max(2, 2 * (len(self.members) // 4))

    @property
    def untraced(self) -> tuple[nn.Module, ...]:
        """The members neither run traces."""
        traced = {0, 1, self.mid, len(self.members) - 1}
        return tuple(m for i, m in enumerate(self.modules) if i not in traced)


# -- which stacks qualify ---------------------------------------------------------------------
def _token(value: Any, depth: int = 0, exact_ints: bool = False) -> Any:
    """A comparable stand-in for an attribute or argument value. Ints match any int unless
    `exact_ints` (a block's stored index may differ; run B samples a second one)."""
    if value is None or isinstance(value, (bool, float, str, bytes, complex)):
        return value
    if isinstance(value, int):
        return value if exact_ints else int
    if isinstance(value, (torch.dtype, torch.device, torch.Size, enum.Enum)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_token(v, depth, exact_ints) for v in value))
    if isinstance(value, (set, frozenset)):  # unordered: its ints are compared exactly
        return ("set", frozenset(_token(v, depth, True) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _token(v, depth, exact_ints)) for k, v in value.items()))
    if isinstance(value, functools.partial):
        return ("partial", _token(value.func), _token(value.args, depth, exact_ints), _token(value.keywords, depth, exact_ints))
    if callable(value) and hasattr(value, "__qualname__"):
        return ("callable", getattr(value, "__module__", None), value.__qualname__)
    if depth < 2 and hasattr(value, "__dict__"):
        items = sorted(vars(value).items())
        return (type(value), tuple((k, _token(v, depth + 1, exact_ints)) for k, v in items))
    return (type(value), id(value))


def _hooks(module: nn.Module) -> tuple:
    return tuple(
        tuple(_token(h) for h in getattr(module, name).values())
        for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


def block_signature(module: nn.Module, exact_ints: bool = False) -> tuple:
    """What must agree between two blocks for one to stand for the other: per submodule, its
    relative name, class, parameter and buffer shapes and dtypes, hooks and plain attributes."""
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in sub._parameters.items() if p is not None)
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in sub._buffers.items() if b is not None)
        attrs = tuple((k, _token(v, exact_ints=exact_ints)) for k, v in sorted(vars(sub).items()) if not k.startswith("_"))
        parts.append((name, type(sub), params, buffers, attrs, _hooks(sub)))
    return tuple(parts)


def _ints(token: Any) -> list[int]:
    """The ints of a token, in order."""
    if type(token) is int:
        return [token]
    return [i for t in token for i in _ints(t)] if isinstance(token, tuple) else []


def interchangeable(blocks: list[nn.Module]) -> bool:
    """Whether the blocks agree in everything but ints, and each int attribute is either the same
    in all of them or different in every one (an index such as Hugging Face's layer_idx). An int
    that repeats but varies (a per-layer 0/1 flag, as Llama 4's no_rope_layers entries) splits the
    blocks into classes that may behave differently: not interchangeable."""
    first = block_signature(blocks[0])
    if any(block_signature(b) != first for b in blocks[1:]):
        return False
    columns = zip(*(_ints(block_signature(b, exact_ints=True)) for b in blocks))
    return all(len(set(col)) in (1, len(col)) for col in columns)


def _shared_elsewhere(model: nn.Module, blocks: list[nn.Module]) -> bool:
    """Whether a parameter, Linear or Embedding of one of `blocks` is also registered elsewhere in
    the model: a tied weight's gradient is accumulated by a second backward op (whichever block
    runs backward later), and trace.io_bytes sums a module's calls."""
    count = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    count.update(id(m) for _, m in model.named_modules(remove_duplicate=False) if isinstance(m, _WEIGHTED))
    own = [x for b in blocks for x in (*b.parameters(), *(m for m in b.modules() if isinstance(m, _WEIGHTED)))]
    return any(count[id(x)] > 1 for x in own)


def find_stacks(model: nn.Module, units: list[Unit], min_blocks: int = MIN_BLOCKS) -> list[Stack]:
    """The stacks of `model` (at least max(4, min_blocks) members) whose interiors qualify."""
    unit_of = {id(u.module): i for i, u in enumerate(units)}
    parents: dict[str, None] = {}
    for u in units:
        if u.in_container:
            parents.setdefault(u.name.rpartition(".")[0], None)
    stacks = []
    for parent in parents:
        container = model.get_submodule(parent)
        items = list(container._modules.items())
        if len(items) < max(4, min_blocks) or any(m is None or id(m) not in unit_of for _, m in items):
            continue
        modules = tuple(m for _, m in items)
        if len({id(m) for m in modules}) != len(modules):
            continue  # one module listed twice: the same weights run twice
        interior = list(modules[1:-1])
        if not interchangeable(interior) or _shared_elsewhere(model, interior):
            continue
        stacks.append(Stack(container, tuple(k for k, _ in items), modules, tuple(unit_of[id(m)] for m in modules)))
    return stacks


# -- the two runs -----------------------------------------------------------------------------
@dataclass
class _Run:
    trace: TraceResult
    calls: list[int]
    """Unit index of every unit call, in order."""
    args: dict[int, Any]
    """Unit -> a token of its (last) call's arguments: tensor shapes, dtypes, other values."""


@contextmanager
def _cut_down(stacks: list[Stack], picks: list[list[int]]) -> Iterator[None]:
    """Each stack's container holds only the members at positions `picks` (same keys, same order)."""
    whole = [s.container._modules for s in stacks]
    try:
        for s, pos in zip(stacks, picks):
            vars(s.container)["_modules"] = OrderedDict((s.keys[p], s.modules[p]) for p in pos)
        yield
    finally:
        for s, modules in zip(stacks, whole):
            vars(s.container)["_modules"] = modules


@contextmanager
def _watch_calls(units: list[Unit]) -> Iterator[_Run]:
    """Record every unit call and the arguments it got (the trace itself comes later)."""
    record = _Run(trace=None, calls=[], args={})  # type: ignore[arg-type]

    def hook(index: int):
        def pre(module, args, kwargs):
            record.calls.append(index)
            leaves, spec = tree_flatten((args, kwargs))
            record.args[index] = (spec, tuple(_token(x, exact_ints=True) for x in leaves))

        return pre

    handles = [u.module.register_forward_pre_hook(hook(i), with_kwargs=True) for i, u in enumerate(units)]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def _run(handle: ModelHandle, model: nn.Module, units: list[Unit], stacks: list[Stack],
         picks: list[list[int]], inputs: Any, targets: Any) -> _Run:
    """One trace with each stack cut down to the members at `picks`; each kept member must be
    called once, in order, with no other unit called between them."""
    # A first backward steals each gradient (detach), a later one adds to it (add_): start each
    # run as the whole trace starts, with no gradients.
    model.zero_grad(set_to_none=True)
    with _cut_down(stacks, picks), _watch_calls(units) as record:
        record.trace = run_trace(handle, model, units, inputs, targets)
    for s, pos in zip(stacks, picks):
        kept = [s.members[p] for p in pos]
        members = set(s.members)
        called = [c for c in record.calls if c in members]
        if called != kept or record.calls[record.calls.index(kept[0]):][:len(kept)] != kept:
            raise NotRepeatable(f"the blocks of {units[kept[0]].name.rpartition('.')[0] or 'the model'} "
                                "were not called once each, in order, one after another")
    return record


# -- growing a trace --------------------------------------------------------------------------
@dataclass
class _Grow:
    """Copies of one stack's representative to add to a trace."""

    first: int
    rep: int
    last: int
    clones: list[int]
    """Units that follow the representative, in order, each a copy of it."""
    chain: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.chain = [self.rep, *self.clones]

    def after(self, j: int) -> int:
        """The member that follows chain[j] (its output's next reader)."""
        return self.chain[j + 1] if j + 1 < len(self.chain) else self.last


def _grow_counter(counter: Counter, grows: list[_Grow]) -> Counter:
    out = Counter(counter)
    for g in grows:
        if g.rep in counter:
            for c in g.clones:
                out[c] = counter[g.rep]
    return out


def _grow_costs(costs: PhaseCosts, grows: list[_Grow]) -> PhaseCosts:
    return PhaseCosts(**{f.name: _grow_counter(getattr(costs, f.name), grows) for f in dataclasses.fields(costs)})


def _grow_flows(trace: TraceResult, grows: list[_Grow]) -> tuple[list[TensorFlow], dict[int, set[int]]]:
    """The tensors between units, and what each unit returned, with the copies added."""
    rep_of = {g.rep: g for g in grows}
    stack_of = {u: k for k, g in enumerate(grows) for u in (g.first, g.rep, g.last)}
    flows: list[TensorFlow] = []
    new_id: dict[int, int] = {}
    copies: dict[int, list[int]] = {}
    for tid, f in enumerate(trace.flows):
        g = rep_of.get(f.creator)
        if g is None:  # read by every interior member when the representative and the last read it
            readers = set(f.consumers)
            for h in grows:
                if h.rep in readers and h.last in readers:
                    readers.update(h.clones)
            new_id[tid] = len(flows)
            flows.append(TensorFlow(f.creator, f.num_bytes, readers))
            continue
        if any(stack_of.get(c, stack_of[g.rep]) != stack_of[g.rep] for c in f.consumers):
            raise NotRepeatable("a block hands a tensor to the blocks of another stack")
        copies[tid] = []
        for j, unit in enumerate(g.chain):
            readers = {g.after(j) if c == g.last else c for c in f.consumers}
            copies[tid].append(len(flows))
            flows.append(TensorFlow(unit, f.num_bytes, readers))
    returned: dict[int, set[int]] = {}
    for unit, tids in trace.returned.items():
        g = rep_of.get(unit)
        for j, u in enumerate(g.chain if g is not None else [unit]):
            returned[u] = {_returned_id(t, unit, j, g, trace, new_id, copies, rep_of) for t in tids}
    return flows, returned


def _returned_id(tid: int, unit: int, j: int, g: _Grow | None, trace: TraceResult,
                 new_id: dict[int, int], copies: dict[int, list[int]], rep_of: dict[int, _Grow]) -> int:
    """The grown id of flow `tid` as returned by chain member j of `g` (or by `unit`, g None)."""
    if tid in new_id:
        return new_id[tid]
    maker = rep_of[trace.flows[tid].creator]
    if g is maker:
        return copies[tid][j]
    if g is None and unit == maker.last:  # the last member returns what its predecessor made
        return copies[tid][-1]
    raise NotRepeatable("a unit returns a tensor made by a block it does not follow")


def _grow_io(io_bytes: dict[int, tuple[int, int]], grows: list[_Grow], units: list[Unit]) -> dict[int, tuple[int, int]]:
    out = dict(io_bytes)
    for g in grows:
        rep = units[g.rep].module
        for c in g.clones:
            clone = dict(units[c].module.named_modules())
            for name, m in rep.named_modules():
                if id(m) in io_bytes:
                    out[id(clone[name])] = io_bytes[id(m)]
    return out


def grow(trace: TraceResult, grows: list[_Grow], units: list[Unit]) -> TraceResult:
    """`trace` as if each grow's clones had run after its representative, as copies of it."""
    order = list(trace.order)
    for g in grows:
        at = order.index(g.rep) + 1
        order[at:at] = g.clones
    uncounted = Counter(trace.uncounted_by_unit)
    for g in grows:
        for (unit, name), n in trace.uncounted_by_unit.items():
            if unit == g.rep:
                uncounted.update({(c, name): n for c in g.clones})
    flows, returned = _grow_flows(trace, grows)
    return TraceResult(
        order=order,
        fwd=_grow_costs(trace.fwd, grows),
        bwd=_grow_costs(trace.bwd, grows),
        saved_bytes=_grow_counter(trace.saved_bytes, grows),
        matmul_out_bytes=_grow_counter(trace.matmul_out_bytes, grows),
        flows=flows,
        loose_param_use=dict(trace.loose_param_use),
        uncounted_by_unit=uncounted,
        returned=returned,
        called_with_more=_grow_counter(trace.called_with_more, grows),
        io_bytes=_grow_io(trace.io_bytes, grows, units),
        saved_tp_bytes=_grow_counter(trace.saved_tp_bytes, grows),
        saved_fused_bytes=_grow_counter(trace.saved_fused_bytes, grows),
        saved_fused_tp_bytes=_grow_counter(trace.saved_fused_tp_bytes, grows),
        saved_linear_in_bytes=_grow_counter(trace.saved_linear_in_bytes, grows),
        saved_linear_in_tp_bytes=_grow_counter(trace.saved_linear_in_tp_bytes, grows),
        saved_linear_in_copies=_grow_counter(trace.saved_linear_in_copies, grows),
        matmul_out_tp_bytes=_grow_counter(trace.matmul_out_tp_bytes, grows),
        fwd_other_io_tp_bytes=_grow_counter(trace.fwd_other_io_tp_bytes, grows),
        tail=_grow_costs(trace.tail, grows),
        tail_rowwise=_grow_counter(trace.tail_rowwise, grows),
        tail_kept=_grow_counter(trace.tail_kept, grows),
        tail_kept_alternate=_grow_counter(trace.tail_kept_alternate, grows),
        loss_memory=trace.loss_memory,
    )


# -- comparing --------------------------------------------------------------------------------
def _nonzero(counter: Counter) -> dict:
    return {k: v for k, v in counter.items() if v}


def _flow_key(f: TensorFlow) -> tuple:
    return (f.creator, f.num_bytes, frozenset(f.consumers))


def trace_key(trace: TraceResult) -> tuple:
    """Everything the profiler reads from a trace, with tensor ids replaced by what they name."""
    phases = [tuple(_nonzero(getattr(c, f.name)) for f in dataclasses.fields(c)) for c in (trace.fwd, trace.bwd, trace.tail)]
    phases += [_nonzero(trace.tail_rowwise), _nonzero(trace.tail_kept), _nonzero(trace.tail_kept_alternate)]
    returned = {u: Counter(_flow_key(trace.flows[t]) for t in tids) for u, tids in trace.returned.items() if tids}
    return (
        list(trace.order), phases, _nonzero(trace.saved_bytes), _nonzero(trace.matmul_out_bytes),
        Counter(_flow_key(f) for f in trace.flows), returned, dict(trace.loose_param_use),
        _nonzero(trace.uncounted_by_unit), dict(trace.io_bytes),
        (_nonzero(trace.saved_tp_bytes), _nonzero(trace.matmul_out_tp_bytes), _nonzero(trace.fwd_other_io_tp_bytes)),
        (_nonzero(trace.saved_linear_in_bytes), _nonzero(trace.saved_linear_in_copies)),
        _nonzero(trace.called_with_more),
    )


def _first_difference(a: tuple, b: tuple) -> str:
    names = ("call order", "costs", "saved bytes", "matmul outputs", "tensors between units",
             "returned tensors", "loose parameters", "uncounted ops", "Linear inputs and outputs",
             "tensor-parallel shares", "Linear inputs saved", "calls with more than a tensor")
    return next((n for n, x, y in zip(names, a, b) if x != y), "nothing")


# -- the entry point --------------------------------------------------------------------------
def trace_with_repeats(handle: ModelHandle, model: nn.Module, units: list[Unit], stacks: list[Stack],
                       inputs: Any, targets: Any) -> TraceResult | None:
    """The trace of the whole model from runs A and B (module docstring), or None when the
    stacks' blocks are not shown to be copies of each other (the caller then traces every block,
    on a freshly built model: these runs may have changed the model's Python state)."""
    try:
        a = _run(handle, model, units, stacks, [[0, 1, len(s.members) - 1] for s in stacks], inputs, targets)
        b = _run(handle, model, units, stacks, [[0, 1, s.mid, len(s.members) - 1] for s in stacks], inputs, targets)
        to_b = [_Grow(s.members[0], s.members[1], s.members[-1], [s.members[s.mid]]) for s in stacks]
        predicted, actual = trace_key(grow(a.trace, to_b, units)), trace_key(b.trace)
        if predicted != actual:
            raise NotRepeatable(f"tracing one more block changed the {_first_difference(predicted, actual)}")
        args = dict(a.args) | {g.clones[0]: a.args.get(g.rep) for g in to_b}
        if args != b.args:
            raise NotRepeatable("the blocks were called with different argument shapes or values")
        whole = [_Grow(s.members[0], s.members[1], s.members[-1], list(s.members[2:-1])) for s in stacks]
        for s in stacks:
            log.info("%s: traced 4 of %d blocks, the others copy %s", units[s.members[0]].name.rpartition(".")[0] or "model",
                     len(s.members), units[s.members[1]].name)
        return grow(a.trace, whole, units)
    except Exception as exc:  # noqa: BLE001 - any failure of the shortcut means: trace every block
        log.info("tracing every block: %s", exc if isinstance(exc, NotRepeatable) else f"{type(exc).__name__}: {exc}")
        return None
