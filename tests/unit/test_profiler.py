"""The profiler's figures against exact counts, published formulas and independent counters."""

import json
import time

import pytest

from planner.model_file import load_model_file
from planner.profile import ModelProfile, profile_model
from tests.conftest import EXAMPLES


def _profile(path, **kw):
    kw.setdefault("measure", False)
    return profile_model(load_model_file(path), **kw)


def _num_params(path) -> int:
    handle = load_model_file(path)
    return sum(p.numel() for p in handle.build_model("meta").parameters())


@pytest.mark.parametrize("example", ["mlp.py", "gpt.py", "resnet.py", "llama.py", "hf_gpt2.py"])
def test_parameter_counts_equal_the_models(example):
    path = EXAMPLES / example
    profile = _profile(path)
    assert profile.totals.num_params == _num_params(path)
    assert sum(layer.num_params for layer in profile.layers) == profile.totals.num_params
    # and the modules that hold them and their tensors (what a ZeRO-3 trainer may gather one by
    # one; GPT-2's tied embedding in both modules that hold it)
    model = load_model_file(path).build_model("meta")
    holders = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    assert sum(layer.param_modules for layer in profile.layers) == len(holders)
    assert sum(layer.param_tensors for layer in profile.layers) == sum(len(list(m.parameters(recurse=False))) for m in holders)


def test_linear_stack_flops_are_exact(model_file):
    dims = [64, 128, 32, 16]
    path = model_file(
        f"""
        import torch, torch.nn as nn
        DIMS = {dims}
        def build_model():
            return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:])])
        def sample_batch(b):
            return torch.randn(b, DIMS[0]), torch.randn(b, DIMS[-1])
        """
    )
    b = 8
    profile = _profile(path, batch_size=b, dtype="fp32")
    assert [layer.name for layer in profile.layers] == ["0", "1", "2"]
    for i, (layer, (din, dout)) in enumerate(zip(profile.layers, zip(dims, dims[1:]))):
        assert layer.fwd_flops == 2 * b * din * dout
        # Backward: weight gradient + input gradient (2 matmuls); the first layer's input is data,
        # which needs no gradient, so it only computes the weight gradient.
        assert layer.bwd_flops == (1 if i == 0 else 2) * layer.fwd_flops
        assert layer.num_params == din * dout + dout
        assert layer.param_bytes == 4 * layer.num_params


def _gpt_file(model_file, attn: str, dropout: float, b: int, s: int, h: int, a: int, layers: int = 3):
    return model_file(
        f"""
        from gpt import GPTConfig, build_gpt, gpt_batch
        CFG = GPTConfig(vocab=512, seq_len={s}, n_layer={layers}, n_head={a}, n_embd={h},
                        dropout={dropout}, attn={attn!r})
        def build_model():
            return build_gpt(CFG)
        def sample_batch(b):
            return gpt_batch(CFG, b)
        """
    )


def test_block_activations_match_korthikanti(model_file):
    """Unfused attention with dropout, 16-bit: sbh(34 + 5as/h) (Korthikanti et al. 2022, Table 2).

    On the CPU, dropout saves its mask in the input's dtype (2 bytes at bf16), not as CUDA's 1-byte
    mask: the two masks per block (sbh and as^2b elements) then count twice, which gives exactly
    sbh(36 + 6as/h). Within 15% of the paper at this shape (as/h = 4), exact against the CPU form.
    """
    b, s, h, a = 2, 128, 256, 8
    profile = _profile(_gpt_file(model_file, "math", 0.1, b, s, h, a), batch_size=b)
    blocks = [layer for layer in profile.layers if layer.kind == "Block"]
    assert len(blocks) == 3
    paper = s * b * h * (34 + 5 * a * s / h)
    cpu_masks = s * b * h * (36 + 6 * a * s / h)
    for block in blocks:
        assert abs(block.activation_bytes - paper) / paper < 0.15, (block.activation_bytes, paper)
        # + LayerNorm statistics (2 x fp32 per row, 2 norms): 16 bytes per position
        assert abs(block.activation_bytes - cpu_masks) <= 16 * s * b, (block.activation_bytes, cpu_masks)


def test_flash_attention_block_drops_the_quadratic_term(model_file):
    """SDPA saves no s x s tensors: 34sbh less the two dropout masks (no dropout here) plus
    the fp32 logsumexp (a*s*b*4 bytes)."""
    b, s, h, a = 2, 128, 256, 8
    profile = _profile(_gpt_file(model_file, "sdpa", 0.0, b, s, h, a), batch_size=b)
    block = next(layer for layer in profile.layers if layer.kind == "Block")
    expected = 32 * s * b * h + 4 * a * s * b
    assert abs(block.activation_bytes - expected) / expected < 0.05, (block.activation_bytes, expected)


