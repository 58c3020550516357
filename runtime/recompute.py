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

The non-reentrant checkpoint stashes the RNG state (``preserve_rng_state=True``, the default) and
restores it for the recompute, and the saved ops draw no random numbers, so dropout recomputes the
same masks (tests/unit/test_recompute.py checks gradients equal the plain layer's with dropout).

SAC keeps every matmul output, also one autograd would not save (a projection feeding a residual
add); the profile's ``activation_matmul_bytes`` counts exactly those outputs, so the plan's
selective figure is what runs (tests/unit/test_recompute.py: 90,112 bytes both, examples/gpt.py's block).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.plan import Plan
from planner.profile.flops import kept_by_selective  # also registers the CPU flash-attention formula

log = logging.getLogger(__name__)


def is_matmul_like(op: Any) -> bool:
    """What selective recompute keeps (``planner.profile.flops.kept_by_selective``): matmul-like
    ops other than an unfused attention's batched matmuls."""
    return getattr(op, "overloadpacket", None) is not None and kept_by_selective(op)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_matmul_like(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpointed(module: nn.Module, forward: Callable[..., Any], selective: bool = False) -> Callable[..., Any]:
    extra = {"context_fn": _selective_context} if selective else {}

    def body(*args: Any, **kwargs: Any) -> Any:
        # The recompute calls only this (not the module's __call__ nor a forward wrapped later): a
        # `_forward_context` the module carries (DDP over TP swapping its shards' DTensor views in:
        # runtime.data_parallel.localize_tp_for_ddp) is entered here, in forward and in recompute.
        context = getattr(module, "_forward_context", None)
        with context() if context is not None else contextlib.nullcontext():
            return forward(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(body, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_recompute(model: nn.Module, plan: Plan) -> list[str]:
    """Recompute the plan's layers in backward (full or selective); returns their names."""
    stage = plan.stages[0]
    return apply_recompute_layers(model, list(stage.recompute_layers), list(stage.selective_layers))


def apply_recompute_layers(model: nn.Module, names: list[str], selective: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Recompute the named layers of `model` in backward: `names` with a full checkpoint,
    `selective` with the save-matmuls policy (a layer in both gets the full one). The names."""
    full = list(dict.fromkeys(names))
    sel = [n for n in dict.fromkeys(selective) if n not in set(full)]
    for name, is_sel in [*((n, False) for n in full), *((n, True) for n in sel)]:
        module = model.get_submodule(name)
        # An instance attribute: the module's __call__ (and the hooks FSDP adds) still run around it.
        module.forward = _checkpointed(module, module.forward, is_sel)  # type: ignore[method-assign]
    log.info("recompute: %d layer(s) full, %d selective", len(full), len(sel))
    return full + sel
