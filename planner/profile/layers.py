"""Find a model's schedulable blocks ("units") and group them into layers.

Units: the children of every `ModuleList`/`Sequential` on the way down to the repeated blocks
(transformer layers, ResNet stages' blocks), and, at each level above, the sibling modules that
hold no such container (embeddings, final norm, head). A model with no container at all is split
into its direct children. Units are ordered by their first call in a real forward (see trace.py),
and a parameter-free unit (dropout, activation, pooling) is merged into a neighbour so that a layer
is something worth scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True)
class Unit:
    name: str
    module: nn.Module
    in_container: bool
    """A child of a ModuleList/Sequential: one of a stack of blocks."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _holds_container(module: nn.Module) -> bool:
    return any(isinstance(m, CONTAINERS) and len(m) > 0 for m in module.modules())


def _expand(name: str, module: nn.Module) -> list[Unit]:
    children = list(module.named_children())
    if isinstance(module, CONTAINERS):
        out: list[Unit] = []
        for child_name, child in children:
            full = _join(name, child_name)
            out += _expand(full, child) if isinstance(child, CONTAINERS) else [Unit(full, child, True)]
        return out
    if any(_holds_container(child) for _, child in children):
        return [u for child_name, child in children for u in _expand(_join(name, child_name), child)]
    return [Unit(name, module, False)]


def find_units(model: nn.Module) -> list[Unit]:
    """Candidate units in registration order (execution order is fixed later by tracing)."""
    units = _expand("", model)
    if len(units) == 1 and units[0].module is model:
        children = list(model.named_children())
        if len(children) >= 2:
            units = [Unit(n, m, False) for n, m in children]
    return units


def has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def group_units(units: list[Unit]) -> list[list[int]]:
    """Group units (already in execution order) into layers: lists of positions.

    A parameter-free unit joins the previous unit unless that one is a block of a stack (then the
    next non-block unit, e.g. ResNet's avgpool joins fc), so that stacked blocks stay identical.
    """
    groups: list[list[int]] = []
    pending: list[int] = []  # parameter-free units waiting for a following unit
    for pos, unit in enumerate(units):
        if has_params(unit.module):
            groups.append(pending + [pos])
            pending = []
            continue
        prev_ok = groups and not units[groups[-1][-1]].in_container
        if prev_ok and not pending:
            groups[-1].append(pos)
        else:
            pending.append(pos)
    if pending:
        if groups:
            groups[-1].extend(pending)
        else:
            groups.append(pending)
    return groups
