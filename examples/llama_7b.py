"""Llama-2-7B shape: dim 4096, 32 layers, 32 heads, 32 kv heads (no GQA), ffn 11008, vocab 32000,
seq 4096; 6.74 B parameters (``llama.py``'s model, imported from the file next to this one).

At fp32 the parameters alone take 27 GB (13.5 GB at bf16), more than this machine's memory: profile
it on the meta device only (``plan profile examples/llama_7b.py --meta``), which needs no memory and
gives FLOPs, parameter and activation bytes but no timings.
"""

from llama import LlamaConfig, build_llama, llama_batch

CONFIG = LlamaConfig(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab=32000, seq_len=4096
)


def build_model():
    return build_llama(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
