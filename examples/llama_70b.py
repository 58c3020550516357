"""Llama-2-70B shape: dim 8192, 80 layers, 64 heads, 8 kv heads (grouped-query attention),
ffn 28672, vocab 32000, seq 4096; 68.98 B parameters (``llama.py``'s model, imported from the file
next to this one).

At bf16 the parameters alone take 138 GB: profile it on the meta device only
(``plan profile examples/llama_70b.py --meta``), which needs no memory and gives FLOPs, parameter
and activation bytes but no timings.
"""

from llama import LlamaConfig, build_llama, llama_batch

CONFIG = LlamaConfig(
    dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab=32000, seq_len=4096
)


def build_model():
    return build_llama(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
