"""A hand-written DDP training loop: the yardstick for the runtime's overhead (bench_runtime.py).

    python -m torch.distributed.run --nproc-per-node N bench/ddp_baseline.py MODEL.py MICRO_BATCH STEPS OUT.json

Same model file, same micro-batch per rank, AdamW, fp32, gloo; no planner code on the hot path.
Rank 0 writes the median step time over the steps the runtime times (runtime.train.timed_steps:
the later half after the first, the runtime's profiled last step left out).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from planner.model_file import call_model, load_model_file  # noqa: E402
from runtime.train import PROFILE_MIN_STEPS, median_step_time  # noqa: E402


def main() -> None:
    model_path, micro_batch, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    handle = load_model_file(model_path)
    torch.manual_seed(0)
    model = DDP(handle.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = handle.sample_batch(micro_batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = handle.loss(call_model(model, inputs), targets)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_time_s": median_step_time(tuple(times), profiled=steps >= PROFILE_MIN_STEPS)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
