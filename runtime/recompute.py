"""Recompute: the forward of every layer the plan names runs under
``torch.utils.checkpoint(use_reentrant=False)``; ``selective_layers`` run as full recompute in this slice.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.plan import Plan

log = logging.getLogger(__name__)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_recompute(model: nn.Module, plan: Plan) -> list[str]:
    """Recompute the plan's layers in backward (full checkpoint); returns their names."""
    stage = plan.stages[0]
    names = list(dict.fromkeys((*stage.recompute_layers, *stage.selective_layers)))
    return apply_recompute_layers(model, names)


def apply_recompute_layers(model: nn.Module, names: list[str]) -> list[str]:
    """Recompute the named layers of `model` in backward (full checkpoint); returns the names."""
    for name in names:
        module = model.get_submodule(name)
        # An instance attribute: the module's __call__ (and the hooks FSDP adds) still run around it.
        module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]
    log.info("recompute: %d layer(s)", len(names))
    return names
