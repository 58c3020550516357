"""What tensor parallelism runs, decided before launch (the profiler's planner.profile.tp_roles, which
the plan carries, and runtime.layout): the
GPT gets vocabulary-parallel embeddings and head, sequence parallelism and a loss on sharded logits
(no run warning); models that cannot get one of them get it replaced, with a warning saying why.
The distributed parity tests (tests/distributed/test_parity.py: tp, dp_tp, fsdp_tp, pp_dp_tp) check
that this trains exactly as one process does."""

from __future__ import annotations

import pytest

from planner.model_file import load_model_file
from planner.plan import plan_layers
from planner.profile import profile_model
from planner.search.explain import _tp_split
from runtime.layout import SP_GATHER_WARNING, shard_lines, tp_layout
from tests.conftest import EXAMPLES

OWN_HEADS = EXAMPLES.parent / "tests" / "own_heads_model.py"

GPT = """
import torch
from gpt import GPT, GPTConfig, gpt_batch

CFG = GPTConfig(vocab=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)


def build_model():
    return GPT(CFG)


def sample_batch(batch_size):
    return gpt_batch(CFG, batch_size)
"""


def _layers(model_file, source: str):
    return plan_layers(profile_model(load_model_file(model_file(source)), dtype="fp32", measure=False))


def test_gpt_runs_as_planned(model_file):
    layers = _layers(model_file, GPT)
    roles = {l.name: l.role for l in layers}
    assert roles["wte"].kind == "embedding" and roles["wte"].seq_dim == 1
    assert roles["wpe"].seq_dim == 0  # position embeddings [seq, hidden]: sharded on dim 0
    assert roles["blocks.0"].norms == ("ln_1", "ln_2") and roles["blocks.0"].gathers == ("attn", "mlp")
    assert roles["ln_f"].kind == "norm" and roles["lm_head"].kind == "head"
    layout = tp_layout(layers, 2)
    assert layout.sequence_parallel and layout.loss_parallel
    assert [l.name for l in layout.vocab] == ["wte", "wpe", "lm_head"]
    assert [l.name for l in layout.blocks] == ["blocks.0", "blocks.1"]
    assert layout.warnings == (SP_GATHER_WARNING,)  # the one known departure
    assert not tp_layout(layers, 2, sequence_parallel=False).sequence_parallel


def test_dry_run_shard_lines(model_file):
    layers = _layers(model_file, GPT)
    lines = shard_lines(layers, 2, 1)
    assert lines[0] == (
        "tp shard 1/2 of blocks.*.attn.q, blocks.*.attn.k, blocks.*.attn.v, blocks.*.mlp.up (colwise); "
        "blocks.*.attn.proj, blocks.*.mlp.down (rowwise)"
    )
    assert lines[1] == (
        "tp shard 1/2 of the vocabulary: wte rows 32-63 of 64, wpe rows 8-15 of 16, "
        "lm_head rows 32-63 of 64 (logits stay vocabulary-sharded into the loss)"
    )
    assert lines[2].startswith("sequence parallel: positions 8-15 of 16 of the hidden states")
    assert "blocks.*.ln_1, blocks.*.ln_2, ln_f" in lines[2]
    assert lines[3] == "replicated: ln_f"  # its weights; it runs on the sequence shard
    # a pipeline stage's lines: its own layers, decided with the whole model
    stage = tuple(l for l in layers if l.name in ("ln_f", "lm_head"))
    tail = shard_lines(stage, 2, 0, all_layers=layers)
    assert tail[0] == "tp shard 0/2 of the vocabulary: lm_head rows 0-31 of 64 (logits stay vocabulary-sharded into the loss)"
    assert tail[1].startswith("sequence parallel: positions 0-7 of 16")


