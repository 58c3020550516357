"""Types the runtime's modules share: a layer as the runtime shards it (LayerSplit: the plan's
PlanLayer, with its TPInfo and TPRole), a plan that passed the preflight checks (Prepared).

A leaf module: it imports nothing from the runtime, so preflight, layout, the parallelisms, the
pipeline and the worker all import it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.model_file import ModelHandle
from planner.plan import Plan, PlanLayer
from planner.profile.types import NO_BLOCK, TPRole  # noqa: F401 (re-exported)

LayerSplit = PlanLayer
"""One layer of the model as the runtime shards it: the plan's, with the profiler's TPInfo and TPRole."""


@dataclass(frozen=True)
class Prepared:
    """A plan that passed the checks, with what the launcher and the workers need."""

    plan: Plan
    plan_path: Path
    handle: ModelHandle
    layers: tuple[LayerSplit, ...]
    device_type: str
    """"cpu" (gloo) or "cuda" (nccl)."""

    @property
    def world_size(self) -> int:
        p = self.plan.parallel
        return p.world_size
