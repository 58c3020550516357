"""Mixtral 8x7B (Hugging Face ``transformers``' ``MixtralForCausalLM``) built from its published
config: nothing is downloaded and, planned on fake tensors, nothing is allocated. Needs
``pip install transformers`` (5.x: experts stacked as 3-D weights, ``MixtralExperts``).

Shape (Jiang et al. 2024, "Mixtral of Experts", Table 1; the config of mistralai/Mixtral-8x7B-v0.1):
32 layers, width 4096, 32 query heads and 8 key/value heads, 8 SwiGLU experts of width 14336 per
layer with the top 2 chosen per token, vocabulary 32000: 46.7 B parameters, 45.1 B of them in the
experts (about 12.9 B active per token). Sequences of 4096 tokens.

    plan examples/mixtral_8x7b.py --gpus 64 --gpu h100-sxm-80gb --global-batch 256
"""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

SEQ = 4096
CONFIG = MixtralConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768, rope_theta=1e6, use_cache=False, router_jitter_noise=0.0,
)


def build_model():
    return MixtralForCausalLM(CONFIG)


def sample_batch(batch_size):
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def loss_fn(outputs, targets):
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