def test_own_loss_fn_gets_gathered_logits(model_file):
    layers = _layers(model_file, GPT + """
import torch.nn.functional as F


def loss_fn(outputs, targets):
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())
""")
    layout = tp_layout(layers, 2)
    assert layout.sequence_parallel and not layout.loss_parallel
    assert "lm_head" in [l.name for l in layout.vocab]  # its weight is still split
    warning, _ = layout.warnings
    assert _ == SP_GATHER_WARNING
    assert warning.startswith("lm_head's logits are all-gathered over tp before the loss (the model file's loss_fn")
    assert "(logits all-gathered for the loss)" in shard_lines(layers, 2, 0)[1]


def test_block_with_other_parameters_runs_without_sequence_parallelism(model_file):
    layers = _layers(model_file, GPT.replace("def build_model():\n    return GPT(CFG)", """
class ScaledBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.inner = block
        self.scale = torch.nn.Parameter(torch.ones(CFG.n_embd))

    def forward(self, x):
        return self.inner(x) * self.scale


def build_model():
    model = GPT(CFG)
    model.blocks = torch.nn.ModuleList(ScaledBlock(b) for b in model.blocks)
    return model"""))
    layout = tp_layout(layers, 2)
    assert not layout.sequence_parallel and layout.loss_parallel
    assert [l.name for l in layout.vocab] == ["wte", "wpe", "lm_head"]
    (warning,) = layout.warnings
    assert warning.startswith(
        "tensor parallelism runs without sequence parallelism: blocks.0 (ScaledBlock) holds parameters and is "
        "neither a Linear of the column/row-wise pair nor a norm"
    ), warning
    assert not any(line.startswith("sequence parallel") for line in shard_lines(layers, 2, 0))


def test_block_that_cannot_run_split_stays_whole(model_file):
    """A block whose forward sizes a tensor with the whole model's head count (T5's relative position
    bias: one row per head, added to the rank's heads) cannot run with its Linears split: found on
    fake tensors at plan time, the block keeps no TP plan (replicated on every TP rank), with a
    warning saying why, instead of a plan that dies after launch."""
    source = GPT.replace("n_head=2", "n_head=4").replace("def build_model():\n    return GPT(CFG)", """
import torch.nn.functional as F
from gpt import CausalSelfAttention

class HeadScaled(CausalSelfAttention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("head_scale", torch.linspace(0.5, 1.5, cfg.n_head).view(1, -1, 1, 1), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) * self.head_scale
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def build_model():
    model = GPT(CFG)
    model.blocks[1].attn = HeadScaled(CFG)
    return model""")
    profile = profile_model(load_model_file(model_file(source)), dtype="fp32", measure=False)
    tp = {l.name: l.tp for l in profile.layers}
    assert tp["blocks.0"] is not None and tp["blocks.1"] is None
    blocker = profile.layers[[l.name for l in profile.layers].index("blocks.1")].tp_role.split_blocker
    assert blocker.startswith("layer blocks.1 cannot run with its Linears split over 2 ranks (RuntimeError: ")
    assert f"tensor parallelism leaves 1 layer(s) whole on every rank: {blocker}" in profile.warnings
    layout = tp_layout(plan_layers(profile), 2)
    assert [l.name for l in layout.blocks] == ["blocks.0"] and not layout.sequence_parallel
    assert _tp_split(profile) == "the matmuls of 1 block(s) (blocks.1 cannot run split: whole on every TP rank)"
    plain = profile_model(load_model_file(model_file(GPT, "plain.py")), dtype="fp32", measure=False)
    assert all(l.tp is not None for l in plain.layers if l.name.startswith("blocks."))
    assert not any("whole on every rank" in w for w in plain.warnings)


