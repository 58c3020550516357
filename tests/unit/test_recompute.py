"""runtime/recompute.py in one process: selective recompute (save-matmuls SAC) of an examples/gpt.py
block keeps fewer bytes than no recompute, the alternate policy (every other Linear matmul saved)
fewer still, full recompute the fewest; the gradients equal the plain block's bit for bit, dropout
included (the checkpoint restores the RNG state); and what each keeps is what the profile says."""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from runtime.recompute import apply_recompute_layers, is_matmul_like
from tests.conftest import EXAMPLES


class _LiveStorages(TorchDispatchMode):
    """Every storage an op creates during the forward (weakly): what is still alive afterwards is
    what the autograd graph (and the checkpoint's cache) keeps for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        gc.collect()
        return sum(n for ptr, (ref, n) in self.refs.items() if not ref.expired() and ptr not in exclude)


@pytest.mark.parametrize("attn", ["sdpa", "math"])
def test_selective_between_none_and_full_with_equal_gradients(attn):
    sys.path.insert(0, str(EXAMPLES))
    from gpt import Block, GPTConfig

    cfg = GPTConfig(vocab=64, seq_len=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1, attn=attn)
    torch.manual_seed(0)
    plain = torch.nn.ModuleDict({"block": Block(cfg)})
    results = {}
    for kind in ("none", "selective", "alternate", "full"):
        model = copy.deepcopy(plain)
        apply_recompute_layers(model, {} if kind == "none" else {"block": kind})
        torch.manual_seed(1)
        x = torch.randn(4, cfg.seq_len, cfg.n_embd, requires_grad=True)
        torch.manual_seed(2)  # the dropout masks
        with _LiveStorages() as mode:
            y = model["block"](x)
        exclude = {y.untyped_storage().data_ptr(), *(p.untyped_storage().data_ptr() for p in model.parameters())}
        kept = mode.live_bytes(exclude)
        y.pow(2).sum().backward()
        results[kind] = (kept, x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters()})
    kept = {k: v[0] for k, v in results.items()}
    assert kept["full"] < kept["alternate"] < kept["selective"] < kept["none"], kept
    _, x_grad, grads = results["none"]
    for kind in ("selective", "alternate", "full"):
        assert torch.equal(results[kind][1], x_grad), kind
        for name, g in grads.items():
            assert torch.equal(results[kind][2][name], g), f"{kind}: {name}"


def test_matmul_like_is_the_profilers_set():
    from planner.profile.flops import formula_for

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default):
        assert is_matmul_like(op) and formula_for(op) is not None
    for op in (aten.bmm.default, aten.baddbmm.default):  # an unfused attention's core: recomputed
        assert formula_for(op) is not None and not is_matmul_like(op)
    cpu_flash = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_flash is not None:
        assert is_matmul_like(cpu_flash.default)
    for op in (aten.native_layer_norm.default, aten.gelu.default, aten._softmax.default,
               aten.native_dropout.default, aten.add.Tensor):
        assert not is_matmul_like(op)


@pytest.mark.parametrize("kind", ["selective", "alternate"])
@pytest.mark.parametrize("attn", ["sdpa", "math"])
def test_selective_keeps_what_the_profile_says(attn, kind, tmp_path):
    """The plan's selective figure for a layer (activation_matmul_bytes: every matmul-like output)
    is what the runtime's save-matmuls checkpoint keeps, and its alternate figure
    (activation_alternate_bytes) what the every-other-matmul one keeps, so the predicted memory holds."""
    sys.path.insert(0, str(EXAMPLES))
    from gpt import Block, GPTConfig

    from planner.model_file import load_model_file
    from planner.profile import profile_model

    sizes = dict(vocab=64, seq_len=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1, attn=attn)
    path = tmp_path / "tiny_gpt.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom gpt import GPT, GPTConfig, gpt_batch\n"
        f"CFG = GPTConfig(**{sizes!r})\ndef build_model():\n    return GPT(CFG)\n"
        f"def sample_batch(n):\n    return gpt_batch(CFG, n)\n"
    )
    profile = profile_model(load_model_file(path), batch_size=4, dtype="fp32", force_meta=True, measure=False)
    layer = next(l for l in profile.layers if l.name == "blocks.0")
    predicted = layer.activation_matmul_bytes if kind == "selective" else layer.activation_alternate_bytes
    assert layer.activation_alternate_bytes < layer.activation_matmul_bytes and layer.fwd_alternate_flops > 0

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"block": Block(GPTConfig(**sizes))})
    apply_recompute_layers(model, {"block": kind})
    x = torch.randn(4, 16, 32, requires_grad=True)
    with _LiveStorages() as mode:
        y = model["block"](x)
    kept = mode.live_bytes({y.untyped_storage().data_ptr(), *(p.untyped_storage().data_ptr() for p in model.parameters())})
    assert kept == pytest.approx(predicted, rel=0.05), (kept, predicted)


class _CountFlops(TorchDispatchMode):
    """FLOPs of the ops dispatched while `on` (torch's formula registry, as the profile counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops, self.on = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from planner.profile.flops import formula_for

        out = func(*args, **(kwargs or {}))
        formula = formula_for(func)
        if self.on and formula is not None:
            self.flops += int(formula(*args, **(kwargs or {}), out_val=out))
        return out


@pytest.mark.parametrize("attn, dropout", [("sdpa", 0.0), ("math", 0.1)])
def test_full_recompute_reruns_what_the_profile_says(attn, dropout, tmp_path):
    """torch's non-reentrant checkpoint (the runtime's full recompute) stops once backward has every
    tensor it saved: a block's last matmul (unless a dropout after it saves its mask) and a
    checkpointed head's matmul are not rerun. The profile's forward less its tail
    (fwd_tail_flops) is what backward reruns, FLOP for FLOP; so for the selective and alternate
    policies (fwd_selective_flops, fwd_alternate_flops less their tail)."""
    from planner.model_file import load_model_file
    from planner.profile import profile_model

    sizes = dict(vocab=64, seq_len=16, n_layer=2, n_head=2, n_embd=32, dropout=dropout, attn=attn)
    path = tmp_path / "tiny_gpt.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom gpt import GPT, GPTConfig, gpt_batch\n"
        f"CFG = GPTConfig(**{sizes!r})\ndef build_model():\n    return GPT(CFG)\n"
        f"def sample_batch(n):\n    return gpt_batch(CFG, n)\n"
    )
    handle = load_model_file(path)
    profile = profile_model(handle, batch_size=4, dtype="fp32", force_meta=True, measure=False)
    block = next(l for l in profile.layers if l.name == "blocks.0")
    # gpt.py's block ends with the MLP's down projection (4h -> h), dropout and the residual add
    down = 2 * 4 * 16 * 4 * 32 * 32
    assert (block.fwd_tail_flops, block.fwd_tail_rowwise_linears) == ((down, 1) if dropout == 0 else (0, 0))
    head = next(l for l in profile.layers if l.name == "lm_head")
    assert head.fwd_tail_flops == head.fwd_flops  # its matmul saves its inputs before it runs

    def backward_flops(kind: str | None) -> int:
        torch.manual_seed(0)
        model = handle.build_model()
        if kind is not None:
            apply_recompute_layers(model, {l.name: kind for l in profile.layers})
        inputs, targets = handle.sample_batch(4)
        with _CountFlops() as mode:
            loss = handle.loss(handle.forward(model, inputs), targets)
            mode.on = True
            loss.backward()
        return mode.flops

    plain = backward_flops(None)
    rerun = backward_flops("full") - plain
    assert rerun == sum(l.fwd_flops - l.fwd_tail_flops for l in profile.layers) > 0
    # selective reruns an unfused attention's batched matmuls (none with SDPA); alternate also every
    # second Linear matmul, but those in the tail: gpt.py's sixth and last, the down projection,
    # without dropout after it
    selective = backward_flops("selective") - plain
    assert selective == sum(l.fwd_selective_flops for l in profile.layers) and (selective > 0) == (attn == "math")
    alternate = backward_flops("alternate") - plain
    assert alternate == selective + sum(l.fwd_alternate_flops - l.fwd_tail_alternate_flops for l in profile.layers) > selective
    assert (block.fwd_tail_alternate_flops == down) == (dropout == 0)