@pytest.mark.parametrize("example", ["gpt.py", "resnet.py", "hf_gpt2.py"])
def test_fake_and_materialised_profiles_agree(example):
    path = EXAMPLES / example
    fake = _profile(path, batch_size=2, force_meta=True)
    real = _profile(path, batch_size=2, measure=True, repeats=1)
    assert (fake.mode, real.mode) == ("meta", "materialized")
    exact = lambda p: [(l.name, l.num_params, l.fwd_flops, l.bwd_flops) for l in p.layers]  # noqa: E731
    nbytes = lambda p: [  # noqa: E731
        (l.activation_bytes, l.output_bytes, l.fwd_ops, l.bwd_ops, l.fwd_matmul_io_bytes, l.fwd_other_io_bytes)
        for l in p.layers
    ]
    assert exact(fake) == exact(real)
    if example != "hf_gpt2.py":
        assert nbytes(fake) == nbytes(real)
    else:
        # Hugging Face takes another path when it sees fake tensors (its `is_tracing` check):
        # it builds an explicit b x 1 x s x s causal mask instead of using SDPA's is_causal, and
        # each block saves its copy for backward (and the mask's ops add to op counts and
        # traffic). Bytes agree up to one mask per block.
        mask = 2 * 256 * 256 * 2
        assert 0 <= fake.totals.activation_bytes - real.totals.activation_bytes <= 4 * mask
    assert all(layer.fwd_s is not None and layer.fwd_s >= 0 for layer in real.layers)
    assert real.totals.fwd_s > 0 and real.totals.bwd_s > 0
    assert fake.totals.fwd_s is None


def test_forward_flops_cross_checked_with_fvcore():
    """fvcore counts one multiply-add as one flop and only forward: ours = 2 x fvcore."""
    from fvcore.nn import FlopCountAnalysis

    handle = load_model_file(EXAMPLES / "resnet.py")
    profile = profile_model(handle, batch_size=2, dtype="fp32", measure=False)
    model = handle.build_model().eval()
    inputs, _ = handle.sample_batch(2)
    analysis = FlopCountAnalysis(model, inputs).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    by_op = analysis.by_operator()
    macs = by_op.get("conv", 0) + by_op.get("linear", 0) + by_op.get("addmm", 0)
    assert profile.totals.fwd_flops == 2 * macs


def test_identical_layers_share_a_kind_and_cuts_are_known():
    profile = _profile(EXAMPLES / "gpt.py")
    kinds = profile.kinds()
    blocks = [layer for layer in profile.layers if layer.name.startswith("blocks.")]
    assert len({b.kind for b in blocks}) == 1 and len(kinds[blocks[0].kind]) == len(blocks)
    # A cut is valid where the next layer starts from what this one returned: not between wte and
    # wpe (wpe takes the positions, and their sum is formed after both), everywhere after that.
    assert profile.cut_points() == list(range(1, len(profile.layers) - 1))
    hidden = profile.seq_len * 384 * 2  # batch 1, n_embd 384, bf16
    assert all(b.output_bytes == hidden for b in blocks)
    g = profile.graph()
    assert g.number_of_nodes() == len(profile.layers)
    assert all(g.has_edge(b.index, b.index + 1) for b in blocks)


def test_hugging_face_blocks_split_by_the_tracer():
    """HF GPT-2's blocks take the hidden state alone (no mask: SDPA's is_causal, as in a real run,
    also on fake tensors: materialize.one_sequence_per_row), so a cut after the position embedding
    or any block hands over one tensor; none comes after ln_f, so the stages after the first cannot
    run as a plain sequence of layers up to the head. The pipelining tracer splits it at every
    boundary."""
    plain = _profile(EXAMPLES / "hf_gpt2.py", check_split=False)
    blocks = [l.index for l in plain.layers if l.name.startswith("transformer.h.")]
    assert plain.cut_points() == [blocks[0] - 1, *blocks] and plain.pipeline_split == "sequential"
    profile = _profile(EXAMPLES / "hf_gpt2.py")
    assert profile.pipeline_split == "traced"
    assert profile.cut_points() == list(range(len(profile.layers) - 1))


def test_resnet_blocks_are_layers():
    profile = _profile(EXAMPLES / "resnet.py")
    names = [layer.name for layer in profile.layers]
    assert sum(n.startswith("layer") for n in names) == 8  # 4 stages x 2 BasicBlocks
    assert names[-1] == "fc" and "avgpool" in profile.layers[-1].modules


