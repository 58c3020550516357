"""Stage 1: ModelHandle -> ModelProfile (per-layer parameters, FLOPs, memory, time)."""

from planner.profile.profiler import profile_model
from planner.profile.types import Edge, LayerProfile, ModelProfile, ProfileTotals

__all__ = ["profile_model", "ModelProfile", "LayerProfile", "ProfileTotals", "Edge"]
