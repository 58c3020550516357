"""Tensor parallelism as the planner's cost model assumes it: Megatron-style Linear pairs with
sequence parallelism, vocabulary-parallel embeddings and head, and a loss on vocabulary-sharded
logits, built from DTensor's ``parallelize_module`` styles the way torchtitan's ``apply_tp`` does
for Llama, but from the profile's TPInfo and each layer's TPRole (planner.profile.tp_roles, carried by the plan) rather than
from hard-coded names. ``runtime.layout.tp_layout`` decides (and gives the warnings); here it runs:

- blocks: ``ColwiseParallel`` on the column-wise Linears, ``RowwiseParallel`` on the row-wise ones;
  the head counts that size the block's views divided by tp (TPRole.local_heads), and the outputs
  the model writes in place handed on as copies (TPRole.cloned).
  With sequence parallelism the hidden states between blocks are this rank's sequence shard
  [batch, seq/tp, hidden] (plain tensors): the block's norms run ``SequenceParallel``, the
  submodules that feed their column-wise Linears (attention, MLP) all-gather their input once
  (``PrepareModuleInput`` Shard(1) -> Replicate; a column-wise Linear outside such a submodule
  gathers its own), and the row-wise Linears reduce-scatter their output to Shard(1) instead of
  all-reducing it.
- embeddings: ``RowwiseParallel(input_layouts=Replicate())`` (vocabulary rows sharded), output
  reduce-scattered over the sequence (Shard(seq_dim)) with sequence parallelism, all-reduced
  otherwise; one that stays replicated (tied, or a vocabulary tp does not divide) still hands on its
  sequence shard (``PrepareModuleOutput``, a local slice). Where the model computes from the
  embeddings' sequence length (Hugging Face's cache positions, masks and rotary tables: TPRole.shard_at)
  they hand on their whole output (all-reduced) and the first block cuts its input to the shard
  (`_CutInput`); the tensors the blocks take beside the hidden states stay whole.
- a norm layer (the final norm): ``SequenceParallel``.
- the head: ``ColwiseParallel`` (vocabulary rows sharded), its input gathered from the sequence
  shards; its logits stay a DTensor sharded over the vocabulary (Shard(-1)) when the loss is the
  model file's default cross-entropy, which then runs under ``loss_parallel``
  (planner.model_file.default_loss), or are all-gathered for any other loss.

The parameters of sequence-parallel norms are replicated DTensors whose gradients DTensor leaves as
partial sums over the tp ranks (each saw its own positions); a hook all-reduces them as they are
produced, so every data-parallel wrapper and the pipeline's gradient all-reduce see whole gradients.
Dropout on the sequence shards draws a mask of its own on every tp rank (`_own_dropout_masks`).

With expert parallelism (ep > 1), as torchtitan runs EP with TP and expert-tensor-parallel degree 1:
the mixture-of-experts blocks (TPInfo.moe) are not sharded at all (``runtime.layout.under_ep``
takes their Linears out of the pairs; a stacked experts module is never a Linear): experts whole,
split over the EP group by runtime.expert_parallel, router replicated. With sequence parallelism,
which the plan must have for it (runtime.preflight), a block's input is this rank's sequence shard
and is not gathered (the profiler's TPRole never gathers a submodule holding one): each tp rank
routes its own tokens through its EP group's all-to-alls and gets its shard back, so the block needs
no TP collective. Its gradients (experts' and router's) are partial sums over the sequence shards,
summed over tp once a step by ``ExpertParallel.sync_grads``.

Not as Megatron-LM: the all-gathered input of the column-wise Linears (and of the head) is saved
whole for their backward (Megatron saves the sequence shard and gathers it again in backward); the
cost model counts it whole for this runtime and torchtitan (Training.tp_saves_gathered).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from planner.profile.tp_roles import hidden_input, with_hidden
from runtime.layout import TPLayout, tp_layout
from runtime.types import LayerSplit

log = logging.getLogger(__name__)


def _gather_input(keyword: str = "") -> PrepareModuleInput:
    """This rank's sequence shard in, the whole sequence (a plain tensor) to the module: its first
    argument, or the keyword argument `keyword` (TPRole.gather_kwargs)."""
    if keyword:
        return PrepareModuleInput(input_kwarg_layouts={keyword: Shard(1)}, desired_input_kwarg_layouts={keyword: Replicate()},
                                  use_local_output=True)
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)


class _CutInput(ParallelStyle):
    """The block that takes this rank's sequence shard (TPRole.shard_at): its hidden states come in
    whole (the embeddings hand on their whole output) and go on as this rank's shard (a local slice;
    in backward the shards' gradients all-gathered into the whole one)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            # [batch, seq, hidden], seq the whole sequence or, under context parallelism, this rank's part
            keyword, x = hidden_input(args, kwargs, lambda t: isinstance(t, torch.Tensor) and t.dim() == 3)
            if keyword is None:
                return args, kwargs
            shard = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return with_hidden(args, kwargs, keyword, shard.redistribute(device_mesh, [Shard(1)]).to_local())

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


