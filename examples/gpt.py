"""A small GPT (nanoGPT-style decoder-only transformer) in plain PyTorch.

Layout: token embedding ``wte`` + learned position embedding ``wpe`` -> dropout -> ``blocks``
(an ``nn.ModuleList`` of pre-LayerNorm blocks) -> final LayerNorm ``ln_f`` -> ``lm_head``.
Each block is ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; attention has SEPARATE ``q``, ``k``,
``v`` Linear projections (so tensor parallel can split them column-wise) and an output projection
``proj``; the MLP is ``up`` (h -> 4h), GELU, ``down`` (4h -> h). Embeddings and lm_head are not tied,
so every parameter belongs to exactly one layer.

``GPTConfig.attn`` picks the attention kernel:

- ``"sdpa"``: ``F.scaled_dot_product_attention(is_causal=True)`` (flash / memory-efficient kernels).
- ``"math"``: the explicit ``softmax(Q K^T / sqrt(d))`` with a causal ``masked_fill`` (a registered
  bool buffer ``future_mask``) and dropout on the attention probabilities, as in Korthikanti et al.
  2022, whose saved-activation count per layer is ``s*b*h*(34 + 5*a*s/h)`` bytes at 16-bit (with
  dropout > 0).

Default size (quick on a CPU): vocab 8192, seq 256, 6 layers, 6 heads, width 384, dropout 0.0:
about 17.0 M parameters (10.6 M in the blocks, 3.1 M each in wte and lm_head).
``build_gpt(GPTConfig(...))`` makes other sizes; see ``gpt2_small.py`` for the GPT-2-small shape.

Inputs are token ids ``idx`` of shape (B, seq_len); targets are the next tokens, same shape; the
output is logits (B, seq_len, vocab), so the default cross-entropy loss applies.

    plan profile examples/gpt.py --batch-size 8
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    """Vocabulary size (rows of wte, columns of lm_head)."""
    seq_len: int = 256
    """Context length: rows of wpe and the length of sample_batch's sequences."""
    n_layer: int = 6
    """Number of transformer blocks."""
    n_head: int = 6
    """Attention heads per block; n_embd must be a multiple of it."""
    n_embd: int = 384
    """Hidden width h."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (training only)."""
    attn: str = "sdpa"
    """"sdpa" (fused scaled_dot_product_attention) or "math" (explicit softmax, Korthikanti-style)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as in GPT-2."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.attn not in ("sdpa", "math"):
            raise ValueError(f"attn must be 'sdpa' or 'math', got {self.attn!r}")


def future_mask(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, 1, seq_len, seq_len) bool, True where the key lies after the query (hidden by the
    causal mask). Stored as the positions to hide so forward masks with a view of the buffer and
    creates no extra tensor."""
    ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    return ones.triu(diagonal=1).view(1, 1, seq_len, seq_len)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.n_embd
        self.n_head = cfg.n_head
        self.head_dim = h // cfg.n_head
        self.q = nn.Linear(h, h, bias=cfg.bias)
        self.k = nn.Linear(h, h, bias=cfg.bias)
        self.v = nn.Linear(h, h, bias=cfg.bias)
        self.proj = nn.Linear(h, h, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.attn = cfg.attn
        if cfg.attn == "math":
            self.attn_dropout = nn.Dropout(cfg.dropout)
            self.register_buffer("future_mask", future_mask(cfg.seq_len), persistent=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, C) -> (B, n_head, T, head_dim); views split by `n_head`, so a tensor-parallel
        # shard with fewer local heads works as long as head_dim stays the same.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.attn == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            att = att.masked_fill(self.future_mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init (nanoGPT): N(0, 0.02) weights, residual projections scaled by
        1/sqrt(2 * n_layer), zero biases, unit LayerNorms, and the causal mask recomputed; call it
        after ``to_empty()`` on a model built on the meta device."""
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, out_std if name.endswith(("proj.weight", "down.weight")) else 0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            elif isinstance(m, CausalSelfAttention) and hasattr(m, "future_mask"):
                m.future_mask.copy_(future_mask(m.future_mask.shape[-1], m.future_mask.device))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        assert T <= self.cfg.seq_len, f"sequence length {T} > seq_len {self.cfg.seq_len}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(cfg: GPTConfig) -> GPT:
    return GPT(cfg)


def gpt_batch(cfg: GPTConfig, batch_size: int, seed: int = 0):
    """Random token ids (B, seq_len) and the next tokens as targets, reproducible per call."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


CONFIG = GPTConfig()


def build_model() -> nn.Module:
    return build_gpt(CONFIG)


def sample_batch(batch_size: int):
    return gpt_batch(CONFIG, batch_size)