def test_embedding_that_looks_up_other_indices_stays_whole(model_file):
    """Vocabulary parallelism hands an embedding's first input to the lookup: one whose forward looks
    up indices it computes (OPT's learned positions, made from the attention mask) keeps no TP plan,
    with a warning, instead of a run that dies in its first forward."""
    profile = profile_model(load_model_file(model_file(GPT.replace("def build_model():\n    return GPT(CFG)", """
class Reversed(torch.nn.Embedding):
    def forward(self, pos):
        return super().forward(pos.flip(0))


def build_model():
    model = GPT(CFG)
    model.wpe = Reversed(CFG.seq_len, CFG.n_embd)
    return model"""))), dtype="fp32", measure=False)
    layers = {l.name: l for l in profile.layers}
    assert layers["wte"].tp is not None and layers["wpe"].tp is None
    why = layers["wpe"].tp_role.split_blocker
    assert why == "embedding wpe (Reversed) looks up indices it computes, not its input, so it cannot be split over its vocabulary"
    assert f"tensor parallelism leaves 1 layer(s) whole on every rank: {why}" in profile.warnings
    assert [l.name for l in tp_layout(plan_layers(profile), 2).vocab] == ["wte", "lm_head"]


def test_own_head_counts_divided_and_written_outputs_copied(model_file):
    """A block whose views take its own head count (OPT's) runs on a shard all the same, silently
    mixing positions: the profiler finds the count sizes its views (the ops' shapes change with it
    divided) and the runtime divides it; an output the model writes in place (Falcon's) is copied.
    tests/distributed/test_parity.py (tp_own_heads) trains it against one process."""
    profile = profile_model(load_model_file(OWN_HEADS), dtype="fp32", measure=False)
    role = {l.name: l.tp_role for l in profile.layers}["blocks.1"]
    assert role.kind == "block" and role.local_heads == ("attn.n_head",) and role.cloned == ("mlp.down",)
    plain = [l.role for l in _layers(model_file, GPT) if l.role is not None]  # views with -1: nothing to do
    assert not any(r.local_heads or r.cloned for r in plain)


def test_sequence_length_not_divisible(model_file):
    layers = _layers(model_file, GPT.replace("seq_len=16", "seq_len=15"))
    layout = tp_layout(layers, 2)
    assert not layout.sequence_parallel
    assert any("the sequence length 15 is not a multiple of tp=2" in w for w in layout.warnings)


def test_tied_weights_stay_replicated(model_file):
    layers = _layers(model_file, GPT.replace("def build_model():\n    return GPT(CFG)", """
def build_model():
    model = GPT(CFG)
    model.lm_head.weight = model.wte.weight
    return model"""))
    layout = tp_layout(layers, 2)
    assert [l.name for l in layout.vocab] == ["wpe"]
    assert layout.sequence_parallel and not layout.loss_parallel
    assert layout.warnings == (
        "wte shares its weight with lm_head.weight (tied): both stay replicated, not vocabulary-parallel as planned",
        SP_GATHER_WARNING,
    )


def test_dropout_on_sequence_shards_found(model_file):
    """Dropout that runs on the sequence shards (outside attention/MLP, or after a row-wise Linear)
    draws a mask of its own on every tp rank (tensor_parallel._own_dropout_masks); attention dropout
    (on head shards) is not among them."""
    layers = _layers(model_file, GPT.replace("n_embd=32)", "n_embd=32, dropout=0.1, attn='math')"))
    layout = tp_layout(layers, 2)
    assert layout.sequence_parallel and layout.warnings == (SP_GATHER_WARNING,)
    assert tuple(n for l in layers for n in l.role.shard_dropout) == (
        "drop", "blocks.0.attn.resid_dropout", "blocks.0.mlp.dropout", "blocks.1.attn.resid_dropout", "blocks.1.mlp.dropout",
    )


MOE = """
import torch
from moe import MoEConfig, build_moe
from llama import llama_batch

CFG = MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab=64, seq_len=16, n_experts=4, top_k=2)


def build_model():
    return build_moe(CFG)


def sample_batch(batch_size):
    return llama_batch(CFG, batch_size)
"""


