"""Four decoder layers of Llama 3.1 8B (dim 4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256,
RoPE base 500,000) at an 8,192-token sequence: the widths of torchtitan's Llama 3 8B benchmark rows,
cut to a depth that one GPU trains with AdamW (1.56 B parameters, a third of them the embedding and
the head). bench/gpu_check.sh plans and runs it in bf16 and in FP8 (torchao's Float8 Linears) on
one GPU, so that FP8's speed-up at these widths, casts included, is measured against the plan's.
"""

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from llama import build_llama, llama_batch  # noqa: E402
from llama3_8b_128k import CONFIG as LLAMA3_8B  # noqa: E402

CONFIG = replace(LLAMA3_8B, n_layers=4, seq_len=8192)


def build_model():
    return build_llama(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
