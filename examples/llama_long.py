"""``llama.py``'s decoder with a context long for its size (2,048 tokens, width 128, 2 layers, 4
heads, 2 kv heads, vocab 2048): small enough to train on a CPU, long enough that a sequence is
worth splitting over processes with context parallelism (attention as a ring over the shards).
0.89 M parameters.

    plan examples/llama_long.py --gpu cpu --gpus 4 --global-batch 2 --cp 2 --run
"""

from llama import LlamaConfig, build_llama, llama_batch

CONFIG = LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=344, vocab=2048, seq_len=2048)


def build_model():
    return build_llama(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
