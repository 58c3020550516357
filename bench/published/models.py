"""The model file (build_model, sample_batch) each row's shape describes, built from examples/.

- GPT rows: examples/gpt.py at the row's shape. Sources from 2021-22 (Narayanan et al. SC'21,
  Korthikanti et al.) ran Megatron-LM before flash attention (Dao et al. 2022) reached it:
  attention scores materialised, one fused scale-mask-softmax pass, dropout 0.1. Later sources
  (Megatron-Core r0.8, 2024) run fused flash attention: SDPA, whose dropout regenerates its mask
  from the RNG state and saves nothing (so the SDPA call here runs without dropout; the hidden
  dropout of 0.1, Megatron's default, stays).
- Llama rows (torchtitan): examples/llama.py (GQA, SwiGLU, RMSNorm, RoPE, untied head, SDPA
  flash attention as torchtitan runs it).
- Mixture-of-experts rows: examples/llama.py's decoder with, in each layer's place of the MLP, a
  router and stacked SwiGLU experts of the row's expert width run as grouped GEMMs
  (torch._grouped_mm: one kernel per projection for all experts, as Megatron-Core's
  --moe-grouped-gemm and torchtitan do, not a Python loop over experts), every expert given an
  equal share of the tokens x top-k rows, as the published MoE benchmarks force-balance their
  routing (Megatron-Bridge's performance summary), with the permutation into expert order and
  back; shared experts as one SwiGLU of their width beside the routed ones; dense first layers
  (DeepSeek-V3's 3), and dense layers between the expert ones where a model interleaves them
  (Llama 4 Maverick: every 2nd layer an expert layer); multi-head latent attention (DeepSeek-V2/V3: low-rank queries, keys and
  values from one latent, values padded to the key width for one fused kernel). Not built:
  DeepSeek-V3's multi-token prediction module, sliding-window attention (as full attention,
  noted).
- MPT rows (llm-foundry): bias-free pre-LayerNorm GPT blocks of examples/gpt.py, tied embedding
  and head, no learned positions, SDPA flash attention, no dropout. Approximated: ALiBi's bias is
  fused into MPT's flash-attention kernel; SDPA cannot add it without leaving the flash path, so
  it is left out (a few FLOPs per attention score). MPT's fused Wqkv is three Linears here (same
  FLOPs). The loss is llm-foundry's default, flash-attn's fused cross-entropy (16-bit logits kept,
  no fp32 copy).
"""

from __future__ import annotations

from pathlib import Path

from .rows import Shape

ROOT = Path(__file__).resolve().parents[2]

_HEADER = """
import sys
sys.path.insert(0, {examples!r})
import torch
import torch.nn.functional as F
from torch import nn
"""

_GPT = """
import gpt
from gpt import GPTConfig, build_gpt, gpt_batch
{attention}
CFG = GPTConfig(vocab={vocab}, seq_len={seq}, n_layer={layers}, n_head={heads}, n_embd={hidden},
                dropout=0.1, attn={attn!r})
KV_HEADS, HEAD_DIM, FFN = {kv_heads}, {head_dim} or {hidden} // {heads}, {ffn}


def resize(block):
    # the row's widths where they are not GPT-2's: grouped-query or multi-query attention (fewer
    # key and value heads), heads of another width than hidden / heads, an MLP other than 4h
    h, attn, mlp = CFG.n_embd, block.attn, block.mlp
    if KV_HEADS != CFG.n_head or HEAD_DIM * CFG.n_head != h:
        attn.head_dim = HEAD_DIM
        attn.q, attn.proj = nn.Linear(h, CFG.n_head * HEAD_DIM), nn.Linear(CFG.n_head * HEAD_DIM, h)
        attn.k, attn.v = nn.Linear(h, KV_HEADS * HEAD_DIM), nn.Linear(h, KV_HEADS * HEAD_DIM)
    if FFN != 4 * h:
        mlp.up, mlp.down = nn.Linear(h, FFN), nn.Linear(FFN, h)


def qkv(attn, x):
    # (B, heads, T, head width) each; shared key and value heads repeated to the query heads
    B, T, _ = x.shape
    q, k, v = (m(x).view(B, T, -1, attn.head_dim).transpose(1, 2) for m in (attn.q, attn.k, attn.v))
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return q, k, v


def build_model():
    model = build_gpt(CFG)
    for block in model.blocks:  # this model's attention modules only (gpt.py stays as it is)
        block.attn.__class__ = Attention
        resize(block)
    return model
def sample_batch(b):
    return gpt_batch(CFG, b)
"""