def test_mixture_of_experts_blocks_stay_whole_under_expert_parallelism(model_file):
    """With ep > 1 tensor parallelism leaves each MoE block (router and experts) whole: only the
    attention's Linears split, and the block runs on the sequence shard (never gathered). Without
    EP tensor parallelism splits the experts' Linears, whose inputs are routed rows: no sequence
    parallelism, with a warning saying why."""
    layers = _layers(model_file, MOE)
    with_ep = tp_layout(layers, 2, ep=2)
    assert with_ep.sequence_parallel and with_ep.loss_parallel and with_ep.warnings == (SP_GATHER_WARNING,)
    block = with_ep.blocks[0]
    assert block.tp.colwise == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert block.tp.rowwise == ("self_attn.o_proj",) and block.role.gathers == ("self_attn",)
    lines = shard_lines(layers, 2, 1, ep=2)
    assert lines[0] == ("tp shard 1/2 of layers.*.self_attn.q_proj, layers.*.self_attn.k_proj, layers.*.self_attn.v_proj "
                        "(colwise); layers.*.self_attn.o_proj (rowwise)")
    assert ("not split by tp (mixture-of-experts blocks: experts split by ep, the rest replicated; on this rank's "
            "sequence shard): layers.*.mlp") in lines
    alone = tp_layout(layers, 2)
    assert not alone.sequence_parallel
    assert "mlp.experts.0.gate_proj" in alone.blocks[0].tp.colwise
    assert alone.warnings[0].startswith("tensor parallelism runs without sequence parallelism: the mixture-of-experts "
                                        "block layers.0.mlp runs on the sequence shards only with expert parallelism")


HF_LLAMA = EXAMPLES.parent / "tests" / "hf_llama_model.py"


def test_hugging_face_layers_take_the_shard_at_the_first_layer():
    """A Hugging Face decoder layer takes the rotary tables, the mask and the positions beside the
    hidden states, and the model computes them from the embeddings' sequence length: sequence
    parallelism runs with the embeddings whole and the first layer cutting its input to the shard
    (the attention gets its hidden states by keyword, gathered). tests/distributed/test_parity.py
    (tp_hf_llama) trains it against one process."""
    pytest.importorskip("transformers")
    layers = plan_layers(profile_model(load_model_file(HF_LLAMA), dtype="fp32", measure=False))
    roles = {l.name: l.role for l in layers}
    assert {r.shard_at for r in roles.values()} == {"model.layers.0"}
    block = roles["model.layers.1"]
    assert block.gathers == ("self_attn", "mlp") and block.gather_kwargs == (("self_attn", "hidden_states"),)
    layout = tp_layout(layers, 2)
    assert layout.sequence_parallel and layout.warnings == (SP_GATHER_WARNING,)
    (line,) = [x for x in shard_lines(layers, 2, 1) if x.startswith("sequence parallel")]
    assert line.startswith("sequence parallel: positions 8-15 of 16 of the hidden states outside the Linear pairs, "
                           "from model.layers.0's input on"), line


def test_block_adding_a_whole_sequence_tensor_runs_without_sequence_parallelism(model_file):
    """A block that adds a tensor of the whole sequence, taken beside the hidden states, to them
    cannot run on a shard: found by running the model on fake tensors as a sequence-parallel rank,
    so the plan runs TP without SP (with the reason) instead of dying after launch."""
    layers = _layers(model_file, GPT.replace("def build_model():\n    return GPT(CFG)", """
class Biased(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.inner = block

    def forward(self, x, bias):
        return self.inner(x + bias)


class BiasedGPT(GPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = torch.nn.ModuleList(Biased(b) for b in self.blocks)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        bias = torch.ones(idx.shape[0], idx.shape[1], x.shape[-1])  # the whole sequence's
        for block in self.blocks:
            x = block(x, bias)
        return self.lm_head(self.ln_f(x))


def build_model():
    return BiasedGPT(CFG)"""))
    layout = tp_layout(layers, 2)
    assert not layout.sequence_parallel
    (warning,) = layout.warnings
    assert warning.startswith("tensor parallelism runs without sequence parallelism: the model does not run on "
                              "sequence shards (in blocks.0 (Biased): RuntimeError: "), warning

