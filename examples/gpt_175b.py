"""GPT-3 175B shape (Brown et al. 2020, Table 2.1: 96 layers, width 12288, 96 heads of 128,
context 2048), with GPT-2's vocabulary padded to 51200 as in the Megatron-LM runs of
bench/reference/published_runs.yaml (Narayanan et al. 2021; Korthikanti et al. 2022):
175.24 B parameters (``gpt.py``'s GPT, imported from the file next to this one; untied embedding
and head, learned position embedding, biases, dropout 0.0).

At bf16 the parameters alone take 350 GB: the profiler works on fake tensors (``--meta``, and
``plan`` on a GPU catalogue entry), which need no memory and give FLOPs, parameter and activation
bytes but no timings. The 96 blocks are identical, so the profiler traces 4 of them and copies
their figures to the others (planner/profile/repeats.py).

    plan profile examples/gpt_175b.py --meta
    plan examples/gpt_175b.py --gpus 1024 --gpu a100-80gb
"""

from gpt import GPTConfig, build_gpt, gpt_batch

CONFIG = GPTConfig(vocab=51200, seq_len=2048, n_layer=96, n_head=96, n_embd=12288, dropout=0.0)


def build_model():
    return build_gpt(CONFIG)


def sample_batch(batch_size: int):
    return gpt_batch(CONFIG, batch_size)