MEGATRON_ATTENTION = """
class Attention(gpt.CausalSelfAttention):
    def forward(self, x):
        # Megatron-LM's attention (2021-22): q scaled, one bmm for the scores, ONE fused
        # scale-mask-softmax kernel (a single pass over the s x s scores; the causal mask is
        # applied inside it, so it costs what a plain softmax costs), dropout, bmm. No flash
        # attention.
        B, T, C = x.shape
        q, k, v = qkv(self, x)
        att = self.attn_dropout(F.softmax(q * self.head_dim ** -0.5 @ k.transpose(-2, -1), dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y))
"""

FLASH_ATTENTION = """
class Attention(gpt.CausalSelfAttention):
    def forward(self, x):
        # Fused flash attention (Megatron-Core with Transformer Engine): its dropout regenerates
        # the mask from the RNG state and saves nothing, so SDPA runs here without dropout (with
        # it, SDPA's CPU path would save an s x s mask).
        B, T, C = x.shape
        q, k, v = qkv(self, x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)))
"""

_MPT = """
from gpt import Block, GPTConfig, gpt_batch

CFG = GPTConfig(vocab={vocab}, seq_len={seq}, n_layer={layers}, n_head={heads}, n_embd={hidden},
                dropout=0.0, attn="sdpa", bias=False)


class MPT(nn.Module):
    # llm-foundry MPT: tied embedding and head, no position embedding (ALiBi, left out: fused in
    # its flash-attention kernel), bias-free pre-LayerNorm blocks, ffn 4h with GELU, no dropout.
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class FusedCrossEntropy(torch.autograd.Function):
    # llm-foundry's default loss (loss_fn: fused_crossentropy): flash-attn's cross-entropy kernel
    # on the 16-bit logits. It keeps the logits and one log-sum-exp per token for backward, and
    # backward writes the gradient in the logits' dtype (flash_attn.losses.cross_entropy), where
    # F.cross_entropy on logits.float() keeps fp32 log-probabilities. Its traffic here is near the
    # kernel's (which reads the logits in forward, reads them and writes the gradient in backward):
    # the log-sum-exp in fp32 a chunk of rows at a time (no whole fp32 copy), and backward one
    # softmax over the 16-bit logits and the scaling in place, not an fp32 pass per step.
    ROWS = 32

    @staticmethod
    def forward(ctx, logits, targets):
        lse = torch.cat([torch.logsumexp(c.float(), dim=-1) for c in logits.split(FusedCrossEntropy.ROWS)])
        ctx.save_for_backward(logits, targets)
        return (lse - logits.gather(1, targets[:, None]).squeeze(1).float()).mean()

    @staticmethod
    def backward(ctx, grad):
        logits, targets = ctx.saved_tensors
        probs = torch.softmax(logits, dim=-1)
        probs.scatter_add_(1, targets[:, None], -torch.ones_like(probs[:, :1]))
        return probs.mul_(grad / logits.shape[0]), None


def build_model():
    return MPT(CFG)


def loss_fn(logits, targets):
    return FusedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sample_batch(b):
    return gpt_batch(CFG, b)
"""

_LLAMA = """
from llama import LlamaConfig, build_llama, llama_batch

CFG = LlamaConfig(dim={hidden}, n_layers={layers}, n_heads={heads}, n_kv_heads={kv_heads},
                  ffn_dim={ffn}, vocab={vocab}, seq_len={seq}, rope_theta=500000.0, head_dim={head_dim})
def build_model():
    return build_llama(CFG)
def sample_batch(b):
    return llama_batch(CFG, b)
"""

