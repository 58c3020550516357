"""A Llama-style decoder (Llama 2 architecture) in plain PyTorch.

Layout (Hugging Face names): ``embed_tokens`` -> ``layers`` (an ``nn.ModuleList`` of decoder
layers) -> ``norm`` (RMSNorm) -> ``lm_head`` (not tied to the embedding). Each layer is
``x + self_attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``:

- attention: separate bias-free ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``; grouped-query
  attention (``n_kv_heads`` key/value heads shared by ``n_heads / n_kv_heads`` query heads each);
  rotary position embeddings (RoPE) on q and k; causal ``F.scaled_dot_product_attention``.
- MLP: SwiGLU, ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

RoPE's cos/sin tables, shape (seq_len, head_dim / 2), are non-persistent buffers computed in
``__init__`` with torch ops (so building under ``torch.device("meta")`` works). Each attention layer
holds its own copy, so every layer's ``forward(x)`` takes the hidden states alone and the model can
be cut between any two layers. After materialising a meta-built model (``to_empty``) call
``model.init_weights()`` to fill the parameters and recompute those tables.

Default size (quick on a CPU): dim 256, 4 layers, 8 heads, 2 kv heads, ffn 688, vocab 4096,
seq 256: about 4.9 M parameters (2.8 M in the layers, 1.0 M each in embed_tokens and lm_head).
``build_llama(LlamaConfig(...))`` makes other sizes; ``llama_7b.py`` and ``llama_70b.py`` have the
Llama-2 shapes. Inputs are token ids (B, seq_len); targets the next tokens; outputs logits.

    plan profile examples/llama.py --batch-size 8
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 256
    """Hidden width."""
    n_layers: int = 4
    """Number of decoder layers."""
    n_heads: int = 8
    """Query heads; dim must be a multiple of it unless head_dim is given (head_dim even, for RoPE)."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); n_heads must be a multiple of it."""
    ffn_dim: int = 688
    """Hidden width of the SwiGLU MLP."""
    vocab: int = 4096
    """Vocabulary size."""
    seq_len: int = 256
    """Context length: the length of the RoPE tables and of sample_batch's sequences."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    head_dim: int = 0
    """Width of one attention head; 0: dim / n_heads. Some models set it apart (Qwen3-30B-A3B: dim
    2048, 32 heads of 128), so that the attention's width n_heads x head_dim differs from dim."""

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) / n_heads ({self.n_heads}) must be a whole, even head_dim")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates halves)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta^(-2i/head_dim), each (seq_len, head_dim / 2), float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head of x (B, heads, T, head_dim) by the position angles."""
    T = x.shape[-2]
    cos, sin = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_rope(self) -> None:
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the shapes, so a tensor-parallel shard with fewer local heads works.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = apply_rope(q, self.rope_cos, self.rope_sin)
        k = apply_rope(k, self.rope_cos, self.rope_sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, mlp: Callable[[LlamaConfig], nn.Module] = FeedForward):
        """`mlp`: what follows attention (examples/moe.py passes a mixture of experts)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, mlp: Callable[[LlamaConfig], nn.Module] = FeedForward):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, mlp) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights, output projections scaled by 1/sqrt(2 * n_layers), unit norms, and
        fresh RoPE tables; call it after ``to_empty()`` on a model built on the meta device."""
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:  # RMSNorm weights
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, 0.02)
        for layer in self.layers:
            layer.self_attn.reset_rope()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_llama(cfg: LlamaConfig) -> Llama:
    return Llama(cfg)


def llama_batch(cfg: LlamaConfig, batch_size: int, seed: int = 0):
    """Random token ids (B, seq_len) and the next tokens as targets, reproducible per call."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


CONFIG = LlamaConfig()


def build_model() -> nn.Module:
    return build_llama(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
