"""Recompute: the layers the plan names run their forward under
``torch.utils.checkpoint(use_reentrant=False)`` and are recomputed in backward.

- ``recompute_layers``: full checkpoint (only the layer's input is kept).
- ``selective_layers``: selective activation checkpointing (PyTorch's SAC, torchtitan's op-level
  "save matmuls" policy): ``create_selective_checkpoint_contexts`` with a policy that returns
  ``MUST_SAVE`` for every matmul-like op and ``PREFER_RECOMPUTE`` for the rest (norms,
  activations, softmax, dropout, elementwise). "Matmul-like" is the profiler's test for
  ``activation_matmul_bytes`` (``planner.profile.flops.kept_by_selective``): an op with a FLOP
  formula (mm, addmm, ``_scaled_mm``, the SDPA kernels including the CPU flash one, convolutions;
  ``nn.Linear`` reaches the dispatcher as addmm/mm) except the batched matmuls of an unfused
  attention (bmm, baddbmm: Q K^T and the scores times V), whose s x s inputs and outputs are what
  Megatron-LM's selective recompute drops (Korthikanti et al. 2022).

- ``alternate_layers``: the same, except that every second Linear matmul of the layer's forward
  (``planner.profile.flops.is_linear_matmul``: mm/addmm, counted from the layer's first, afresh for
  each call and for its recompute) is recomputed too: torchtitan's default per-op policy ("save
  every other matmul", ``selective_ac_option = "op"``). The profile counts the same matmuls
  (``activation_alternate_bytes``, ``fwd_alternate_flops``).

The non-reentrant checkpoint stashes the RNG state (``preserve_rng_state=True``, the default) and
restores it for the recompute, and the saved ops draw no random numbers, so dropout recomputes the
same masks (tests/unit/test_recompute.py checks gradients equal the plain layer's with dropout).

SAC keeps every matmul output, also one autograd would not save (a projection feeding a residual
add); the profile's ``activation_matmul_bytes`` counts exactly those outputs, so the plan's
selective figure is what runs (tests/unit/test_recompute.py: 90,112 bytes both, examples/gpt.py's block).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from runtime.phases import RECOMPUTE_SCOPE, in_backward, scope
from planner.profile.flops import is_linear_matmul, kept_by_selective  # also registers the CPU flash-attention formula

log = logging.getLogger(__name__)


def is_matmul_like(op: Any) -> bool:
    """What selective recompute keeps (``planner.profile.flops.kept_by_selective``): matmul-like
    ops other than an unfused attention's batched matmuls."""
    return getattr(op, "overloadpacket", None) is not None and kept_by_selective(op)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_matmul_like(op) else CheckpointPolicy.PREFER_RECOMPUTE


@functools.lru_cache(maxsize=None)
def _passing(mode_type: type) -> type:
    """`mode_type` (one of selective checkpointing's dispatch modes) passing the profiler's ops
    through; made once per type (every checkpointed call makes a pair of modes)."""
    class Passing(mode_type):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if getattr(func, "namespace", None) == "profiler":
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Passing


def _without_profiler_ops(modes: tuple[Any, Any]) -> tuple[Any, Any]:
    """Selective checkpointing's two dispatch modes (forward, recompute), passing the profiler's
    record-function ops straight through instead of counting them: the recompute must meet the
    forward's ops one for one, and FSDP2 enters a record_function ("FSDP::root_pre_forward") when
    one of its units runs first in a recompute (an expert's, inside a checkpointed layer), which
    the forward, under the model's root, never did."""
    for mode in modes:
        mode.__class__ = _passing(type(mode))
    return modes


def _selective_context() -> Any:
    return _without_profiler_ops(create_selective_checkpoint_contexts(_save_matmuls))


def _alternate_context() -> Any:
    """One checkpointed call's policy: a fresh count of Linear matmuls for the forward and one for
    the recompute, so both make the same choices."""
    calls = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", None) is not None and is_linear_matmul(op):
            calls[ctx.is_recompute] += 1
            if calls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _save_matmuls(ctx, op, *args, **kwargs)

    return _without_profiler_ops(create_selective_checkpoint_contexts(policy))


CONTEXTS = {"full": None, "selective": _selective_context, "alternate": _alternate_context}


def _checkpointed(module: nn.Module, forward: Callable[..., Any], kind: str = "full") -> Callable[..., Any]:
    context_fn = CONTEXTS[kind]
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    def body(*args: Any, **kwargs: Any) -> Any:
        # The recompute calls only this (not the module's __call__ nor a forward wrapped later): a
        # `_forward_context` the module carries (DDP over TP swapping its shards' DTensor views in:
        # runtime.data_parallel.localize_tp_for_ddp) is entered here, in forward and in recompute.
        context = getattr(module, "_forward_context", None)
        with context() if context is not None else contextlib.nullcontext(), \
                scope(RECOMPUTE_SCOPE) if in_backward() else contextlib.nullcontext():
            return forward(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(body, *args, use_reentrant=False, **extra, **kwargs)

    return run


def recompute_of(stage: Any) -> dict[str, str]:
    """A plan stage's recomputed layers: name -> full | selective | alternate."""
    out: dict[str, str] = {}
    for kind, names in (("full", stage.recompute_layers), ("alternate", getattr(stage, "alternate_layers", ())),
                        ("selective", stage.selective_layers)):
        for name in names:
            out.setdefault(name, kind)  # a layer named twice gets the leaner policy
    return out


def apply_recompute_layers(model: nn.Module, kinds: dict[str, str]) -> list[str]:
    """Recompute the named layers of `model` in backward, each with its policy (`kinds`: name ->
    full | selective | alternate). The names."""
    for name, kind in kinds.items():
        module = model.get_submodule(name)
        # An instance attribute: the module's __call__ (and the hooks FSDP adds) still run around it.
        module.forward = _checkpointed(module, module.forward, kind)  # type: ignore[method-assign]
    counts = {k: sum(1 for v in kinds.values() if v == k) for k in CONTEXTS}
    log.info("recompute: %d layer(s) full, %d selective, %d alternate", counts["full"], counts["selective"], counts["alternate"])
    return list(kinds)
