"""Build the user's model for profiling: materialised on the CPU, or as fake tensors.

Fake mode builds the model on the ``meta`` device (no memory, user init is a no-op), then swaps
every parameter and buffer for a `FakeTensor` on the CPU device and runs under `FakeTensorMode`.
Why not run on ``meta`` directly: on meta, attention takes the unfused path and saves an s x s
tensor (855 MB against 269 MB per 4096-wide layer at seq 2048, DESIGN.md), and some Hugging Face
models refuse a meta forward; fake CPU tensors dispatch exactly as a real CPU run does, so the
FLOPs and saved bytes of a fake profile equal those of a materialised one.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

from planner.model_file import ModelHandle

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Materialise only when the estimate is under this share of available RAM: the estimate
# (fp32 build + cast copy + gradients + saved activations) leaves out the allocator's slack.
RAM_SHARE = 0.5


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def materialised_bytes_estimate(num_params: int, dtype: torch.dtype, activation_bytes: int) -> int:
    """Peak RAM of building in fp32, casting to `dtype`, holding gradients and activations."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    build = num_params * 4
    train = num_params * itemsize * 2  # weights + gradients
    return max(build, 0) + train + int(activation_bytes * 1.5)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors in an (inputs or targets) tree to `dtype`; leave integers alone."""
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree
    )


def build_materialised(handle: ModelHandle, dtype: torch.dtype) -> torch.nn.Module:
    model = handle.build_model()
    return model.to(dtype).train()


def build_meta(handle: ModelHandle, dtype: torch.dtype) -> torch.nn.Module:
    """The model built on the meta device (no memory, user init a no-op), in `dtype`, in training mode."""
    return handle.build_model("meta").to(dtype).train()


def build_fake(handle: ModelHandle, dtype: torch.dtype, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """The model with every parameter and buffer a FakeTensor on the CPU, in `dtype`."""
    return make_fake(build_meta(handle, dtype), fake_mode)


def _reachable(model: torch.nn.Module, leave: set[int]) -> list[torch.nn.Module]:
    """The modules of `model` reached without entering a module whose id is in `leave`."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    todo = [model]
    while todo:
        module = todo.pop()
        if id(module) in seen or id(module) in leave:
            continue
        seen.add(id(module))
        out.append(module)
        todo.extend(m for m in module._modules.values() if m is not None)
    return out


def make_fake(model: torch.nn.Module, fake_mode: FakeTensorMode, leave_meta: tuple[torch.nn.Module, ...] = ()) -> torch.nn.Module:
    """Swap the meta-built model's parameters and buffers for FakeTensors on the CPU, in place.

    Those held only by `leave_meta` modules stay on meta: blocks that a shortened trace does not
    run (repeats.py), whose shapes, dtypes and storages are all the profiler reads of them. A
    tensor they share with a module that runs is swapped everywhere (tied parameters stay tied)."""
    converter = fake_mode.fake_tensor_converter
    cpu = torch.device("cpu")

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return converter.from_meta_and_device(fake_mode, t, cpu)
        return fake_mode.from_tensor(t)

    memo: dict[int, torch.Tensor] = {}  # tied parameters stay tied
    for module in _reachable(model, {id(m) for m in leave_meta}):
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(fake(p.data), requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = fake(b)
            module._buffers[name] = memo[id(b)]
    for module in (s for m in leave_meta for s in m.modules()):
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None and id(t) in memo:
                    table[name] = memo[id(t)]
    return model


def _find_packed() -> Any:
    """Hugging Face's packed-sequence finder, None where transformers is not loaded."""
    return getattr(sys.modules.get("transformers.masking_utils"), "find_packed_sequence_indices", None)


def packed_rows(inputs: Any) -> bool:
    """Whether a row of the (real) inputs' ``position_ids`` packs several sequences, their positions
    restarting, as Hugging Face's mask builder finds them (find_packed_sequence_indices; False where
    transformers is not loaded or there are no such position ids)."""
    find = _find_packed()
    pos = inputs.get("position_ids") if isinstance(inputs, dict) else None
    if find is None or not isinstance(pos, torch.Tensor) or isinstance(pos, FakeTensor) or pos.dim() != 2:
        return False
    return find(pos) is not None


def fake_batch(batch: Any, fake_mode: FakeTensorMode) -> Any:
    return tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


@contextmanager
def one_sequence_per_row(every_call: bool = False) -> Iterator[None]:
    """Hugging Face's mask builder (transformers.masking_utils.find_packed_sequence_indices) cannot
    read fake position ids, so on fake tensors it takes the positions it made itself (0 .. seq - 1
    in every row) for packed sequences and hands SDPA an explicit mask, where the real run passes
    is_causal=True and no mask (a causal kernel, which context parallelism can split). Meanwhile,
    fake position ids count as one sequence per row, as the sample batch's are (`packed_rows`:
    the profiler's cp_blocker). `every_call`: real ones too (a context-parallel rank's shard,
    whose positions jump where its two chunks meet, once the whole micro-batch's were found one
    sequence per row: runtime.context_parallel)."""
    find = _find_packed()
    if find is None:
        yield
        return
    masking = sys.modules["transformers.masking_utils"]

    def unpacked_if_fake(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if every_call or isinstance(position_ids, FakeTensor):
            return None
        return find(position_ids, *args, **kwargs)

    masking.find_packed_sequence_indices = unpacked_if_fake
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find
