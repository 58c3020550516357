"""GPT-2-small shape: vocab 50257, seq 1024, 12 layers, 12 heads, width 768 (dropout 0.0).

The model is ``gpt.py``'s GPT (imported from the file next to this one). Embeddings and lm_head are
NOT tied here, so it has about 163.0 M parameters (the original GPT-2 ties them: 124.4 M).
Training it on a CPU is slow; profiling a few samples takes seconds, and ``--meta`` needs no memory.

    plan profile examples/gpt2_small.py --batch-size 2
"""

from gpt import GPTConfig, build_gpt, gpt_batch

CONFIG = GPTConfig(vocab=50257, seq_len=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0)


def build_model():
    return build_gpt(CONFIG)


def sample_batch(batch_size: int):
    return gpt_batch(CONFIG, batch_size)
