"""A Mixtral-style mixture-of-experts decoder in plain PyTorch: examples/llama.py's decoder with
each layer's MLP replaced by a sparse block written as by hand in many training codes: a
bias-free router ``gate`` (Linear dim -> n_experts), softmax, the top ``top_k`` experts per token
with their weights renormalised, and an ``nn.ModuleList`` of SwiGLU ``experts`` (llama.py's
FeedForward), each called on the tokens routed to it (the loop skips experts no token chose). The planner finds the block by its structure (a router and a list of
identical experts: planner/profile/moe.py) and can split the experts over GPUs (``--ep``).

Default size (quick on a CPU): dim 64, 2 layers, 4 heads, 8 experts of ffn 128, top-2, vocab 256,
seq 64: about 0.45 M parameters, 0.39 M of them in the experts.
``build_moe(MoEConfig(...))`` makes other sizes.

    plan examples/moe.py --gpu cpu --gpus 4 --global-batch 8 --ep 2 --run
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import FeedForward, Llama, LlamaConfig, llama_batch  # noqa: E402


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2


class SparseMoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(cfg) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        return out.reshape(shape)


def build_moe(cfg: MoEConfig) -> Llama:
    """examples/llama.py's decoder with a SparseMoE in each layer's place of the MLP."""
    return Llama(cfg, mlp=SparseMoE)


CONFIG = MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab=256, seq_len=64)


def build_model() -> nn.Module:
    return build_moe(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