def _whole_grad(grad: torch.Tensor) -> torch.Tensor:
    """A replicated parameter's gradient left as partial sums over tp: all-reduced now."""
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


def _sequence_parallel(module: nn.Module, tp_mesh: DeviceMesh, layer: bool = False) -> None:
    style = SequenceParallel(use_local_output=True)
    _parallelize_layer(module, tp_mesh, style) if layer else parallelize_module(module, tp_mesh, style)
    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(_whole_grad)


def _own_dropout_masks(module: nn.Module, tp_rank: int) -> None:
    """Dropout on this rank's sequence shard draws its own mask, as one process draws one mask for
    the whole sequence (with the shared RNG stream, every tp rank would draw the same mask for its
    own positions): each call takes one number from the shared stream (so the stream advances alike
    on every rank, and a recomputed layer, whose RNG state torch.utils.checkpoint restores, draws the
    same masks again) and runs under a generator forked from it and this rank's index."""
    forks: list[Any] = []

    def pre(mod: nn.Module, args: tuple) -> None:
        if not mod.training:
            return
        x = args[0] if args else None
        on_cuda = isinstance(x, torch.Tensor) and x.device.type == "cuda"
        r = int(torch.randint(0, 2**62, ()))
        fork = torch.random.fork_rng(devices=[x.device] if on_cuda else [], device_type="cuda")
        fork.__enter__()
        torch.manual_seed((r * 1_000_003 + tp_rank) % 2**63)
        forks.append(fork)

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        if mod.training and forks:
            forks.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _parallelize_layer(module: nn.Module, tp_mesh: DeviceMesh, style: Any) -> None:
    """``parallelize_module(module, tp_mesh, style)`` on a module that is a whole layer (an
    embedding, the head, the final norm), with the style's input and output hooks moved into the
    module's ``forward``: recompute (runtime.recompute) and pipeline stages wrap a layer's
    ``forward``, and a recomputed forward must redistribute as the first one did (a vocabulary-
    parallel embedding's masked partial sum reduced, the head's input gathered)."""
    pre_before, post_before = set(module._forward_pre_hooks), set(module._forward_hooks)
    parallelize_module(module, tp_mesh, style)
    pre = [(k, h, k in module._forward_pre_hooks_with_kwargs) for k, h in module._forward_pre_hooks.items() if k not in pre_before]
    post = [(k, h, k in module._forward_hooks_with_kwargs) for k, h in module._forward_hooks.items() if k not in post_before]
    for k, _, _ in pre:
        del module._forward_pre_hooks[k]
        module._forward_pre_hooks_with_kwargs.pop(k, None)
    for k, _, _ in post:
        del module._forward_hooks[k]
        module._forward_hooks_with_kwargs.pop(k, None)
        module._forward_hooks_always_called.pop(k, None)
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        for _, hook, with_kwargs in pre:
            if with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        out = inner(*args, **kwargs)
        for _, hook, with_kwargs in post:
            result = hook(module, args, kwargs, out) if with_kwargs else hook(module, args, out)
            if result is not None:
                out = result
        return out

    module.forward = forward  # type: ignore[method-assign]


def _copied_output(module: nn.Module, args: Any, out: Any) -> Any:
    """A converted module's output as a tensor of its own (TPRole.cloned): DTensor's to_local hands
    on a view made in its autograd function, which autograd refuses to let the model write in place."""
    return out.clone() if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else out


