"""The types `plan whatif` and its headroom share: the sweep's request (SweepSpec), one grid
point's result (Point) and a single cluster's memory headroom (Headroom).

A leaf of planner.report: ``whatif`` and ``headroom`` both import it, and it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from planner.plan import Plan
from planner.planning import PlanRequest


@dataclass(frozen=True)
class Headroom:
    memory_free_bytes: int
    micro_batch: int
    max_micro_batch: int
    max_micro_batch_capped: bool
    """True: it still fit at the cap (MAX_MICRO_BATCH); the limit is higher."""
    global_batch: int
    max_global_batch: int
    max_global_batch_capped: bool
    model_scale: float
    model_scale_capped: bool
    max_params: int
    seq_scale: Optional[float]
    seq_scale_capped: bool
    max_seq_len: Optional[int]


@dataclass(frozen=True)
class SweepSpec:
    """What the user asked: the grid, the training length, the prices."""

    gpu_types: tuple[str, ...]
    gpu_counts: tuple[int, ...]
    global_batch: Optional[int] = None
    tokens: Optional[float] = None
    steps: Optional[int] = None
    prices_per_gpu_hour: tuple[tuple[str, float], ...] = ()
    deadline_days: Optional[float] = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    gpus_per_node: Optional[int] = None
    memory_limit_gib: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    trainer: str = "this"
    """The trainer that will run the plans (plan --trainer)."""
    compile: bool = False
    """It runs them under torch.compile (plan --compile)."""
    scale_batch: bool = False
    """Grow the global batch with the GPU count (the same samples per GPU as the smallest count)
    instead of holding it fixed."""

    def request(self, gpu: str, num_gpus: int, global_batch: Optional[int]) -> PlanRequest:
        """The PlanRequest `plan MODEL.py --gpus num_gpus --gpu gpu --global-batch B ...` would make."""
        return PlanRequest(
            gpus=num_gpus, gpu=gpu, gpus_per_node=self.gpus_per_node, global_batch=global_batch,
            precision=self.precision, optimizer=self.optimizer, memory_limit_gib=self.memory_limit_gib,
            inter_node_gbps=self.inter_node_gbps, trainer=self.trainer, compile=self.compile,
        )

    def price(self, gpu: str) -> Optional[float]:
        return dict(self.prices_per_gpu_hour).get(gpu)


@dataclass(frozen=True)
class Point:
    """One GPU type and count: the best plan `plan` finds there, or why nothing fits."""

    gpu: str
    display_name: str
    num_gpus: int
    fits: bool
    plan: str
    """The plan in one line, or why nothing fits."""
    global_batch: Optional[int]
    micro_batch: Optional[int]
    step_time_s: Optional[float]
    samples_per_s: Optional[float]
    tokens_per_s: Optional[float]
    mfu: Optional[float]
    peak_memory_bytes: Optional[int]
    """The fullest GPU of the plan; when nothing fits, the least any candidate needs."""
    memory_limit_bytes: int
    steps: Optional[int] = None
    days_to_train: Optional[float] = None
    gpu_hours: Optional[float] = None
    cost_usd: Optional[float] = None
    scaling_efficiency: Optional[float] = None
    batch_note: str = ""
    """Why this point's global batch is not the sweep's (empty when it is)."""
    detail: Optional[Plan] = field(default=None, compare=False, repr=False)
    """The full Plan (for the report's memory and pipeline charts); not in CSV/JSON rows."""

    @property
    def label(self) -> str:
        return f"{self.num_gpus} x {self.gpu}"

    def row(self) -> dict:
        """The CSV/JSON fields, in order."""
        return {k: v for k, v in vars(self).items() if k != "detail"}
