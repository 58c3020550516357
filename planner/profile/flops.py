"""FLOP formulas: torch's `flop_counter` registry, plus the ops it misses, plus op triage.

`torch.utils.flop_counter` counts matmuls, convolutions and the CUDA attention kernels (one
multiply-add = 2 FLOPs, forward and backward). On CPU tensors (real or fake) attention dispatches
to ``_scaled_dot_product_flash_attention_for_cpu``, which it does not count: registered here with
the same formula as the other SDPA kernels (2 matmuls forward, 4 backward-equivalent; causal
masking not discounted, as in Megatron's and PaLM's MFU accounting).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

aten = torch.ops.aten


def _register_missing() -> None:
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in flop_registry:

        @register_flop_formula(fwd)
        def _cpu_flash_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_flop_count(query_shape, key_shape, value_shape)

    if bwd is not None and bwd not in flop_registry:

        @register_flop_formula(bwd)
        def _cpu_flash_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


    grouped = getattr(aten, "_grouped_mm", None)
    if grouped is not None and grouped not in flop_registry:

        @register_flop_formula(grouped)
        def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
            # Mixture-of-experts GEMMs (one weight per group of rows). Every row of `a` meets one
            # group's (K, N) matrix, whatever the groups: 2 x numel(a) x N, for each layout
            # (2-D x 3-D, 3-D x 3-D, and the weight gradient's 2-D x 2-D split along the rows).
            return 2 * math.prod(a_shape) * b_shape[-1]


_register_missing()

# Ops without a formula that are cheap by nature (memory-bound: elementwise, normalisation,
# reductions, data movement). They are not reported as "uncounted"; anything else is.
_CHEAP_PREFIXES = (
    "_to_copy", "copy", "clone", "empty", "zeros", "ones", "full", "fill", "arange", "lift",
    "detach", "alias", "view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute",
    "squeeze", "unsqueeze", "slice", "select", "split", "unbind", "chunk", "cat", "stack",
    "index", "gather", "scatter", "embedding", "masked_fill", "where", "tril", "triu",
    "native_layer_norm", "native_batch_norm", "_native_batch_norm", "batch_norm", "layer_norm",
    "_fused_rms_norm", "rms_norm", "_softmax", "_log_softmax", "softmax", "native_dropout",
    "dropout", "bernoulli", "rand", "nll_loss", "mse_loss", "sum", "mean", "var", "std", "amax",
    "max", "min", "argmax", "cumsum", "sort", "topk", "sigmoid", "tanh", "relu", "threshold",
    "gelu", "silu", "hardtanh", "leaky_relu", "elu", "neg", "rsqrt", "sqrt", "pow", "exp", "log",
    "abs", "sign", "clamp", "div", "mul", "add", "sub", "rsub", "eq", "ne", "lt", "le", "gt", "ge",
    "logical", "bitwise", "any", "all", "isnan", "isinf", "max_pool", "avg_pool",
    "adaptive_avg_pool", "adaptive_max_pool", "_adaptive_avg_pool", "upsample", "pad",
    "constant_pad", "new_ones", "new_empty", "new_full", "as_strided", "_reshape_alias", "repeat", "roll", "flip", "cos", "sin",
    "reciprocal", "_local_scalar_dense", "sym_", "_assert", "scalar_tensor", "zero_", "normal",
    "uniform", "floor", "ceil", "round", "trunc", "frac", "fmod", "remainder", "maximum",
    "minimum", "lerp", "addcmul", "addcdiv", "_unsafe_index", "im2col", "col2im", "unfold",
    "_foreach", "linalg_vector_norm", "norm", "erf", "logsumexp", "_safe_softmax", "_log_softmax",
    "masked_scatter", "index_put", "polar", "view_as_real", "view_as_complex", "complex",
    "_efficientzerotensor", "nonzero", "histc", "bincount", "one_hot", "argsort", "searchsorted", "device", "layout", "dim", "size", "stride", "numel", "is_", "ones_like", "zeros_like", "empty_like", "full_like", "new_zeros",
)


def op_name(func) -> str:
    return func.overloadpacket.__name__


def formula_for(func):
    """The FLOP formula for an aten op overload, or None."""
    return flop_registry.get(func.overloadpacket)


ATTENTION_CORE = {torch.ops.aten.bmm, torch.ops.aten.baddbmm}
"""Batched matmuls: in an unfused attention, Q K^T and (softmax) V, whose outputs hold the
s x s scores and are what Megatron-LM's selective recompute exists to drop (Korthikanti et al.
2022, section 5); projections reach the dispatcher as mm/addmm, fused attention as SDPA kernels."""


def kept_by_selective(func) -> bool:
    """Whether selective recompute keeps this op's outputs: a matmul-like op (a FLOP formula:
    mm/addmm projections, SDPA kernels, convolutions) other than the attention core's batched
    matmuls. The runtime's checkpoint policy (runtime/recompute.py) and the profile's
    activation_matmul_bytes use this one test, so the plan's selective figure is what runs."""
    return formula_for(func) is not None and func.overloadpacket not in ATTENTION_CORE


def is_attention(func) -> bool:
    """A fused attention kernel (what scaled_dot_product_attention dispatches to: flash,
    memory-efficient, cuDNN or the CPU flash kernel, forward or backward; not the math fallback's
    matmuls, which reach the dispatcher as bmm)."""
    return op_name(func).startswith("_scaled_dot_product_") and formula_for(func) is not None


_LINEAR = {torch.ops.aten.mm, torch.ops.aten.addmm}
"""How nn.Linear reaches the dispatcher (forward and both backward matmuls)."""


def is_linear_matmul(func) -> bool:
    """A Linear layer's matmul: what FP8 training converts (torchao's Float8Linear swaps nn.Linear,
    as torchtitan and Transformer Engine do); attention kernels, batched matmuls and convolutions
    stay in 16 bits."""
    return func.overloadpacket in _LINEAR


def is_grouped_matmul(func) -> bool:
    """A grouped GEMM (torch._grouped_mm: every expert's rows of a mixture of experts in one
    kernel). Transformer Engine's FP8 runs them in 8 bits (its GroupedLinear), torchao's
    Float8Linear, which swaps nn.Linear only, does not."""
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    return grouped is not None and func.overloadpacket is grouped


def is_cheap(func) -> bool:
    if torch.Tag.pointwise in getattr(func, "tags", ()) or getattr(func, "is_view", False):
        return True
    name = op_name(func).strip("_")
    return name in _CHEAP_EXACT or name.startswith(_CHEAP_LONG)


_CHEAP_NAMES = tuple(p.strip("_") for p in _CHEAP_PREFIXES)
# Short names match exactly ("t" must not swallow "tensordot"), longer ones as prefixes.
_CHEAP_EXACT = frozenset(p for p in _CHEAP_NAMES if len(p) < 4)
_CHEAP_LONG = tuple(p for p in _CHEAP_NAMES if len(p) >= 4)