def _block_plan(layer: LayerSplit, sp: bool) -> dict[str, Any]:
    assert layer.tp is not None
    if not sp:
        plan: dict[str, Any] = {name: ColwiseParallel() for name in layer.tp.colwise}
        plan.update({name: RowwiseParallel() for name in layer.tp.rowwise})
        return plan
    assert layer.role is not None
    gathers = layer.role.gathers

    def gathered(sub: str) -> bool:
        return any(sub.startswith(g + ".") for g in gathers)

    keywords = dict(layer.role.gather_kwargs)
    plan = {g: _gather_input(keywords.get(g, "")) for g in gathers}
    for name in layer.tp.colwise:
        plan[name] = ColwiseParallel() if gathered(name) else ColwiseParallel(input_layouts=Shard(1))
    plan.update({name: RowwiseParallel(output_layouts=Shard(1)) for name in layer.tp.rowwise})
    return plan


def apply_tp(
    model: nn.Module, layers: tuple[LayerSplit, ...], tp_mesh: DeviceMesh, sequence_parallel: bool = True, ep: int = 1,
) -> TPLayout:
    """Shard `layers` of `model` (the whole model, or a pipeline stage module holding them) over
    `tp_mesh` as ``tp_layout(layers, tp, sequence_parallel, ep)`` says; returns that layout.
    `sequence_parallel`, `ep`: the plan's ``parallel.sequence_parallel`` and ``parallel.ep`` (with
    ep > 1 the mixture-of-experts blocks are left whole: module docstring)."""
    layout = tp_layout(layers, tp_mesh.size(), sequence_parallel, ep)
    sp = layout.sequence_parallel
    blocks = {l.name: l for l in layout.blocks}
    vocab = {l.name for l in layout.vocab}
    for layer in layers:
        module = model.get_submodule(layer.name)
        kind = layer.role.kind if layer.role is not None else ""
        if layer.name in blocks:
            parallelize_module(module, tp_mesh, _block_plan(blocks[layer.name], sp))
            for path in layer.role.local_heads if layer.role is not None else ():  # this rank's heads
                holder, _, attr = path.rpartition(".")
                owner = module.get_submodule(holder)
                setattr(owner, attr, getattr(owner, attr) // tp_mesh.size())
            if sp:
                assert layer.role is not None
                for norm in layer.role.norms:
                    _sequence_parallel(module.get_submodule(norm), tp_mesh)
                if layer.role.shard_at == layer.name:
                    _parallelize_layer(module, tp_mesh, _CutInput())
        elif kind == "embedding":
            assert layer.role is not None
            seq = Shard(layer.role.seq_dim if layer.role.seq_dim is not None else 1)
            shards = sp and not layer.role.shard_at  # else the first block takes the shard
            if layer.name in vocab:
                style: Any = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if shards else Replicate())
                _parallelize_layer(module, tp_mesh, style)
            elif shards:
                out = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
                _parallelize_layer(module, tp_mesh, out)
        elif kind == "norm" and sp:
            _sequence_parallel(module, tp_mesh, layer=True)
        elif kind == "head":
            if layer.name in vocab:
                lp = layout.loss_parallel
                style = ColwiseParallel(
                    input_layouts=Shard(1) if sp else Replicate(),
                    output_layouts=Shard(-1) if lp else Replicate(),
                    use_local_output=not lp,
                )
                _parallelize_layer(module, tp_mesh, style)
            elif sp:
                _parallelize_layer(module, tp_mesh, _gather_input())
        if layer.role is not None and (layer.name in blocks or layer.name in vocab):
            for name in layer.role.cloned:  # written in place by the model: a copy, not DTensor's view
                module.get_submodule(name).register_forward_hook(_copied_output)
    if sp:  # dropout on the sequence shards draws a mask of its own on every tp rank
        dropout = [name for l in layers if l.role is not None for name in l.role.shard_dropout]
        names = dict(model.named_modules())
        for name in dropout:
            if name in names:
                _own_dropout_masks(names[name], tp_mesh.get_local_rank())
    head = next((l.name for l in layers if l.role is not None and l.role.kind == "head"), None)
    logits = "" if head is None else (
        f"; {head}'s logits " + ("stay vocabulary-sharded into the loss" if layout.loss_parallel else "all-gathered for the loss")
    )
    log.info(
        "tensor parallel over %d ranks: %d block(s); vocabulary-parallel: %s; sequence parallel: %s%s",
        tp_mesh.size(), len(blocks), ", ".join(l.name for l in layout.vocab) or "none", sp, logits,
    )
    return layout