_MOE = """
from dataclasses import replace
from llama import FeedForward, Llama, RMSNorm, llama_batch
from moe import MoEConfig

CFG = MoEConfig(dim={hidden}, n_layers={layers}, n_heads={heads}, n_kv_heads={kv_heads},
                ffn_dim={ffn}, vocab={vocab}, seq_len={seq}, rope_theta=500000.0, head_dim={head_dim},
                n_experts={experts}, top_k={top_k})


class GroupedExperts(nn.Module):
    # Stacked SwiGLU experts run as grouped GEMMs: one kernel per projection for every expert's
    # rows, the gate and up projections as one (Megatron-Core's GroupedMLP, --moe-grouped-gemm:
    # its fc1 is both)
    def __init__(self, cfg):
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.ffn_dim
        self.w_fc1 = nn.Parameter(torch.empty(e, d, 2 * f))
        self.w_fc2 = nn.Parameter(torch.empty(e, f, d))

    def forward(self, rows, offs):
        gate, up = torch._grouped_mm(rows, self.w_fc1, offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w_fc2, offs=offs)


class BalancedMoE(nn.Module):
    # The router's scores are computed; the tokens x top-k rows go to the experts in equal shares
    # (the published MoE benchmarks force-balance their routing), permuted into expert order,
    # through the grouped experts, weighted and added back to their tokens (unpermuted)
    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.n_experts = cfg.top_k, cfg.n_experts
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float32)
        total = h.shape[0] * self.top_k
        share = -(-total // self.n_experts)  # the last expert takes fewer when they do not divide
        slot = torch.arange(total, device=h.device)
        token, expert = slot % h.shape[0], slot // share
        offs = (torch.arange(1, self.n_experts + 1, device=h.device) * share).clamp(max=total).to(torch.int32)
        y = self.experts(h[token], offs) * probs[token, expert].to(h.dtype)[:, None]
        return torch.zeros_like(h).index_add(0, token, y).reshape(x.shape)


SHARED_FFN, DENSE_LAYERS, DENSE_FFN, MOE_EVERY, MLA_DIMS = {shared_ffn}, {dense_layers}, {dense_ffn}, {moe_every}, {mla}


class SharedAndRouted(BalancedMoE):
    # shared experts (DeepSeek, Qwen2-MoE): one SwiGLU of their whole width that every token runs,
    # beside the routed experts
    def __init__(self, cfg):
        super().__init__(cfg)
        self.shared = FeedForward(replace(cfg, ffn_dim=SHARED_FFN))

    def forward(self, x):
        return super().forward(x) + self.shared(x)


class LatentAttention(nn.Module):
    # multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank projection (q_lora),
    # keys and values from one shared latent (kv_lora) and a shared rotary key; the values are
    # padded to the query/key head width for one fused attention kernel (as FlashAttention needs
    # equal widths), and the output cut back. RoPE's rotation of its small part is left out.
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.n_heads
        self.q_lora, self.kv_lora, self.nope, self.rope, self.v = MLA_DIMS
        qk = self.nope + self.rope
        if self.q_lora:
            self.q_a_proj = nn.Linear(cfg.dim, self.q_lora, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora)
            self.q_b_proj = nn.Linear(self.q_lora, self.heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.dim, self.heads * qk, bias=False)
        self.kv_a_proj = nn.Linear(cfg.dim, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v, cfg.dim, bias=False)

    def reset_rope(self):
        pass

    def forward(self, x):
        B, T, _ = x.shape
        h, qk = self.heads, self.nope + self.rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(B, T, h, qk).transpose(1, 2)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, h, self.nope + self.v).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        k = torch.cat([k_nope, k_rope.view(B, 1, T, self.rope).expand(B, h, T, self.rope)], dim=-1)
        v = F.pad(v, (0, qk - self.v)) if qk > self.v else v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., : self.v]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, h * self.v))


def build_model():
    model = Llama(CFG, mlp=SharedAndRouted if SHARED_FFN else BalancedMoE)
    for i, layer in enumerate(model.layers):
        # dense layers before the first expert layer (DeepSeek-V3's first 3), and between expert
        # layers where they come every MOE_EVERY layers (Llama 4 Maverick's every 2nd: layers 1, 3, ...)
        if i < DENSE_LAYERS or (i - DENSE_LAYERS) % MOE_EVERY != MOE_EVERY - 1:
            layer.mlp = FeedForward(replace(CFG, ffn_dim=DENSE_FFN))
        if MLA_DIMS:
            layer.self_attn = LatentAttention(CFG)
    return model
def sample_batch(b):
    return llama_batch(CFG, b)
"""


def model_source(shape: Shape) -> str:
    """The model file (build_model, sample_batch) of a row's shape."""
    s = shape
    fields = dict(vocab=s.vocab, seq=s.seq_len, layers=s.layers, heads=s.heads, hidden=s.hidden, kv_heads=s.kv_heads, ffn=s.ffn,
                  head_dim=s.head_dim, experts=s.experts, top_k=s.top_k, shared_ffn=s.shared_ffn, dense_layers=s.dense_layers,
                  dense_ffn=s.dense_ffn, moe_every=s.moe_every, mla=s.mla)
    head = _HEADER.format(examples=str(ROOT / "examples"))
    if s.experts or s.mla:
        assert s.experts, f"{s}: latent attention is built in the mixture-of-experts model file only"
        return head + _MOE.format(**fields)
    if s.arch == "llama":
        return head + _LLAMA.format(**fields)
    if s.arch == "mpt":
        assert (s.head_dim, s.ffn, s.kv_heads) == (0, 4 * s.hidden, s.heads), f"{s}: MPT's blocks here are GPT-2's widths"
        return head + _MPT.format(**fields)
    if s.attention == "materialised":
        return head + _GPT.format(attention=MEGATRON_ATTENTION, attn="math", **fields)
    return head + _GPT.format(attention=FLASH_ATTENTION, attn="sdpa", **fields)
