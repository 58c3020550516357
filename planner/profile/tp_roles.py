"""What tensor parallelism may do to each layer beyond its Linear pairs: found once, by the profiler,
on fake tensors, and carried by the profile and the plan to the runtime (which re-derives nothing).

The profiler's `TPInfo` names a block's column-/row-wise Linears and marks embeddings and the LM head
vocabulary-parallel. Sequence parallelism (Korthikanti et al. 2022) and a loss on
vocabulary-sharded logits also need to know how tensors flow, which a forward on fake tensors shows:
this module runs the profiler's fake model forward once more (batch 2, hooks on every module; a
long stack of identical blocks cut down to its first, second and last, the others taking the
second's role, as repeats.py does for the trace) and gives each layer a `TPRole`:

- ``embedding`` (an ``nn.Embedding`` with a vocabulary-parallel TPInfo that looks up its input,
  `lookup_blocker`; one that does not is ``other``, and the profiler takes its TPInfo away): the dim
  of its output that is the sequence (the last dim of its index input, whose length is the sequence length);
- ``block`` (a Linear pair that runs split: called again alone with its Linears sliced as one TP rank
  holds them, it gives the same shapes, with its head counts divided where they size its views,
  `split_check`; one that does not is ``other``, and the profiler takes its TPInfo away): its norm-like submodules (SequenceParallel), the submodules whose single
  input feeds all their column-wise Linears (gathered once: torchtitan's ``PrepareModuleInput`` on
  ``attention``/``feed_forward``), and the column-wise Linears that gather their own input. Its
  mixture-of-experts blocks (planner.profile.moe) are judged as expert parallelism with TP runs
  them (TPInfo.under_ep): whole (router, experts and anything else in them), called on this rank's
  sequence shard, so each must take and give one [batch, seq, hidden] tensor and is never gathered;
- ``norm`` (a layer that is one norm-like module, e.g. the final norm);
- ``head`` (the vocabulary-parallel last Linear): whether its logits may stay sharded into the loss;
- ``other``: anything else (no sequence-parallel form).

Sequence parallelism is all or nothing: every layer must take and give hidden states
[batch, seq, hidden] (the sequence dim known, 1 in blocks; a block may take other tensors beside
them, Hugging Face's rotary tables and masks, which stay whole), a block may hold parameters only in its
Linear pair and in norm-like modules (LayerNorm, RMSNorm: per position over the last dim), there
is nothing else, and the model must run on fake tensors as a sequence-parallel rank runs it
(`sp_check`: which also finds where the shard is taken, TPRole.shard_at). The first reason it cannot run is copied into every layer's role
(`sp_blocker`), so every pipeline stage, which sees only its own layers, decides the same.
Not checked: code outside the gathered submodules that mixes positions (``x[:, -1]``, a cumulative
sum) runs on this rank's sequence shard.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.model_file import ModelHandle, call_model, logits_of
from planner.profile.moe import find_moe
from planner.profile.split import without_inference_cache
from planner.profile.tp_plan import HEAD_COUNT_NAMES
from planner.profile.types import NO_BLOCK, TPInfo, TPRole

TRACE_BATCH = 2
"""Batch size of the trace (a [batch, seq, hidden] tensor is recognised by its leading dims)."""


def _tensors(args: Any, kwargs: dict) -> list[torch.Tensor]:
    vals = list(args) + list(kwargs.values())
    return [v for v in vals if isinstance(v, torch.Tensor)]


def is_norm_like(module: nn.Module) -> bool:
    """A LayerNorm/RMSNorm-like module: per-position over the last dim, its own 1-D parameters only."""
    own = list(module.parameters(recurse=False))
    if not own or any(True for c in module.children() for _ in c.parameters()):
        return False
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    name = type(module).__name__.lower()
    if "norm" not in name or any(x in name for x in ("batch", "group", "instance", "weight", "spectral")):
        return False
    return all(p.dim() == 1 and p.shape == own[0].shape for p in own)


class _Calls:
    """Every call of every module of the traced model: (args, kwargs, output), in order."""

    def __init__(self, model: nn.Module):
        self.calls: dict[str, list[tuple[tuple, dict, Any]]] = {}
        self.entered: list[str] = []
        """Every module call's name, in the order the calls began."""
        self.handles = []
        for name, mod in model.named_modules():
            def pre(m, args, name=name):
                self.entered.append(name)

            def hook(m, args, kwargs, out, name=name):
                self.calls.setdefault(name, []).append((args, kwargs, out))
            self.handles.append(mod.register_forward_pre_hook(pre))
            self.handles.append(mod.register_forward_hook(hook, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def get(self, name: str) -> list[tuple[tuple, dict, Any]]:
        return self.calls.get(name, [])


def _storage(t: torch.Tensor) -> Any:
    return StorageWeakRef(t.untyped_storage())


class _Mutations(TorchDispatchMode):
    """The storages that in-place ops write while it is on (`storages`)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[Any] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            written = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(written, torch.Tensor):
                self.storages.add(_storage(written))
        return func(*args, **kwargs)


def hidden_input(args: tuple, kwargs: dict, hidden: Any) -> tuple[str | None, torch.Tensor | None]:
    """How a call takes its hidden states: ("", them) as its first positional argument, (keyword,
    them) as the first keyword argument that is a [batch, seq, hidden] tensor when it has no
    positional one (Hugging Face's ``self_attn(hidden_states=...)``), (None, None) otherwise."""
    if args:
        return ("", args[0]) if hidden(args[0]) else (None, None)
    return next(((k, v) for k, v in kwargs.items() if hidden(v)), (None, None))


def with_hidden(args: tuple, kwargs: dict, keyword: str, value: Any) -> tuple[tuple, dict]:
    """(args, kwargs) with `value` in place of the hidden states, where `hidden_input` found them."""
    if keyword:
        return args, {**kwargs, keyword: value}
    return (value, *args[1:]), kwargs


def _first_tensor(out: Any) -> Any:
    """A call's output tensor: itself, or the first of a tuple (older Hugging Face layers)."""
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _is_sequence(t: Any, seq_len: int) -> bool:
    """A [batch, seq, hidden] tensor of the whole sequence."""
    return isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == seq_len


def _in_any(sub: str, blocks: tuple[str, ...]) -> bool:
    return any(b == "" or sub == b or sub.startswith(b + ".") for b in blocks)


def _pair_outside_moe(tp: TPInfo, moe: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The block's column- and row-wise Linears outside its mixture-of-experts blocks `moe` (which
    run whole on the sequence shard)."""
    return [c for c in tp.colwise if not _in_any(c, moe)], [r for r in tp.rowwise if not _in_any(r, moe)]


def _join(prefix: str, sub: str) -> str:
    return f"{prefix}.{sub}" if sub else prefix


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


class _Analysis:
    def __init__(self, model: nn.Module, calls: _Calls, seq_len: int | None):
        self.model, self.calls, self.S = model, calls, seq_len

    def hidden(self, t: Any) -> bool:
        """A [batch, seq, hidden] tensor of this trace."""
        return isinstance(t, torch.Tensor) and t.dim() == 3 and tuple(t.shape[:2]) == (TRACE_BATCH, self.S)

    def one_hidden_call(self, name: str, what: str) -> tuple[str, torch.Tensor | None]:
        """("", its input) when `name` is called with one [batch, seq, hidden] tensor and returns
        one of the same shape; (why not, None) otherwise."""
        calls = self.calls.get(name)
        if not calls:
            return f"{what} {name} is not called in forward", None
        for args, kwargs, out in calls:
            ts = _tensors(args, kwargs)
            if len(ts) != 1 or not args or ts[0] is not args[0]:
                return f"{what} {name} takes {len(ts)} tensors, not only the hidden states", None
            if not self.hidden(args[0]):
                return f"{what} {name}'s input {tuple(args[0].shape)} is not [batch, seq, hidden]", None
            if not isinstance(out, torch.Tensor) or out.shape != args[0].shape:
                return f"{what} {name} does not return one tensor shaped like its input", None
        return "", calls[0][0][0]

    def block_call(self, name: str) -> str:
        """"" when the block `name` is called with [batch, seq, hidden] hidden states (its first
        argument, or a keyword: `hidden_input`) and returns them in that shape (a tensor, or the
        first of a tuple); why not otherwise. Other tensors beside them (masks, position ids,
        rotary tables) stay whole on every rank: `sp_check` runs the model to see that they may."""
        calls = self.calls.get(name)
        if not calls:
            return f"layer {name} is not called in forward"
        for args, kwargs, out in calls:
            _, x = hidden_input(args, kwargs, self.hidden)
            if x is None:
                return f"layer {name} is not called with [batch, seq, hidden] hidden states"
            y = _first_tensor(out)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                return f"layer {name} does not return its hidden states shaped like its input"
        return ""

    def owner_of(self, param: nn.Parameter, exclude: str) -> str:
        """A parameter name outside module `exclude` that is `param` (a tied weight), or ""."""
        for n, p in self.model.named_parameters(remove_duplicate=False):
            if p is param and not (n == exclude or n.startswith(exclude + ".")):
                return n
        return ""

    def embedding(self, name: str, module: nn.Embedding) -> TPRole:
        tied = self.owner_of(module.weight, name)
        calls = self.calls.get(name)
        blocker, seq_dim = "", None
        if self.S is None:
            blocker = "the model has no 2-D integer input (token ids), so no sequence dimension is known"
        elif not calls or len(calls) != 1 or not calls[0][0] or not isinstance(calls[0][0][0], torch.Tensor):
            blocker = f"embedding {name} is not called once with its indices"
        else:
            idx = calls[0][0][0]
            if idx.dim() not in (1, 2) or idx.shape[-1] != self.S:
                blocker = f"embedding {name}'s input {tuple(idx.shape)} does not end in the sequence ({self.S})"
            else:
                seq_dim = idx.dim() - 1
        return TPRole("embedding", self.S, seq_dim, sp_blocker=blocker, tied=tied)

    def block(self, name: str, module: nn.Module, tp: TPInfo) -> TPRole:
        # Mixture-of-experts blocks as expert parallelism with TP runs them: whole (their Linears
        # out of the pairs, their router replicated), on this rank's sequence shard, not gathered.
        moe = tuple(b.name for b in find_moe(module))
        colwise, rowwise = _pair_outside_moe(tp, moe)
        linears = set(colwise) | set(rowwise)
        if self.S is None:
            return TPRole("block", None, sp_blocker="the model has no 2-D integer input (token ids), so no sequence dimension is known")
        why = self.block_call(name)
        if why:
            return TPRole("block", self.S, sp_blocker=why)
        if moe and (not colwise or not rowwise):
            return TPRole("block", self.S, sp_blocker=(
                f"layer {name} has no column/row-wise Linear pair outside its mixture-of-experts block"))
        for b in moe:
            why_m, _ = self.one_hidden_call(_join(name, b), "mixture-of-experts block")
            if why_m:
                return TPRole("block", self.S, sp_blocker=why_m)
        # Submodules whose hidden-states input feeds every column-wise Linear under them: gathered
        # once (never one holding a mixture-of-experts block, which runs on the shard).
        gathers: list[str] = []
        by_keyword: list[tuple[str, str]] = []
        by_parent: dict[str, list[str]] = {}
        for c in colwise:
            by_parent.setdefault(_parent(c), []).append(c)
        for parent, cols in by_parent.items():
            calls = self.calls.get(_join(name, parent)) or []
            if not parent or len(calls) != 1 or any(b == parent or b.startswith(parent + ".") for b in moe):
                continue
            args, kwargs, _ = calls[0]
            keyword, x = hidden_input(args, kwargs, self.hidden)
            if x is None:
                continue
            if all(any(a and a[0] is x for a, _, _ in self.calls.get(_join(name, c)) or []) for c in cols):
                gathers.append(parent)
                if keyword:
                    by_keyword.append((parent, keyword))

        def inside(sub: str) -> bool:
            return any(sub == g or sub.startswith(g + ".") for g in gathers)

        norms: list[str] = []
        for sub, m in module.named_modules():
            if not any(True for _ in m.parameters(recurse=False)) or sub in linears or _in_any(sub, moe):
                continue
            if not is_norm_like(m):
                return TPRole("block", self.S, sp_blocker=(
                    f"{_join(name, sub)} ({type(m).__name__}) holds parameters and is neither a Linear of "
                    "the column/row-wise pair nor a norm"))
            if inside(sub):
                continue  # runs on the gathered (whole-sequence) input, replicated
            why_n, _ = self.one_hidden_call(_join(name, sub), "norm")
            if why_n:
                return TPRole("block", self.S, sp_blocker=why_n)
            norms.append(sub)
        for c in colwise:
            if inside(c):
                continue
            calls = self.calls.get(_join(name, c)) or []
            if not calls or not all(a and self.hidden(a[0]) for a, _, _ in calls):
                return TPRole("block", self.S, sp_blocker=f"column-wise {_join(name, c)}'s input is not [batch, seq, hidden]")
        for r in rowwise:
            calls = self.calls.get(_join(name, r)) or []
            if not calls or not all(self.hidden(o) for _, _, o in calls):
                return TPRole("block", self.S, sp_blocker=f"row-wise {_join(name, r)}'s output is not [batch, seq, hidden]")
        params = sum(1 for sub in norms for _ in module.get_submodule(sub).parameters())
        return TPRole("block", self.S, norms=tuple(norms), gathers=tuple(gathers), norm_params=params,
                      gather_kwargs=tuple(by_keyword))

    def head(self, name: str, module: nn.Linear, handle: ModelHandle, output: Any, targets: Any) -> TPRole:
        tied = self.owner_of(module.weight, name)
        calls = self.calls.get(name) or []
        blocker = ""
        if self.S is None:
            blocker = "the model has no 2-D integer input (token ids), so no sequence dimension is known"
        elif len(calls) != 1 or not calls[0][0] or not self.hidden(calls[0][0][0]):
            blocker = f"the head {name}'s input is not [batch, seq, hidden]"
        loss = ""
        try:
            logits = logits_of(output)
        except Exception:  # noqa: BLE001 - the model's own loss_fn reads its output
            logits = None
        if handle.has_loss_fn:
            loss = "the model file's loss_fn gets whole logits; only the default cross-entropy runs on vocabulary-sharded ones"
        elif not isinstance(targets, torch.Tensor) or targets.is_floating_point():
            loss = "the default loss for float targets (MSE) needs whole logits"
        elif not calls or logits is not calls[-1][2]:
            loss = f"the model's output is not {name}'s logits as they are"
        return TPRole("head", self.S, sp_blocker=blocker, tied=tied, loss_blocker=loss)


def tp_roles(
    handle: ModelHandle, model: nn.Module, fake_mode: Any, dtype: torch.dtype, layers: tuple[Any, ...],
    seq_len: int | None, stacks: tuple[tuple[str, ...], ...] = (),
) -> tuple[TPRole, ...] | str:
    """Each layer's TPRole (in `layers`' order: objects with `name` and `tp`), or why none could be
    found (the forward on fake tensors failed). `model`: the profiler's, built under `fake_mode`;
    `stacks`: the member names of each stack of identical blocks (repeats.py) whose interior is
    not run here (the second member's role serves them all); `seq_len`: the profile's."""
    import logging

    import planner.profile.materialize as mat

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    calls = None
    skipped = {name: members[1] for members in stacks for name in members[2:-1]}
    # Without an inference cache (training reads none), so that a layer can be called again alone
    # with the arguments it was given (a cache in them would grow with each call).
    cached = without_inference_cache(model)
    try:
        inputs, targets = handle.sample_batch(TRACE_BATCH)
        inputs = mat.cast_floats(inputs, dtype)
        calls = _Calls(model)
        batch = mat.fake_batch(inputs, fake_mode)
        with _without(model, skipped), fake_mode, torch.no_grad(), _Mutations() as mutated:
            output = call_model(model, batch)
        calls.remove()  # the layers called again below are not part of the trace
        roles = _roles(handle, model, fake_mode, calls, layers, seq_len, skipped, output, targets)
        # what runs before the first block may run whole on every rank, when the first block takes the shard
        run = [l.name for l in layers if l.name in roles]
        start = next((i for i, n in enumerate(run) if roles[n].kind == "block"), len(run))
        before = next((roles[n].sp_blocker for n in run[:start] if roles[n].sp_blocker), "")
        first = next((roles[n].sp_blocker for n in run[start:] if roles[n].sp_blocker), "")
        shard_at = ""
        if not first and seq_len and start < len(run):
            with _without(model, skipped):
                first, shard_at = sp_check(model, batch, fake_mode, layers, roles, seq_len, output, at_block=bool(before))
            first = first or ("" if shard_at else before)
        for layer in layers:
            if layer.name in roles and layer.tp is not None and not roles[layer.name].split_blocker:
                subs = (*layer.tp.colwise, *layer.tp.rowwise) if layer.tp.required else ("",)
                written = tuple(n for n in subs if any(isinstance(out, torch.Tensor) and _storage(out) in mutated.storages
                                                       for _, _, out in calls.get(_join(layer.name, n))))
                roles[layer.name] = replace(roles[layer.name], cloned=written)
    except Exception as exc:  # noqa: BLE001
        return f"the trace on fake tensors failed ({type(exc).__name__}: {exc})"
    finally:
        fake_log.setLevel(level)
        if calls is not None:
            calls.remove()
        for config in cached:
            config.use_cache = True
    if not any(r.kind == "block" for r in roles.values()):
        first = NO_BLOCK  # only embeddings and the head split: nothing to run sequence-parallel
    dropout = _shard_dropout(model, calls, layers, roles, skipped)
    for name, rep in skipped.items():  # an interior block: the representative's role, renamed
        r = roles[rep]
        roles[name] = replace(r, shard_dropout=tuple(name + n[len(rep):] for n in dropout.get(rep, ())))
        dropout[name] = list(roles[name].shard_dropout)
    return tuple(
        replace(roles[l.name], sp_blocker=first, shard_at="" if first else shard_at,
                shard_dropout=tuple(dropout.get(l.name, ()))) for l in layers
    )


def _roles(
    handle: ModelHandle, model: nn.Module, fake_mode: Any, calls: _Calls, layers: tuple[Any, ...],
    seq_len: int | None, skipped: dict[str, str], output: Any, targets: Any,
) -> dict[str, TPRole]:
    """Each layer's role but the interior members of a stack (`skipped`), before the roles' common
    sequence-parallel blocker and their dropout are filled in."""
    a = _Analysis(model, calls, seq_len)
    roles: dict[str, TPRole] = {}
    for i, layer in enumerate(layers):
        if layer.name in skipped:
            continue
        module = model.get_submodule(layer.name)
        tp = layer.tp
        if tp is not None and not tp.required and isinstance(module, nn.Embedding):
            why = lookup_blocker(module, calls.get(layer.name), fake_mode, layer.name)
            role = TPRole("other", a.S, sp_blocker=why, split_blocker=why) if why else a.embedding(layer.name, module)
        elif tp is not None and not tp.required and isinstance(module, nn.Linear) and i == len(layers) - 1:
            role = a.head(layer.name, module, handle, output, targets)
        elif tp is not None and tp.required and tp.colwise and tp.rowwise:
            why, heads = split_check(module, calls.get(layer.name), tp, fake_mode, layer.name)
            role = (TPRole("other", a.S, sp_blocker=why, split_blocker=why) if why
                    else replace(a.block(layer.name, module, tp), local_heads=heads))
        elif tp is None and is_norm_like(module):
            why, _ = a.one_hidden_call(layer.name, "norm") if a.S is not None else ("no sequence dimension is known", None)
            role = TPRole("norm", a.S, sp_blocker=why)
        else:
            role = TPRole("other", a.S, sp_blocker=(
                f"layer {layer.name} ({type(module).__name__}) is neither an embedding, a block with a "
                "column/row-wise Linear pair, a norm nor the head"))
        roles[layer.name] = role
    return roles


def lookup_blocker(module: nn.Embedding, calls: list[tuple[tuple, dict, Any]], fake_mode: Any, name: str) -> str:
    """Why the embedding `module` cannot be split over its vocabulary ("" when it can, or when no
    call of it was seen): vocabulary parallelism (torch's RowwiseParallel) takes the module's first
    input for the indices to look up, so a forward of its own that looks up other ones (OPT's learned
    positions: an attention mask in, positions computed from it) cannot run split. Found by calling
    it again on fake tensors and watching what it gives F.embedding."""
    if not calls or not calls[0][0]:
        return ""
    args, kwargs, _ = calls[0]
    looked_up: list[Any] = []

    class _Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, fargs=(), fkwargs=None):
            fkwargs = fkwargs or {}
            if func is F.embedding:
                looked_up.append(fargs[0] if fargs else fkwargs.get("input"))
            return func(*fargs, **fkwargs)

    try:
        with fake_mode, torch.no_grad(), _Watch():
            module(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not callable alone: nothing to tell
        return ""
    if looked_up and looked_up[0] is not args[0]:
        return (f"embedding {name} ({type(module).__name__}) looks up indices it computes, not its input, so "
                "it cannot be split over its vocabulary")
    return ""


def split_check(module: nn.Module, calls: list[tuple[tuple, dict, Any]], tp: TPInfo, fake_mode: Any,
                name: str) -> tuple[str, tuple[str, ...]]:
    """How the block `module` runs with its Linear pairs split: ("", the head-count attributes a TP
    rank divides by its degree, TPRole.local_heads) when it can, (why not, ()) when it cannot; ("",
    ()) when no call of it was seen. Called again on fake tensors with the arguments of its first
    call, whole and then as one TP rank runs it (column-wise Linears with a 1/degree slice of their
    output features, row-wise ones of their input features, for the smallest degree its divisors
    allow), it must run and give outputs of the same shapes.

    A forward that sizes its views with a head count of its own (OPT's ``view(bsz, -1,
    self.num_heads, self.head_dim)``) runs on a shard all the same and silently mixes positions
    (the ``-1`` takes half the sequence): so it is run split twice, with the head counts of the
    modules holding the column-wise Linears as they are and divided by the degree (their
    HEAD_COUNT_NAMES, and any other whole number equal to a column-wise Linear's output features:
    a head count times the head width), and where the ops' shapes differ the counts matter and
    are divided, as Megatron-LM and torchtitan give each rank its own heads. Code that sizes a
    tensor with the whole model's head count (T5's relative position bias, a row per head, added
    to this rank's heads) fails either way: so at plan time instead of after launch."""
    degree = next((d for d in range(2, 65) if tp.legal(d)), None)
    if not calls or degree is None:
        return "", ()
    args, kwargs, _ = calls[0]
    try:
        with fake_mode, torch.no_grad():
            whole = _shapes(module(*args, **kwargs))
    except Exception:  # noqa: BLE001 - not callable alone (state between calls): nothing to compare
        return "", ()
    heads = _head_attributes(module, tp, degree)
    as_is, ops = _run_split(module, args, kwargs, tp, degree, {}, fake_mode)
    divided, ops_divided = _run_split(module, args, kwargs, tp, degree, heads, fake_mode) if heads else (as_is, ops)
    what = f"layer {name} cannot run with its Linears split over {degree} ranks"
    if heads and divided == whole and (as_is != whole or ops_divided != ops):
        return "", tuple(sorted(heads))
    if as_is == whole:
        return "", ()
    if isinstance(as_is, str):
        return f"{what} ({as_is})", ()
    return f"{what} (it returns tensors shaped {as_is} where whole it returns {whole})", ()


def sp_check(model: nn.Module, batch: Any, fake_mode: Any, layers: tuple[Any, ...], roles: dict[str, TPRole],
             seq_len: int, expected: Any, at_block: bool = False) -> tuple[str, str]:
    """How sequence parallelism cuts the hidden states into each rank's sequence shard: ("",
    TPRole.shard_at), or (why it cannot run, ""). The model's forward runs again on fake tensors
    as one rank of the smallest degree that divides the sequence runs it: the hidden states between
    blocks this rank's shard, each block's gathered submodules (and column-wise Linears outside them)
    given the whole sequence, its row-wise Linears' outputs cut back to the shard, the head given the
    whole sequence; it must run and give outputs of the trace's shapes (`expected`). First with the
    embeddings handing on their shards; where that fails (the model computes cache positions, masks
    or rotary tables from the embeddings' sequence length, as Hugging Face's models do) with the
    embeddings whole and the first block cutting its input (only that with `at_block`: a layer
    before the first block cannot hand on shards, an embedding that looks up indices it computes,
    say, and runs whole). Tensors a block takes beside the hidden
    states (a mask, rotary tables) stay whole: the run fails where they meet the shard. Not seen:
    code that mixes positions without changing shapes (module docstring)."""
    degree = next((d for d in range(2, seq_len + 1) if seq_len % d == 0), None)
    run = [l for l in layers if l.name in roles]
    first = next((l.name for l in run if roles[l.name].kind == "block"), None)
    if degree is None or first is None:
        return "", ""
    if not at_block and not _sp_run(model, batch, fake_mode, run, roles, seq_len, degree, "", expected):
        return "", ""
    why = _sp_run(model, batch, fake_mode, run, roles, seq_len, degree, first, expected)
    if not why:
        return "", first
    return f"the model does not run on sequence shards ({why})", ""


def _sp_run(model: nn.Module, batch: Any, fake_mode: Any, layers: list[Any], roles: dict[str, TPRole],
            seq_len: int, degree: int, shard_at: str, expected: Any) -> str:
    """"" when the forward of `sp_check` runs with the shard taken at `shard_at` ("": the
    embeddings); the first line of its error, or the shapes it gave, otherwise."""
    shard = seq_len // degree

    def cut(t: Any, dim: int = 1) -> Any:
        return t.narrow(dim, 0, shard) if isinstance(t, torch.Tensor) and t.dim() > dim else t

    def whole(t: Any) -> Any:
        return torch.cat([t] * degree, 1) if isinstance(t, torch.Tensor) and t.dim() > 1 else t

    def on_hidden(keyword: str, fn: Any) -> Any:
        def pre(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x = kwargs.get(keyword) if keyword else (args[0] if args else None)
            return (args, kwargs) if x is None else with_hidden(args, kwargs, keyword, fn(x))
        return pre

    def cut_input(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        keyword, x = hidden_input(args, kwargs, lambda t: _is_sequence(t, seq_len))
        return (args, kwargs) if keyword is None else with_hidden(args, kwargs, keyword, cut(x))

    hooks = []

    def pre_hook(module: nn.Module, fn: Any) -> None:
        hooks.append(module.register_forward_pre_hook(fn, with_kwargs=True))

    for layer in layers:
        role, module = roles[layer.name], model.get_submodule(layer.name)
        if role.kind == "embedding" and not shard_at and role.seq_dim is not None:
            dim = role.seq_dim
            hooks.append(module.register_forward_hook(lambda m, a, out, dim=dim: cut(out, dim)))
        elif role.kind == "block":
            if layer.name == shard_at:
                pre_hook(module, cut_input)
            keywords = dict(role.gather_kwargs)
            for g in role.gathers:
                pre_hook(module.get_submodule(g), on_hidden(keywords.get(g, ""), whole))
            colwise, rowwise = _pair_outside_moe(layer.tp, tuple(b.name for b in find_moe(module)))
            for c in colwise:
                if not _in_any(c, role.gathers):
                    pre_hook(module.get_submodule(c), on_hidden("", whole))
            for r in rowwise:
                hooks.append(module.get_submodule(r).register_forward_hook(lambda m, a, out: cut(out)))
        elif role.kind == "head":
            pre_hook(module, on_hidden("", whole))
    names = {id(m): n for n, m in model.named_modules()}
    inside: list[str] = []  # the modules running now, innermost last: where a failure happened
    hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: inside.append(names.get(id(m), ""))))

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        inside.pop()

    hooks.append(torch.nn.modules.module.register_module_forward_hook(leave))
    try:
        with fake_mode, torch.no_grad():
            got = _shapes(call_model(model, batch))
    except Exception as exc:  # noqa: BLE001
        where = next((n for n in reversed(inside) if n), "")
        module = type(model.get_submodule(where)).__name__ if where else ""
        return (f"in {where} ({module}): " if where else "") + _first_line(exc)
    finally:
        for h in hooks:
            h.remove()
    want = _shapes(expected)
    return "" if got == want else f"it gives outputs shaped {got} where whole it gives {want}"


def _first_line(exc: BaseException) -> str:
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _shapes(out: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _OpShapes(TorchDispatchMode):
    """The output shapes of every op run while it is on (`shapes`)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[list[tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.append(_shapes(out))
        return out


def _head_attributes(module: nn.Module, tp: TPInfo, degree: int) -> dict[str, int]:
    """The whole numbers of the modules holding column-wise Linears that may count this rank's
    heads ("sub.attr" relative to the layer -> the whole model's value): their HEAD_COUNT_NAMES,
    and other attributes equal to a column-wise Linear's output features, each divisible by `degree`."""
    found: dict[str, int] = {}
    for parent in sorted({_parent(c) for c in tp.colwise}):
        holder = module.get_submodule(parent)
        widths = {module.get_submodule(c).out_features for c in tp.colwise if _parent(c) == parent}
        for attr, value in vars(holder).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < degree or value % degree:
                continue
            if attr in HEAD_COUNT_NAMES or value in widths:
                found[_join(parent, attr)] = value
    return found


def _run_split(module: nn.Module, args: tuple, kwargs: dict, tp: TPInfo, degree: int,
               heads: dict[str, int], fake_mode: Any) -> tuple[Any, list]:
    """(the output shapes, or the first line of its error; the shapes of every op) of `module`
    called as one TP rank of `degree` runs it, with the attributes `heads` divided by the degree."""
    saved: list[tuple[nn.Module, dict]] = []
    holders = {_parent(h): module.get_submodule(_parent(h)) for h in heads}
    old = {h: getattr(holders[_parent(h)], h.rpartition(".")[2]) for h in heads}
    ops = _OpShapes()
    try:
        with fake_mode, torch.no_grad():
            for h, value in heads.items():
                setattr(holders[_parent(h)], h.rpartition(".")[2], value // degree)
            for names, dim in ((tp.colwise, 0), (tp.rowwise, 1)):
                for sub in names:
                    linear = module.get_submodule(sub)
                    saved.append((linear, dict(linear._parameters)))
                    for key in ("weight", "bias") if dim == 0 else ("weight",):
                        p = linear._parameters.get(key)
                        if p is not None:
                            linear._parameters[key] = p.narrow(dim, 0, p.shape[dim] // degree)
            with ops:
                out = _shapes(module(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001
        out = _first_line(exc)
    finally:
        for linear, params in saved:
            linear._parameters.update(params)
        for h, value in old.items():
            setattr(holders[_parent(h)], h.rpartition(".")[2], value)
    return out, ops.shapes


@contextmanager
def _without(model: nn.Module, skipped: dict[str, str]) -> Iterator[None]:
    """The model with the `skipped` stack members taken out of their containers while it runs
    (as repeats.py cuts a stack down: the container's module dict holds the others)."""
    whole: dict[str, tuple[nn.Module, Any]] = {}
    for name in skipped:
        parent = _parent(name)
        container = model.get_submodule(parent)
        whole.setdefault(parent, (container, container._modules))
    try:
        for parent, (container, modules) in whole.items():
            vars(container)["_modules"] = OrderedDict(
                (k, m) for k, m in modules.items() if _join(parent, k) not in skipped
            )
        yield
    finally:
        for container, modules in whole.values():
            vars(container)["_modules"] = modules


def _shard_dropout(
    model: nn.Module, calls: _Calls, layers: tuple[Any, ...], roles: dict[str, TPRole], skipped: dict[str, str],
) -> dict[str, list[str]]:
    """Layer name -> the dropout modules that run on the sequence shards under sequence
    parallelism, each given to the layer that holds it or, outside every layer, to the layer called
    last before it (glue). Those are: outside the gathered submodules, or on a row-wise output."""
    run = [l for l in layers if l.name not in skipped]
    gathered = [_join(l.name, g) for l in run if roles[l.name].kind == "block" for g in roles[l.name].gathers]
    rowwise_out = {
        id(out) for l in run if roles[l.name].kind == "block" and l.tp is not None
        for row in l.tp.rowwise for _, _, out in calls.get(_join(l.name, row))
    }
    modules = dict(model.named_modules())
    names = {l.name for l in run}
    out: dict[str, list[str]] = {}
    last = run[0].name if run else ""
    for name in calls.entered:
        if name in names:
            last = name
            continue
        m = modules.get(name)
        if not isinstance(m, nn.modules.dropout._DropoutNd) or m.p <= 0:
            continue
        if any(name.startswith(g + ".") for g in gathered) and not any(
            args and id(args[0]) in rowwise_out for args, _, _ in calls.get(name)
        ):
            continue
        owner = next((l for l in names if name.startswith(l + ".")), last)
        if name not in out.setdefault(owner, []):
            out[owner].append(name)
    return out
