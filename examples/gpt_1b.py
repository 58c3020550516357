"""A GPT of about 1.02 B parameters (16 layers, 16 heads, width 2048, seq 2048, vocab 50304,
untied embedding and head, dropout 0.0): the size of the issue's GPU check.

The model is ``gpt.py``'s GPT (imported from the file next to this one). On one H200 in bf16 with
AdamW it needs about 16 GB of parameter state plus activations, so a single GPU trains it without
any parallelism, with or without recompute depending on the micro-batch. On a CPU, ``plan`` works
(fake tensors: no memory), but ``--run`` would take minutes per step.

    plan examples/gpt_1b.py --gpu h200 --gpus 1
    bash bench/gpu_check.sh            # on a machine with an H200: plan, run, predicted vs measured
"""

from gpt import GPTConfig, build_gpt, gpt_batch

CONFIG = GPTConfig(vocab=50304, seq_len=2048, n_layer=16, n_head=16, n_embd=2048, dropout=0.0)


def build_model():
    return build_gpt(CONFIG)


def sample_batch(batch_size: int):
    return gpt_batch(CONFIG, batch_size)
