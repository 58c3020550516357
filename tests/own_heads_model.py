"""A GPT written the way some Hugging Face models are (OPT, Falcon): its attention sizes its views
with its own head count (``view(B, -1, self.n_head, self.head_dim)``, which on a TP rank's shard
would silently take half the sequence for the ``-1``), and each block adds its residual into the MLP's
output in place (``out += x``, on what DTensor hands on as a view). Tensor parallelism must divide
the head count and copy that output (planner.profile.tp_roles.split_check, TPRole.cloned)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import GPT, Block, CausalSelfAttention, GPTConfig, gpt_batch  # noqa: E402

CFG = GPTConfig(vocab=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)


class OwnHeadsAttention(CausalSelfAttention):
    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (lin(x).view(B, -1, self.n_head, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class InPlaceBlock(Block):
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        out = self.mlp.down(self.mlp.act(self.mlp.up(self.ln_2(x))))
        out += x
        return out


def build_model():
    model = GPT(CFG)
    for block in model.blocks:
        block.__class__ = InPlaceBlock
        block.attn.__class__ = OwnHeadsAttention
    return model


def sample_batch(batch_size):
    return gpt_batch(CFG, batch_size, seed=int(torch.randint(0, 2**31 - 1, ())))
