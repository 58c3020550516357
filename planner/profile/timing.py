"""Forward and backward seconds per unit, measured on the local device.

The same attribution as trace.py, with timestamps instead of a dispatch mode (which would slow
every op): the clock is charged to the running unit at each unit boundary. The caller has run one
step already (the trace, as warm-up); `repeats` timed steps follow and the median per unit is kept
(CPU timings vary 3-10% step to step).
Boundaries are exact on the CPU, where ops run synchronously; on CUDA the device is synchronised
at each boundary.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from planner.model_file import ModelHandle
from planner.profile.layers import Unit
from planner.profile.trace import BEFORE_ANY, watch_units


class _Clock:
    def __init__(self, num_units: int, sync) -> None:
        self.fwd = [0.0] * num_units
        self.bwd = [0.0] * num_units
        self.sync = sync
        self.unit = BEFORE_ANY
        self.backward = False
        self.t = time.perf_counter()

    def switch(self, unit: int) -> None:
        self.sync()
        now = time.perf_counter()
        if self.unit != BEFORE_ANY:
            (self.bwd if self.backward else self.fwd)[self.unit] += now - self.t
        self.unit, self.t = unit, now


def time_units(
    handle: ModelHandle,
    model: torch.nn.Module,
    units: list[Unit],
    first_unit: int,
    inputs: Any,
    targets: Any,
    repeats: int = 3,
) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds per unit (unit order as in `units`)."""
    device = next(model.parameters()).device if next(model.parameters(), None) is not None else None
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    runs: list[_Clock] = []
    clock = _Clock(len(units), sync)

    def switch(index: int) -> None:
        clock.switch(index)

    try:
        with watch_units(units, switch, None, switch):
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                clock = _Clock(len(units), sync)
                clock.unit = first_unit  # glue before the first unit is charged to it
                clock.t = time.perf_counter()
                outputs = handle.forward(model, inputs)
                loss = handle.loss(outputs, targets)
                clock.switch(clock.unit)  # close the forward's last interval
                clock.backward = True
                loss.backward()
                clock.switch(clock.unit)
                runs.append(clock)
    finally:
        model.zero_grad(set_to_none=True)
    fwd = [statistics.median(r.fwd[i] for r in runs) for i in range(len(units))]
    bwd = [statistics.median(r.bwd[i] for r in runs) for i in range(len(units))]
    return fwd, bwd
