"""Mixture-of-experts blocks, found in any model by their structure.

A block is a module that holds a router and its experts, in one of two forms:

- a list: an ``nn.ModuleList`` of two or more experts of identical structure (same class, same
  parameter names and shapes), the user's forward calling each expert on its tokens (Switch /
  Mixtral-style code written by hand);
- stacked: one module whose parameters are all 2-D or more with the same leading size E (the
  experts) and at least one 3-D (Hugging Face 5.x ``MixtralExperts``, ``Qwen2MoeExperts``, ...:
  ``forward(hidden_states, top_k_index, top_k_weights)``).

Either way the block also holds, outside the experts, a router: a module whose ``weight`` is
(E, hidden), an ``nn.Linear(hidden, E)`` or Hugging Face's ``*TopKRouter``. The runtime's expert
parallelism (runtime/expert_parallel.py) and the profiler find the same blocks through
`find_moe`.

A list block's forward picks each expert's tokens by their values (``torch.where`` on the
routing), which fake tensors cannot run. `balanced_dispatch` gives such blocks, on the model the
profiler traces with fake tensors, a stand-in forward that sends each expert an equal share of
the tokens x top-k rows: whatever the routing, the experts see tokens x top-k rows in all, so the
step's FLOPs and saved bytes are those of any routing (a real trace measures the user's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

TOP_K_NAMES = ("top_k", "num_experts_per_tok", "topk", "moe_top_k", "router_topk", "k")
"""Attributes a block, its router or its experts may name the experts per token by."""


@dataclass(frozen=True)
class MoEBlock:
    name: str
    """The module holding the router and the experts ("" for the root)."""
    experts: str
    """The experts: a ModuleList, or a stacked module (qualified names)."""
    router: str
    num_experts: int
    stacked: bool
    top_k: Optional[int]
    """Experts per token, from an attribute (TOP_K_NAMES) of the block, router or experts; None
    when none says (the profiler measures it)."""


def _signature(module: nn.Module) -> tuple:
    return (type(module),) + tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def _identical_experts(module: nn.Module) -> int:
    """E when `module` is a ModuleList of E >= 2 experts with parameters and the same structure, else 0."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return 0
    first = _signature(module[0])
    if len(first) == 1 or any(_signature(m) != first for m in module):
        return 0
    return len(module)


def _stacked_experts(module: nn.Module) -> int:
    """E when every parameter of `module` (its own, none in children) has leading size E >= 2,
    at least one is 3-D and all are 2-D or more; else 0."""
    params = list(module.named_parameters())
    if not params or any("." in n for n, _ in params):
        return 0
    sizes = {p.shape[0] for _, p in params if p.dim() >= 2}
    if len(sizes) != 1 or any(p.dim() < 2 for _, p in params) or not any(p.dim() == 3 for _, p in params):
        return 0
    (e,) = sizes
    return int(e) if e >= 2 else 0


def _router(block: nn.Module, experts: nn.Module, num_experts: int) -> Optional[str]:
    """The submodule of `block` (outside `experts`) whose weight is (num_experts, hidden)."""
    inside = {id(m) for m in experts.modules()}
    for name, module in block.named_modules():
        if id(module) in inside or module is block:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] == num_experts:
            return name
    return None


def _top_k(*modules: nn.Module) -> Optional[int]:
    for module in modules:
        for attr in TOP_K_NAMES:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return value
    return None


def find_moe(model: nn.Module) -> list[MoEBlock]:
    """Every mixture-of-experts block of `model`, in module order (an empty list when none)."""
    found: list[MoEBlock] = []
    claimed: set[int] = set()
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if id(child) in claimed:
                continue
            stacked = False
            num = _identical_experts(child)
            if not num:
                num, stacked = _stacked_experts(child), True
            if not num:
                continue
            router = _router(parent, child, num)
            if router is None:
                continue
            claimed.add(id(child))
            prefix = f"{parent_name}." if parent_name else ""
            found.append(MoEBlock(
                name=parent_name, experts=prefix + child_name, router=prefix + router, num_experts=num,
                stacked=stacked, top_k=_top_k(parent, parent.get_submodule(router), child),
            ))
    return found


def _balanced_forward(router: nn.Module, experts: nn.ModuleList, top_k: int) -> Callable[..., Any]:
    num = len(experts)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        scores = router(h).softmax(dim=-1)
        tokens, total = h.shape[0], h.shape[0] * top_k
        out = torch.zeros_like(h)
        start = 0
        for e, expert in enumerate(experts):
            n = total // num + (1 if e < total % num else 0)
            rows = (torch.arange(n, device=h.device) + start) % tokens
            start += n
            out = out.index_add(0, rows, expert(h[rows]) * scores[rows, e : e + 1].to(h.dtype))
        return out.reshape(x.shape)

    return forward


def balanced_dispatch(model: nn.Module) -> int:
    """Give every list block of `model` whose top-k is known a forward that routes tokens x top-k
    rows evenly over its experts (the module docstring says why); the number of blocks changed.
    Only for the model the profiler traces on fake tensors: the stand-in is not the user's routing."""
    changed = 0
    for block in find_moe(model):
        if block.stacked or block.top_k is None:
            continue
        module = model.get_submodule(block.name)
        module.forward = _balanced_forward(model.get_submodule(block.router), model.get_submodule(block.experts),
                                           block.top_k)
        changed += 1
    return changed
