"""A Mixtral-style mixture-of-experts decoder in plain PyTorch (examples/llama.py's attention).

Each layer is ``x + self_attn(norm(x))`` then ``x + moe(norm(x))``, where ``moe`` is a sparse
block written as by hand in many training codes: a bias-free router ``gate`` (Linear dim ->
n_experts), softmax, the top ``top_k`` experts per token with their weights renormalised, and an
``nn.ModuleList`` of SwiGLU ``experts``, each called on the tokens routed to it (the loop skips
experts no token chose). The planner finds the block by its structure (a router and a list of
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
from llama import Attention, LlamaConfig, RMSNorm, llama_batch  # noqa: E402


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2


class Expert(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))

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


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = SparseMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.moe(self.post_attention_layernorm(x))


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(MoELayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_moe(cfg: MoEConfig) -> MoEModel:
    return MoEModel(cfg)


CONFIG = MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab=256, seq_len=64)


def build_model() -> nn.Module:
    return build_moe(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
