"""Llama 3.1 8B at a 131,072-token context (the long-context stage of Llama 3's training): dim
4096, 32 layers, 32 heads, 8 kv heads, ffn 14336, vocab 128256, RoPE base 500,000 (Llama 3
paper, Table 3; ``llama.py``'s model, imported from the file next to this one). 8.03 B parameters.

One sequence's activations (hundreds of GB at bf16, 67 GB for its fp32 logits alone) fit no single
GPU: the plan splits each sequence, with context parallelism (attention as a ring over the
sequence shards), tensor parallelism or both. With 4 sequences on 64 GPUs each sequence spans 16
GPUs, more than a node's tensor parallelism: the plan adds context parallelism across nodes (as
Llama 3's long-context stage did, tp 8 x cp 16 at 405B). The model is profiled on fake tensors:

    plan examples/llama3_8b_128k.py --gpus 64 --gpu h100-sxm-80gb --global-batch 4
"""

from llama import LlamaConfig, build_llama, llama_batch

CONFIG = LlamaConfig(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab=128256, seq_len=131072,
    rope_theta=500000.0,
)


def build_model():
    return build_llama(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
