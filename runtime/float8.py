"""FP8 training (a plan with ``training.precision`` "fp8"), as the cost model prices it and
torchtitan runs it: torchao's Float8Linear in place of each nn.Linear, dynamic tensorwise scaling
(every operand cast to FP8 at each use: inputs and weights to e4m3, output gradients to e5m2), the
matmuls through torch._scaled_mm, everything else (weights, gradients, optimizer state, saved
activations) as the bf16 plan keeps it.

Applied before expert, tensor and data parallelism (torchtitan's model converters run before its
``parallelize_llama``). A Linear whose features are not multiples of 16 (torch._scaled_mm's
requirement; a GPT-2 head's 50,257-word vocabulary) stays in 16 bits. Grouped GEMMs (the experts'
torch._grouped_mm) are not Linears and stay in 16 bits too, as the cost model's torchao recipe
says. Under tensor parallelism the Float8 Linears take torch's plain Colwise/Rowwise styles: their
weights are DTensor shards, each cast with the whole tensor's scale, and the TP collectives move
16-bit activations, as the cost model prices them (torchao's Float8 TP styles, which gather in FP8,
are not used).

Each Float8Linear's forward runs under torch.compile (compile_float8_linears): torchao's casts are
written as several eager ops each (the absolute maximum, the scale, the scaled and clamped copy,
the conversion), which on an H200 made an FP8 step 1.3x-2.2x slower than the bf16 one
(bench/measured/h200_fp8_eager_2026-12-04.txt); compiled, each cast is the fused reduction and cast
the cost model prices (stage_costs.FP8_CAST_PASSES), as torchtitan runs Float8 (its blocks
compiled). Only the Linears' forwards are compiled, not the module hooks around them (tensor
parallelism's redistributions) nor the rest of the model, which stays eager as the plan prices it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x)."""


def float8_blocker(capability: tuple[int, int] | None) -> str | None:
    """Why this machine cannot run an FP8 plan (None: it can): `capability`, the first CUDA
    device's compute capability (None: no CUDA GPU)."""
    if capability is None:
        return ("runs on CUDA GPUs with FP8 tensor cores (compute capability 8.9 or newer: L40S, H100, H200, "
                "B200) and this machine has none")
    if capability < MIN_CAPABILITY:
        return f"needs FP8 tensor cores (compute capability 8.9 or newer) and this GPU is {capability[0]}.{capability[1]}"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "runs torchao's Float8 Linears and torchao is not installed (pip install torchao)"
    from torch.utils._triton import has_triton

    if not has_triton():  # torch.compile's CUDA kernels; eager casts would run slower than bf16
        return "compiles its Float8 Linears (torch.compile, which needs Triton on CUDA) and Triton is not installed"
    return None


def apply_float8(module: nn.Module) -> None:
    """Swap `module`'s nn.Linear layers for torchao's Float8Linear (dynamic tensorwise scaling),
    their forwards compiled (compile_float8_linears); those left in 16 bits (features not multiples
    of 16) are logged."""
    from torchao.float8 import convert_to_float8_training

    kept: list[str] = []

    def fp8(mod: nn.Module, name: str) -> bool:
        if not isinstance(mod, nn.Linear):
            return False
        if mod.in_features % 16 or mod.out_features % 16:
            kept.append(name)
            return False
        return True

    convert_to_float8_training(module, module_filter_fn=fp8)
    if kept:
        log.warning("FP8: %d Linear(s) stay in 16 bits (features not multiples of 16): %s", len(kept), ", ".join(kept))
    compile_float8_linears(module)


RECOMPILE_LIMIT = 64
"""Graphs torch.compile keeps per compiled function: one per distinct Linear shape (parameters are
compiled with static shapes), a few per model; torch's default (8) would leave the Linears past the
eighth shape eager."""


def compile_float8_linears(module: nn.Module) -> None:
    """Compile the forward of each of `module`'s Float8Linears (the casts fused, the matmul in
    torch._scaled_mm). Linears of the same shape share one graph."""
    from torchao.float8.float8_linear import Float8Linear

    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), RECOMPILE_LIMIT))
    for linear in module.modules():
        if isinstance(linear, Float8Linear):
            linear.forward = torch.compile(linear.forward)
