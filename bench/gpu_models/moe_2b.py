"""examples/moe.py's mixture-of-experts decoder at a size one GPU trains: dim 2048, 8 layers, 16
heads (8 kv heads), 32 SwiGLU experts of ffn 1024 each, top-4, vocab 50304, seq 4096 (about 2.0 B
parameters, 1.6 B of them in the experts; OLMoE's widths with half its experts). Each expert runs
as its own small GEMMs in a Python loop, as hand-written training codes do: bench/gpu_check.sh
plans and runs it on one GPU to measure the host time and small-GEMM efficiency the plan prices
for such a layer.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from llama import llama_batch  # noqa: E402
from moe import MoEConfig, build_moe  # noqa: E402

CONFIG = MoEConfig(
    dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=1024, vocab=50304, seq_len=4096,
    n_experts=32, top_k=4,
)


def build_model():
    return build_moe(CONFIG)


def sample_batch(batch_size: int):
    return llama_batch(CONFIG, batch_size)