def test_llama_70b_profiles_on_meta():
    start = time.perf_counter()
    profile = _profile(EXAMPLES / "llama_70b.py", measure=True)
    assert 0 < profile.profile_s <= time.perf_counter() - start  # the time it took (the summary prints it)
    assert profile.mode == "meta" and not profile.timed
    assert abs(profile.totals.num_params - 68.98e9) / 68.98e9 < 0.01
    decoder = profile.kinds()[profile.layers[1].kind]
    assert len(decoder) == 80
    # 6ND rule of thumb (Kaplan et al.): forward + backward FLOPs ~ 6 x params x tokens (+ attention)
    tokens = profile.seq_len * profile.batch_size
    ratio = (profile.totals.fwd_flops + profile.totals.bwd_flops) / (6 * profile.totals.num_params * tokens)
    assert 1.0 < ratio < 1.3


def test_profile_json_round_trip():
    profile = _profile(EXAMPLES / "gpt.py")
    data = json.loads(profile.to_json())
    assert data["schema"] == "planner.ModelProfile" and data["version"] == 1
    for key in ("name", "kind", "num_params", "param_bytes", "fwd_flops", "bwd_flops", "activation_bytes", "output_bytes", "fwd_s", "bwd_s"):
        assert key in data["layers"][0]
    assert data["batch_size"] == 1 and "totals" in data
    assert ModelProfile.from_dict(data) == profile


def test_fused_traffic_reads_a_chain_once_and_writes_what_leaves_it(model_file):
    """A chain of memory-bound ops between two Linears (relu, x 2, + 1 on the first one's output)
    is one kernel when fused: it reads the Linear's output once and writes the tensor the next
    Linear reads (2 tensors' bytes), where op by op each of the three reads and writes one (6)."""
    path = model_file(
        """
        import torch, torch.nn as nn
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
            def forward(self, x):
                return self.b(torch.relu(self.a(x)) * 2 + 1)
        def build_model():
            return nn.Sequential(Block(), Block())
        def sample_batch(b):
            return torch.randn(b, 64), torch.randn(b, 64)
        """
    )
    b = 8
    first = _profile(path, batch_size=b, dtype="fp32").layers[0]
    tensor = b * 64 * 4
    assert first.fwd_fused_io_bytes == 2 * tensor
    assert 6 * tensor <= first.fwd_other_io_bytes <= 6 * tensor + 64  # + the scalars
    assert 0 < first.bwd_fused_io_bytes < first.bwd_other_io_bytes


def test_fused_traffic_of_a_llama_block(model_file):
    """examples/llama.py's block (s = 256, h = 256, ffn 688 = 2.6875 h, 2 of 8 heads for keys and
    values), bf16, in s x h tensors: the norm reads the input and writes its output (2); RoPE
    reads q and k and writes them (2.5); the keys and values repeated for the query heads written
    (2, v read: 0.25); the attention output made contiguous (2); the residual add and second norm
    read the input and the projection and write the sum and the norm (4); SwiGLU reads its two
    inputs and writes their product (3 x 2.6875); the last residual add (3). 23.8 in all, against
    about 73 op by op (the norms' fp32 copies and RoPE's halves each read and written)."""
    block = next(l for l in _profile(EXAMPLES / "llama.py", dtype="bf16").layers if l.name == "layers.1")
    sh = 256 * 256 * 2
    expected = 2 + 2.5 + 2.25 + 2 + 4 + 3 * 2.6875 + 3
    assert block.fwd_fused_io_bytes / sh == pytest.approx(expected, abs=0.5)  # + RoPE's tables
    assert block.fwd_other_io_bytes / sh == pytest.approx(73, abs=3)


@pytest.mark.parametrize("example", ["mlp.py", "resnet.py", "moe.py", "hf_gpt2.py"])
def test_fused_traffic_never_exceeds_op_by_op(example):
    """Fused, a kernel reads what its ops read from outside it at most once and writes a subset of
    what they wrote: no layer's fused traffic exceeds its op-by-op traffic, in either phase, and a
    layer with memory-bound work moves something fused."""
    for layer in _profile(EXAMPLES / example).layers:
        assert layer.fwd_fused_io_bytes <= layer.fwd_other_io_bytes, layer.name
        assert layer.bwd_fused_io_bytes <= layer.bwd_other_io_bytes, layer.name
        assert bool(layer.fwd_fused_io_bytes) == bool(layer.fwd_other_io_bytes), layer.name
