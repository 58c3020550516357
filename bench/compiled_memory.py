"""What torch.compile keeps for backward, on this machine's device: the default loss (eager and
compiled) and a Llama block under save-matmuls recompute (compiled), as tests/unit/
test_compiled_memory.py checks them on the CPU's inductor and bench/gpu_check.sh on CUDA.

    python bench/compiled_memory.py            # prints the ratios the profile's counts predict
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def saved_bytes(fn, x: torch.Tensor, fixed: set[int] = frozenset()) -> int:
    """Bytes of the storages `fn(x)` saves for backward (not those in `fixed`: parameters), seen by
    a saved-tensors hook (which sees a compiled graph's saves too); then runs the backward."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in fixed:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    (y.sum() if y.dim() else y).backward()
    return sum(saved.values())


def loss_saved(device: str = "cpu", B: int = 2, T: int = 256, V: int = 4096) -> dict[str, float]:
    """The default loss's saves, eager and compiled, in 16-bit logits."""
    from planner.model_file import default_loss

    logits = torch.randn(B, T, V, dtype=torch.bfloat16, device=device, requires_grad=True)
    targets = torch.randint(0, V, (B, T), device=device)
    out = {}
    for kind, fn in (("eager", default_loss), ("compiled", torch.compile(default_loss))):
        saved_bytes(lambda l: fn(l, targets), logits)  # warm-up (compiles)
        out[kind] = saved_bytes(lambda l: fn(l, targets), logits) / logits.nbytes
    return out


def block_saved(device: str = "cpu", D: int = 256, S: int = 512, heads: int = 8, kv_heads: int = 2, ffn: int = 896,
                recompute: bool = True) -> tuple[int, int]:
    """(bytes a compiled Llama block keeps, under save-matmuls recompute or without any, one
    hidden-size tensor's)."""
    from llama import LlamaConfig, build_llama
    from planner.profile.flops import kept_by_selective

    cfg = LlamaConfig(dim=D, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn, vocab=256, seq_len=S)
    layer = build_llama(cfg).layers[0].to(device, torch.bfloat16)
    fixed = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if kept_by_selective(op) else CheckpointPolicy.PREFER_RECOMPUTE

    def context():
        return create_selective_checkpoint_contexts(policy)

    def run(x):
        return checkpoint(layer, x, use_reentrant=False, context_fn=context)

    compiled = torch.compile(run if recompute else layer)
    x = torch.randn(1, S, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    saved_bytes(compiled, x, fixed)  # warm-up (compiles)
    return saved_bytes(compiled, x, fixed), x.nbytes


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for kind, ratio in loss_saved(device, T=1024, V=32768).items():
        print(f"loss {kind:9s} saves {ratio:.2f} x the bf16 logits (the profile's counts: eager 2.00, compiled 1.00)")
    D, heads, kv_heads, ffn = 2048, 16, 4, 5632
    saved, hidden = block_saved(device, D=D, S=4096, heads=heads, kv_heads=kv_heads, ffn=ffn)
    # its input, q, k, v, the attention's output, o, gate and up: every matmul output but the down projection's
    expected = 1 + 1 + 2 * kv_heads / heads + 1 + 1 + 2 * ffn / D
    print(f"compiled block, save-matmuls recompute: {saved / hidden:.2f} hidden-size tensors "
          f"(the profile's count: {expected:.2f}, and a log-sum-exp per head and token) on {device}")
    saved, hidden = block_saved(device, D=D, S=4096, heads=heads, kv_heads=kv_heads, ffn=ffn, recompute=False)
    print(f"compiled block, no recompute: {saved / hidden:.2f} hidden-size tensors (the profile's "
          "activation_fused_bytes, printed by tests/unit/test_compiled_memory.py for a smaller block)")


if __name__ == "__main__":
    main()
