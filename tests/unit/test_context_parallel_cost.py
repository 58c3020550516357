"""Context parallelism in the profile and the cost model, each formula on a case computed by hand:
what the profiler records of attention and what blocks a sequence split, the ring's traffic, the
1/cp share of tokens, ZeRO over dp x cp, the CP group's link, and the search's choices."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cost import comm
from planner.cost.compute import memory_bound_s
from planner.cost.setup import Candidate, Training
from planner.cost.stage_costs import (NONE, atom_table, attention_run_flops, ring_exposed_s, stage_costs,
                                      torch_ring_merge_bytes)
from planner.cost.topology import links
from planner.errors import BadInput
from planner.hardware import make_cluster
from planner.model_file import load_model_file
from planner.profile.profiler import profile_model
from tests.conftest import EXAMPLES

GIB = 2**30


@pytest.fixture(scope="module")
def llama():
    """examples/llama.py (dim 256, 8 heads of 32, 2 kv heads repeated to 8 before SDPA, seq 256), bf16."""
    return profile_model(load_model_file(EXAMPLES / "llama.py"), batch_size=2, dtype="bf16", measure=False)


@pytest.fixture(scope="module")
def llama7b():
    """examples/llama_7b.py (seq 4096) on fake tensors: large enough that no op is launch-bound on a GPU."""
    return profile_model(load_model_file(EXAMPLES / "llama_7b.py"), batch_size=1, dtype="bf16", measure=False)


def test_profile_records_the_keys_and_values_attention_reads(llama):
    blocks = [l for l in llama.layers if l.attention_kv_bytes]
    assert len(blocks) == 4 and llama.cp_blocker == ""
    # K and V after the grouped-query repeat: batch 2 x 8 heads x 256 tokens x 32 dims x 2 bytes each
    assert blocks[0].attention_kv_bytes == 2 * (2 * 8 * 256 * 32 * 2)
    # before the repeat: the 2 key/value heads themselves (what Transformer Engine's ring moves)
    assert blocks[0].attention_kv_unique_bytes == 2 * (2 * 2 * 256 * 32 * 2)
    # SDPA forward: Q K^T and P V, 2 x (2 x 8 x 256 x 256 x 32) multiply-adds
    assert blocks[0].fwd_attention_flops == 2 * 2 * (2 * 8 * 256 * 256 * 32)
    assert 0 < blocks[0].fwd_attention_flops < blocks[0].fwd_flops
    assert blocks[0].bwd_attention_flops == pytest.approx(2.5 * blocks[0].fwd_attention_flops)


@pytest.mark.parametrize("example,reason", [
    ("gpt.py", "makes positions with torch.arange over the whole sequence"),
    ("hf_gpt2.py", "the forward, outside its submodules, makes positions with torch.arange over the whole sequence"),
    ("mlp.py", "no sequence dimension"),
])
def test_what_blocks_context_parallelism(example, reason):
    if example == "hf_gpt2.py":
        pytest.importorskip("transformers")
    profile = profile_model(load_model_file(EXAMPLES / example), batch_size=1, measure=False)
    assert reason in profile.cp_blocker
    if example == "hf_gpt2.py":
        # on fake tensors Hugging Face's mask builder would take its own positions for packed
        # sequences and pass SDPA a mask; as in a real run it passes is_causal (profiler:
        # materialize.one_sequence_per_row), which the cost model times at half the FLOPs
        blocks = [l for l in profile.layers if l.fwd_attention_flops]
        assert blocks and all(l.fwd_causal_attention_flops == l.fwd_attention_flops for l in blocks)


def test_unfused_attention_blocks_context_parallelism(model_file):
    path = model_file("""
        from gpt import GPTConfig, build_gpt, gpt_batch
        CONFIG = GPTConfig(vocab=512, seq_len=64, n_layer=2, n_head=4, n_embd=64, attn="math")
        def build_model():
            return build_gpt(CONFIG)
        def sample_batch(batch_size):
            return gpt_batch(CONFIG, batch_size)
    """)
    profile = profile_model(load_model_file(path), batch_size=1, measure=False)
    assert "computes attention scores with matmuls" in profile.cp_blocker


def test_cp_splits_the_tokens_and_adds_the_ring(llama7b, monkeypatch):
    """cp = 2 inside an H100 node: every token-proportional figure halves (attention's too: each
    rank's queries meet all keys), the parameters do not, and each attention layer pays the
    ring: forward all-gathers K and V, backward gathers them again and reduce-scatters their fp32
    gradients (twice the bytes), none of it hidden here (OVERLAP_CONTENTION set past 1 / the link's
    share of HBM, so that the ring's whole volume shows; the share it hides is comm.overlap_share's); and merges its partial
    outputs and sums the gradients as torch's ring does (torch_ring_merge_bytes, at cp 2: 50 bytes
    per rank's query element and 4 per key and value element forward, 30 and 53 backward);
    its attention calls, over half the keys each, pay their rows' fixed work twice as often.
    (At every GEMM's best-shape share: with the H100's shape table, half the rows run a little
    slower, tests/unit/test_gemm_shapes.py.)"""
    monkeypatch.setattr(comm, "OVERLAP_CONTENTION", 1e6)
    cluster = make_cluster("h100-sxm-80gb", 2)
    cluster = replace(cluster, gpu=replace(cluster.gpu, matmul_shapes=None))
    training = Training("bf16", "adamw", 4, 80 * GIB)
    one = atom_table(llama7b, cluster, training, 1, 1)
    two = atom_table(llama7b, cluster, training, 1, 1, cp=2)
    link = links(cluster, Candidate(1, 1, 1, 1, 1, 0, "1f1b", cp=2)).cp
    ag, rs = comm.allgather(2, link), comm.reduce_scatter(2, link)
    for a, b in zip(one, two):
        layer = llama7b.layers[a.first]
        assert b.params == a.params
        work = b.fwd_s + b.bwd_s - b.cp_comm_s
        q = layer.fwd_attention_flops / (4 * 4096) / 2  # SDPA: 4 x seq FLOPs per query element; a rank's half
        kv = layer.attention_kv_bytes / 2 / 2  # bf16 elements, a rank's half
        merge = memory_bound_s(50 * q + 4 * kv, cluster.gpu) + memory_bound_s(30 * q + 53 * kv, cluster.gpu)
        # each ring step's call covers 2048 keys, not 4096: its rows' fixed work weighs twice
        rows = sum(attention_run_flops(f, c, 2048) - attention_run_flops(f, c, 4096)
                   for f, c in ((layer.fwd_attention_flops, layer.fwd_causal_attention_flops),
                                (layer.bwd_attention_flops, layer.bwd_causal_attention_flops))) / 2
        ring = rows / (cluster.gpu.peak("bf16") * cluster.gpu.attention_efficiency)
        if layer.kind == "Embedding":  # its small backward ops stay near the launch floor: a bit over half
            assert (a.fwd_s + a.bwd_s) / 2 <= work < 0.51 * (a.fwd_s + a.bwd_s)
        else:
            assert (ring > 0) == (layer.fwd_attention_flops > 0)
            assert work == pytest.approx((a.fwd_s + a.bwd_s) / 2 + merge + ring)
            assert (merge > 0) == (layer.attention_kv_bytes > 0)
        assert b.act_bytes[NONE] == pytest.approx(a.act_bytes[NONE] / 2)
        kv = layer.attention_kv_bytes  # micro-batch 1 as profiled: the whole sequence's K and V
        expect = ag(kv) + ag(kv) + rs(2 * kv) if kv else 0.0
        assert b.cp_comm_s == pytest.approx(expect)
    assert sum(b.cp_comm_s for b in two) > 0


@pytest.mark.parametrize("kernel, heads", [("sdpa", 8), ("te", 2)])
def test_a_ring_moves_the_key_value_heads_the_attention_kernel_reads(llama, kernel, heads, monkeypatch):
    """examples/llama.py repeats its 2 key/value heads to the 8 query heads before SDPA: torch's
    ring moves the 8 repeated; Transformer Engine's attention takes the 2 as they are, and so does
    its ring (Training.attention_kernel "te"): a quarter of the bytes (none of them hidden here:
    OVERLAP_CONTENTION set past what leaves any)."""
    monkeypatch.setattr(comm, "OVERLAP_CONTENTION", 1e6)
    cluster = make_cluster("h100-sxm-80gb", 2)
    training = Training("bf16", "adamw", 4, 80 * GIB, attention_kernel=kernel)
    link = links(cluster, Candidate(1, 1, 1, 1, 1, 0, "1f1b", cp=2)).cp
    ag, rs = comm.allgather(2, link), comm.reduce_scatter(2, link)
    block = next(k for k, l in enumerate(llama.layers) if l.attention_kv_bytes)
    atom = next(a for a in atom_table(llama, cluster, training, 1, 1, cp=2) if a.first == block)
    kv = 2 * (8 * 256 * 32 * 2) * heads / 8  # micro-batch 1: the whole sequence's K and V, bf16
    assert atom.cp_comm_s == pytest.approx(ag(kv) + ag(kv) + rs(2 * kv))


def test_torchs_ring_hides_its_gather_behind_the_first_step_alone():
    """cp 4, attention 8 ms forward and 16 ms backward, the gather 5 ms and the gradients' 6 ms,
    half of any overlap hidden. Torch's rotater gathers at the first step and waits at the second:
    forward 5 - 0.5 x 2 = 4 ms past the first step's 2 ms; backward the gather past its 4 ms
    (5 - 2 = 3) and the gradients beside the other 12 ms, half of them (3): 6 ms. Transformer
    Engine's ring runs beside the whole attention: 2.5 ms and (11 x 0.5) 5.5 ms."""
    assert ring_exposed_s(8e-3, 16e-3, 5e-3, 6e-3, 4, 0.5, gathers_first=True) == pytest.approx((4e-3, 6e-3))
    assert ring_exposed_s(8e-3, 16e-3, 5e-3, 6e-3, 4, 0.5, gathers_first=False) == pytest.approx((2.5e-3, 5.5e-3))
    # all hidden (no contention): only what outlasts its window shows
    assert ring_exposed_s(8e-3, 16e-3, 5e-3, 6e-3, 4, 1.0, gathers_first=True) == pytest.approx((3e-3, 1e-3))
    assert ring_exposed_s(8e-3, 16e-3, 5e-3, 6e-3, 4, 1.0, gathers_first=False) == pytest.approx((0.0, 0.0))


def test_torchs_ring_merges_and_sums_in_fp32_one_eager_op_at_a_time():
    """cp 4, a rank's queries 1 element, keys and values 2 (repeated to the query heads). bf16,
    forward: 3 steps merging (cast to fp32 6, three fp32 ops 32) and concatenating the keys and
    values (4 each), the first block's cast and the result's back (12): 3 x (38 + 8) + 12 = 150.
    Backward: zeros (4 x 3), 3 concatenations of the keys and values (3 x 8), the first step's
    sums (10 x 3) and concatenation (16), 3 later steps (half-sums rebuilt whole 13 x 2, the
    concatenation 16, the queries' 10), casts back (6 x 3): 12 + 24 + 46 + 156 + 18 = 256. In fp32
    the casts are no copies and a sum reads 4 bytes more: 144 and 280."""
    assert torch_ring_merge_bytes(1, 2, 4, 2) == pytest.approx((150, 256))
    assert torch_ring_merge_bytes(1, 2, 4, 4) == pytest.approx((144, 280))


def test_zero_shards_over_dp_times_cp_and_the_ranks_are_tp_cp_dp(llama):
    cluster = make_cluster("a100-80gb", 16)  # two nodes of 8, one 25 GB/s NIC per GPU
    training = Training("bf16", "adamw", 4, 80 * GIB)
    cand = Candidate(tp=2, pp=1, dp=2, micro_batch=1, num_microbatches=2, zero=3, schedule="1f1b", cp=4)
    costs = stage_costs(llama, cluster, training, cand)
    assert cand.grad_ranks == 8 and cand.dp_shard == 8
    assert costs.state_bytes_per_param() == pytest.approx((2 / 8, 2 / 8, 12 / 8))
    lk = links(cluster, cand)
    # a CP group strides by tp: 4 x 2 = 8 ranks, one node; the dp x cp group spans both nodes
    assert not lk.cp_spans_nodes and lk.cp.bandwidth_Bps == pytest.approx(300e9)
    assert lk.dp_spans_nodes and lk.dp.bandwidth_Bps == pytest.approx(4 * 25e9)  # 4 members per node
    wide = links(cluster, Candidate(tp=8, pp=1, dp=1, micro_batch=1, num_microbatches=2, zero=0, schedule="1f1b", cp=2))
    assert wide.cp_spans_nodes and wide.cp.bandwidth_Bps == pytest.approx(25e9)  # one member per node


def test_search_splits_a_long_sequence_and_refuses_cp_where_the_model_cannot():
    from planner.planning import PlanRequest, make_plan
    from planner.search.space import Fixed

    # 64 GPUs, 4 sequences of 131,072 tokens: a sequence must be split over 16 GPUs, more than a
    # node's tensor parallelism holds
    plan = make_plan(load_model_file(EXAMPLES / "llama3_8b_128k.py"),
                     PlanRequest(gpus=64, gpu="h100-sxm-80gb", global_batch=4, precision="bf16", optimizer="adamw"))
    p = plan.parallel
    assert p.cp > 1 and p.tp <= 8 and p.dp * p.cp * p.tp * p.pp == 64
    assert any("Context parallelism over" in line for line in plan.explanation)
    # fixing cp: that degree
    fixed = make_plan(load_model_file(EXAMPLES / "llama3_8b_128k.py"),
                      PlanRequest(gpus=64, gpu="h100-sxm-80gb", global_batch=4, precision="bf16", optimizer="adamw",
                                  fixed=Fixed(cp=8)))
    assert fixed.parallel.cp == 8
    with pytest.raises(BadInput, match="--cp 2: context parallelism cannot run on this model: .*torch.arange"):
        make_plan(load_model_file(EXAMPLES / "gpt.py"),
                  PlanRequest(gpus=4, gpu="a100-80gb", precision="bf16", optimizer="adamw", fixed=Fixed(cp=2)))
    with pytest.raises(BadInput, match="does not split into 2 x 3 equal shards"):
        make_plan(load_model_file(EXAMPLES / "llama.py"),
                  PlanRequest(gpus=6, gpu="a100-80gb", precision="bf16", optimizer="adamw", fixed=Fixed(cp=3)))


def test_no_cp_on_pipeline_stages_the_tracer_splits(llama):
    """The runtime runs CP inside pipeline stages it splits itself, not inside traced ones: the
    search leaves those out and says why."""
    from planner.search.space import Fixed, SpaceStats, candidates

    traced = replace(llama, pipeline_split="traced")
    stats = SpaceStats()
    found = list(candidates(traced, 4, 8, 6, 8, Fixed(tp=1, pp=2, cp=2), stats))
    assert found == [] and any("split by the tracer" in why for why in stats.rejected)
    plain = list(candidates(llama, 4, 8, 6, 8, Fixed(tp=1, pp=2, cp=2), SpaceStats()))
    assert plain and all((c.pp, c.cp) == (2, 2) for c in plain)


def test_grouped_query_keys_and_values_are_counted_once_however_the_model_repeats_them(model_file):
    """HF's repeat_kv (expand then reshape) as well as repeat_interleave: the unique bytes are the
    key/value heads', what a kernel with grouped-query attention of its own reads and its ring moves."""
    path = model_file(
        """
        import torch, torch.nn as nn, torch.nn.functional as F
        B, S, HEADS, KV, D = 2, 64, 8, 2, 16
        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(HEADS * D, HEADS * D)
                self.kv = nn.Linear(HEADS * D, 2 * KV * D)
            def forward(self, x):
                q = self.q(x).view(B, S, HEADS, D).transpose(1, 2)
                k, v = self.kv(x).view(B, S, 2, KV, D).unbind(2)
                k, v = k.transpose(1, 2), v.transpose(1, 2)
                k = k[:, :, None].expand(B, KV, HEADS // KV, S, D).reshape(B, HEADS, S, D)
                v = v.repeat_interleave(HEADS // KV, dim=1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)
        def build_model():
            return nn.Sequential(Attn(), nn.Linear(HEADS * D, 4))
        def sample_batch(b):
            return torch.randn(b, S, HEADS * D), torch.randn(b, S, 4)
        """
    )
    profile = profile_model(load_model_file(path), batch_size=2, dtype="fp32", measure=False)
    attn = next(l for l in profile.layers if l.attention_kv_bytes)
    assert attn.attention_kv_bytes == 2 * (2 * 8 * 64 * 16 * 4)
    assert attn.attention_kv_unique_bytes == 2 * (2 * 2 * 64 * 16 * 4)



HF_POSITIONS = """
import sys
sys.path.insert(0, {tests!r})
import torch
from hf_llama_model import SEQ, batch_with_positions, build_model


def sample_batch(batch_size):
    return batch_with_positions(batch_size{positions})
"""


def test_hugging_face_positions_one_sequence_per_row_or_packed(model_file):
    """A Hugging Face Llama given its position ids (tests/hf_llama_model.py) can run context
    parallelism: each rank's shard of them, in load-balanced order, jumps where its two chunks
    meet, which the runtime tells Hugging Face's mask builder is not packing (the whole rows were
    one sequence each: tests/distributed/test_parity.py, tp_cp_hf_llama). A sample batch whose rows
    pack several sequences (positions restarting) needs a mask, which a ring cannot split."""
    pytest.importorskip("transformers")
    tests = str(EXAMPLES.parent / "tests")
    rows = model_file(HF_POSITIONS.format(tests=tests, positions=""))
    assert profile_model(load_model_file(rows), batch_size=2, measure=False).cp_blocker == ""
    packed = model_file(HF_POSITIONS.format(tests=tests, positions=", torch.arange(SEQ).remainder(SEQ // 2)"))
    blocker = profile_model(load_model_file(packed), batch_size=2, measure=False).cp_blocker
    assert blocker.startswith("the sample batch packs several sequences in a row (its position_ids restart)"), blocker
