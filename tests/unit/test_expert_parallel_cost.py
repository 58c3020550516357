"""Mixture-of-experts models in the profile, the cost model and the search, each figure on a case
computed by hand: which blocks are found (a router and a list of identical experts, or stacked
expert weights), the rows sent to the experts, expert parallelism's all-to-alls, the experts'
weights divided by ep and their state sharded over the ranks that hold the same experts, and
the search's choices and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import planner.profile.flops  # noqa: F401  (registers the formulas)
from planner.cli import main
from planner.cost import comm
from planner.cost.setup import Candidate, Training
from planner.cost.stage_costs import atom_table, stage_costs
from planner.cost.topology import links
from planner.hardware import make_cluster
from planner.model_file import load_model_file
from planner.profile.moe import find_moe
from planner.profile.profiler import profile_model
from tests.conftest import EXAMPLES

GIB = 2**30
DIM, FFN, EXPERTS, SEQ = 64, 128, 8, 64  # examples/moe.py's CONFIG


TINY_MIXTRAL = (
    "import torch\n"
    "from transformers import MixtralConfig, MixtralForCausalLM\n"
    "CFG = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,\n"
    "                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,\n"
    "                    max_position_embeddings=16, use_cache=False)\n"
    "def build_model():\n"
    "    return MixtralForCausalLM(CFG)\n"
    "def sample_batch(n):\n"
    "    ids = torch.randint(0, 64, (n, 17))\n"
    "    return ids[:, :-1], ids[:, 1:]\n"
)
"""A model file: a 2-layer Hugging Face Mixtral of 4 experts built from a config."""


@pytest.fixture(scope="module")
def moe():
    """examples/moe.py (2 layers of 8 SwiGLU experts, top 2), batch 4, on fake tensors."""
    return profile_model(load_model_file(EXAMPLES / "moe.py"), batch_size=4, dtype="bf16", measure=False)


def test_blocks_are_found_by_structure():
    import sys

    sys.path.insert(0, str(EXAMPLES))
    import llama
    import moe as moe_example

    blocks = find_moe(moe_example.build_model())
    assert [(b.name, b.experts, b.router, b.num_experts, b.stacked, b.top_k) for b in blocks] == [
        (f"layers.{i}.mlp", f"layers.{i}.mlp.experts", f"layers.{i}.mlp.gate", 8, False, 2) for i in range(2)]
    assert find_moe(llama.build_model()) == []


def test_hugging_face_stacked_experts_are_found():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    blocks = find_moe(transformers.MixtralForCausalLM(cfg))
    assert [(b.experts, b.router, b.num_experts, b.stacked, b.top_k) for b in blocks] == [
        (f"model.layers.{i}.mlp.experts", f"model.layers.{i}.mlp.gate", 4, True, 2) for i in range(2)]


def test_profile_records_experts_and_the_rows_they_receive(moe):
    layers = [l for l in moe.layers if l.moe_experts]
    assert len(layers) == 2
    layer = layers[0]
    assert (layer.moe_experts, layer.moe_top_k) == (EXPERTS, 2)
    assert layer.expert_params == EXPERTS * 3 * DIM * FFN
    # 4 sequences x 64 tokens, each sent to 2 experts: rows of 64 bf16 values
    assert layer.moe_dispatch_bytes == 4 * SEQ * 2 * DIM * 2


def test_fake_and_real_traces_count_the_same_expert_work(moe):
    """On fake tensors the experts get an even share of the tokens x top-k rows (the user's
    routing reads values); any routing sends that many rows, so the FLOPs are the real trace's."""
    real = profile_model(load_model_file(EXAMPLES / "moe.py"), batch_size=4, dtype="bf16", measure=True, repeats=1)
    assert moe.mode == "meta" and real.mode == "materialized"
    for a, b in zip(moe.layers, real.layers):
        assert (a.fwd_flops, a.bwd_flops, a.moe_dispatch_bytes) == (b.fwd_flops, b.bwd_flops, b.moe_dispatch_bytes)
        assert a.activation_bytes == pytest.approx(b.activation_bytes, rel=0.05)


def test_top_k_is_measured_when_no_attribute_names_it(model_file):
    path = model_file("""
        import torch, torch.nn as nn, torch.nn.functional as F
        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.router = nn.Linear(16, 4, bias=False)
                self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
            def forward(self, x):
                h = x.reshape(-1, 16)
                w, idx = torch.topk(F.softmax(self.router(h), -1), 3, -1)
                out = torch.zeros_like(h)
                for e, ex in enumerate(self.experts):
                    tok, slot = torch.where(idx == e)
                    out.index_add_(0, tok, ex(h[tok]) * w[tok, slot, None])
                return out.reshape(x.shape)
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(32, 16)
                self.moe = MoE()
                self.head = nn.Linear(16, 32)
            def forward(self, x):
                return self.head(self.moe(self.emb(x)))
        def build_model():
            return M()
        def sample_batch(n):
            ids = torch.randint(0, 32, (n, 9))
            return ids[:, :-1], ids[:, 1:]
    """)
    profile = profile_model(load_model_file(path), batch_size=2, dtype="fp32", measure=False)
    layer = next(l for l in profile.layers if l.moe_experts)
    assert (layer.moe_experts, layer.moe_top_k) == (4, 3)
    assert layer.moe_dispatch_bytes == 2 * 8 * 3 * 16 * 4


def test_grouped_mm_flops():
    """Every row meets one group's (K, N) matrix: 2 x rows x K x N, however the rows are grouped."""
    x, w = torch.randn(10, 16), torch.randn(4, 16, 32)
    offs = torch.tensor([3, 5, 5, 10], dtype=torch.int32)
    with FlopCounterMode(display=False) as counter:
        torch._grouped_mm(x, w, offs=offs)
    assert counter.get_total_flops() == 2 * 10 * 16 * 32


def test_ep_adds_four_all_to_alls_and_divides_the_experts(moe):
    """ep = 4 on 4 GPUs of a node: each MoE layer sends its rows to the experts and back (two
    all-to-alls of moe_dispatch_bytes per micro-batch, 3/4 of them leaving the GPU), and again
    for the gradients in backward; nothing else changes per micro-batch; the device holds 1/4 of
    the experts and all the rest."""
    cluster = make_cluster("h100-sxm-80gb", 4)
    training = Training("bf16", "adamw", 16, 80 * GIB)
    one = atom_table(moe, cluster, training, 1, 2)
    four = atom_table(moe, cluster, training, 1, 2, ep=4)
    link = links(cluster, Candidate(1, 1, 4, 2, 1, 0, "1f1b", ep=4)).ep
    a2a = comm.all_to_all(4, link)
    for a, b in zip(one, four):
        layer = moe.layers[a.first]
        rows = layer.moe_dispatch_bytes * 2 / moe.batch_size
        expect = 4 * a2a(rows) if layer.moe_experts else 0.0
        assert b.ep_comm_s == pytest.approx(expect)
        assert b.fwd_s + b.bwd_s == pytest.approx(a.fwd_s + a.bwd_s + expect)
        assert b.act_bytes == a.act_bytes
        assert b.params == pytest.approx(layer.num_params - layer.expert_params * 3 / 4)
        assert b.expert_params == pytest.approx(layer.expert_params / 4)
    # the all-to-all: (n - 1) / n of the bytes over the node's links
    assert a2a(1e9) == pytest.approx(a2a.fixed_s + 0.75e9 / (cluster.gpu.intra_node_bandwidth_Bps * comm.LINK_EFFICIENCY))


def test_under_ep_a_rank_reads_its_own_experts_weights_once_a_micro_batch(moe):
    """Where the experts' grouped GEMMs are bound by memory (a GPU of endless FLOP/s and 1 GB/s of
    HBM), ep = 4 takes from each MoE layer's forward the weights of the 3/4 of the experts it does
    not hold, and from its backward (which reads them and writes their gradients) twice that:
    W (scale - 1/4) and 2 W (scale - 1/4) bytes, W the layer's expert weights, scale the
    micro-batch over the profile's batch (what every other byte of the layer is scaled by)."""
    from dataclasses import replace

    from planner.cost.constants import MEMORY_EFFICIENCY
    from planner.hardware import load_catalogue

    gpu = load_catalogue()["h100-sxm-80gb"]
    slow = replace(gpu, peak_flops={k: v * 1e9 for k, v in gpu.peak_flops.items()}, hbm_bandwidth_Bps=1e9,
                   matmul_shapes=None)
    cluster = make_cluster(slow, 4)
    training = Training("bf16", "adamw", 16, 80 * GIB)
    one = atom_table(moe, cluster, training, 1, 2)
    four = atom_table(moe, cluster, training, 1, 2, ep=4)
    hbm = 1e9 * MEMORY_EFFICIENCY
    seen = 0
    for a, b in zip(one, four):
        layer = moe.layers[a.first]
        if not layer.moe_experts:
            continue
        seen += 1
        away = layer.expert_params * layer.param_bytes / layer.num_params * (2 / moe.batch_size - 1 / 4) / hbm
        c = b.ep_comm_s / 2
        assert (b.fwd_s - c, b.bwd_s - c) == pytest.approx((a.fwd_s - away, a.bwd_s - 2 * away))
    assert seen == 2


@pytest.mark.parametrize("gbps", [None, 0.4])
def test_ep_overlap_hides_each_phase_s_all_to_alls_behind_the_other_phase_s_compute(moe, gbps):
    """--ep-overlap on (one micro-batch's forward beside another's backward, layer by layer): each
    phase's two all-to-alls (c) are exposed only past the other phase's compute (F, B): forward
    F + max(0, c - B), backward B + max(0, c - F). Inside a node they hide entirely; one GPU a node
    at 0.4 Gb/s, F < c < B: the forward's hide behind the backward, the backward's show past the
    forward. Nothing else in the layer changes."""
    cluster = make_cluster("h100-sxm-80gb", 4, gpus_per_node=1 if gbps else None, inter_node_gbps=gbps)
    training = Training("bf16", "adamw", 16, 80 * GIB)
    plain = atom_table(moe, cluster, training, 1, 2, ep=4)
    over = atom_table(moe, cluster, training, 1, 2, ep=4, ep_overlap=True)
    moe_atoms = 0
    for a, b in zip(plain, over):
        c = a.ep_comm_s / 2
        f, bwd = a.fwd_s - c, a.bwd_s - c
        exposed = max(0.0, c - bwd), max(0.0, c - f)
        assert (b.fwd_s, b.bwd_s, b.ep_comm_s) == pytest.approx((f + exposed[0], bwd + exposed[1], sum(exposed)))
        assert (b.act_bytes, b.params, b.expert_params) == (a.act_bytes, a.params, a.expert_params)
        if c:
            moe_atoms += 1
            assert exposed == ((0.0, 0.0) if gbps is None else (0.0, pytest.approx(c - f)))
            assert gbps is None or f < c < bwd
    assert moe_atoms == 2


def test_an_ep_group_across_nodes_uses_each_gpu_s_port():
    """ep = 8 with 4 GPUs a node: 3/8 of each GPU's rows stay in its node, 4/8 cross the network
    through its own port."""
    cluster = make_cluster("h100-sxm-80gb", 8, gpus_per_node=4)
    lk = links(cluster, Candidate(1, 1, 8, 1, 1, 0, "1f1b", ep=8))
    assert lk.ep_spans_nodes
    gpu = cluster.gpu
    seconds = 3 / 8 / gpu.intra_node_bandwidth_Bps + 4 / 8 / gpu.inter_node_bandwidth_Bps
    assert lk.ep.bandwidth_Bps == pytest.approx((7 / 8) / seconds)


def test_expert_state_is_sharded_over_the_ranks_that_hold_the_same_experts(moe):
    """dp = 4, ep = 2, ZeRO-1: the dense parameters' optimizer state over 4 ranks, the experts'
    (half of them on each GPU) over the 2 that hold the same experts; weights and gradients whole."""
    cluster = make_cluster("h100-sxm-80gb", 4)
    training = Training("bf16", "adamw", 16, 80 * GIB)
    cand = Candidate(1, 1, 4, 2, 2, 1, "1f1b", ep=2)
    costs = stage_costs(moe, cluster, training, cand)
    experts = sum(l.expert_params for l in moe.layers)
    dense = moe.num_params - experts
    w, g, o = costs.state_bytes(sum(a.params for a in costs.atoms), sum(a.expert_params for a in costs.atoms))
    assert w == pytest.approx(2 * (dense + experts / 2))
    assert g == pytest.approx(2 * (dense + experts / 2))
    assert o == pytest.approx(12 * (dense / 4 + experts / 2 / 2))
    # ZeRO-0: the experts' gradients are all-reduced over 2 ranks, the rest over 4
    ddp = stage_costs(moe, cluster, training, Candidate(1, 1, 4, 2, 2, 0, "1f1b", ep=2))
    dp_link = ddp.links.dp
    assert ddp.expert_grad_sync_per_byte_s == pytest.approx(comm.allreduce(2, dp_link).per_byte_s)
    assert ddp.grad_sync.per_byte_s == pytest.approx(comm.allreduce(4, dp_link).per_byte_s)


def test_plan_runs_ep_where_asked_and_explains_it(tmp_path):
    out = tmp_path / "plan.json"
    assert main([str(EXAMPLES / "moe.py"), "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--ep", "2",
                 "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["parallel"]["ep"] == 2 and plan["parallel"]["dp"] == 4
    assert plan["predicted"]["breakdown_s"]["ep_comm"] > 0
    assert any(line.startswith("Expert parallelism over 2 GPUs") for line in plan["explanation"])


@pytest.mark.parametrize("args,message", [
    (["llama.py", "--ep", "2"], "--ep 2: expert parallelism needs mixture-of-experts blocks and this model has none"),
    (["moe.py", "--ep", "3"], "--ep 3: the 8 experts of each mixture-of-experts block do not split evenly over 3 ranks"),
    (["moe.py", "--ep", "2", "--tp", "2", "--sequence-parallel", "off"],
     "--ep 2 with --tp 2 needs sequence parallelism (each tensor-parallel rank routes its own sequence shard through "
     "the experts): drop --sequence-parallel off"),
    # without EP a list of experts is split by TP and sees routed rows: no sequence parallelism
    (["moe.py", "--tp", "2", "--dp", "2", "--ep", "1", "--sequence-parallel", "on"],
     "--sequence-parallel on: sequence parallelism cannot run on this model: the mixture-of-experts block "
     "layers.0.mlp runs on the sequence shards only with expert parallelism (ep > 1)"),
    (["moe.py", "--ep", "4", "--dp", "2", "--tp", "1", "--cp", "1"],
     "--ep 4: expert parallelism splits the experts over consecutive ranks of a pipeline stage (its data-, context- "
     "and tensor-parallel ranks), and --dp 2 x --cp 1 x --tp 1 is not a multiple of it"),
    (["moe.py", "--ep", "8", "--tp", "2"],
     "--ep 8: expert parallelism splits the experts over consecutive ranks of a pipeline stage (its data-, context- "
     "and tensor-parallel ranks), and any stage with --tp 2 that --gpus 4 leaves is not a multiple of it"),
    (["moe.py", "--ep", "4", "--pp", "2"],
     "--ep 4: expert parallelism splits the experts over consecutive ranks of a pipeline stage (its data-, context- "
     "and tensor-parallel ranks), and the 2 ranks of a stage that --pp 2 leaves is not a multiple of it"),
])
def test_bad_ep_is_refused_in_one_line(args, message, capsys):
    name, *flags = args
    code = main([str(EXAMPLES / name), "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_ep_spans_the_context_parallel_ranks_too(tmp_path):
    """EP with CP: an EP group is ep consecutive ranks of a stage, cp ranks included (each routes the
    tokens of its part of the sequence): ep 4 over dp 2 x cp 2 holds each expert once; ep 2 over each
    cp pair, twice (over dp), its gradients averaged over those replicas; the plan says so."""
    from planner.cost.setup import Candidate

    assert Candidate(tp=1, pp=1, dp=2, micro_batch=1, num_microbatches=4, zero=1, schedule="1f1b", cp=2, ep=4).expert_replicas == 1
    assert Candidate(tp=2, pp=1, dp=2, micro_batch=1, num_microbatches=4, zero=1, schedule="1f1b", cp=2, ep=2).expert_replicas == 4
    out = tmp_path / "plan.json"
    assert main([str(EXAMPLES / "moe.py"), "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--ep", "4",
                 "--cp", "2", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert (plan["parallel"]["cp"], plan["parallel"]["ep"], plan["parallel"]["dp"]) == (2, 4, 2)
    assert plan["predicted"]["breakdown_s"]["ep_comm"] > 0 and plan["predicted"]["breakdown_s"]["cp_comm"] > 0
    line = next(l for l in plan["explanation"] if l.startswith("Expert parallelism over 4 GPUs"))
    assert "No other GPU holds the same experts" in line and "context-parallel GPUs of a sequence routes its own part" in line


def test_search_picks_ep_for_a_large_moe_model(model_file, tmp_path):
    """Mixtral 8x7B's layers (4 of them) on 16 H100s: without EP every GPU holds (or gathers, under
    ZeRO-3) all 8 experts; with it, 1/ep of them, their tokens sent by all-to-all inside a node."""
    pytest.importorskip("transformers")
    path = model_file("""
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM
        CONFIG = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                               num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                               num_experts_per_tok=2, use_cache=False)
        def build_model():
            return MixtralForCausalLM(CONFIG)
        def sample_batch(n):
            ids = torch.randint(0, 32000, (n, 4097))
            return ids[:, :-1], ids[:, 1:]
    """)
    out = tmp_path / "plan.json"
    assert main([str(path), "--gpu", "h100-sxm-80gb", "--gpus", "16", "--global-batch", "64", "--memory-limit", "40",
                 "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["parallel"]["ep"] > 1
    assert any(line.startswith(f"Expert parallelism over {plan['parallel']['ep']} GPUs inside a node")
               for line in plan["explanation"])


def test_ep_on_traced_pipeline_stages_only_when_both_are_fixed(tmp_path):
    """A Hugging Face Mixtral is split into pipeline stages by the pipelining tracer, where the
    runtime does not run expert parallelism: the search leaves EP out there unless --ep and --pp
    are both given, and then the plan warns that plan run will refuse it."""
    pytest.importorskip("transformers")
    model = tmp_path / "hf_moe.py"
    model.write_text(TINY_MIXTRAL + (
        "def loss_fn(outputs, targets):\n"
        "    return torch.nn.functional.cross_entropy(outputs.logits.reshape(-1, 64), targets.reshape(-1))\n"))
    free, fixed = tmp_path / "free.json", tmp_path / "fixed.json"
    base = [str(model), "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--pp", "2", "--top", "20"]
    assert main([*base, "-o", str(free)]) == 0
    plan = json.loads(free.read_text())
    assert plan["parallel"]["ep"] == 1 and "ep=" not in " ".join(a["plan"] for a in plan["alternatives"])
    assert "expert parallelism on pipeline stages split by the tracer" in " ".join(plan["solver"]["skipped"])
    assert main([*base, "--ep", "2", "-o", str(fixed)]) == 0
    plan = json.loads(fixed.read_text())
    assert plan["parallel"]["ep"] == 2
    assert any("plan run does not run expert parallelism on pipeline stages" in w for w in plan["warnings"])


# --- expert parallelism with tensor parallelism (experts whole on each tp rank) ----------------

ATTENTION = 2 * DIM * DIM + 2 * DIM * 32  # q, o: 64 x 64; k, v: 64 x 32 (2 kv heads of 16)
EXPERT_PARAMS = EXPERTS * 3 * DIM * FFN  # gate, up, down of 8 SwiGLU experts
REPLICATED = EXPERTS * DIM + 2 * DIM  # the router (8 x 64) and the block's two RMSNorms


def test_the_profile_names_what_ep_leaves_whole(moe):
    """A MoE layer's TP split lists its experts' Linears (TP alone splits them); under EP they stay
    whole: the split keeps the attention's Linears, parameters and all-reduced bytes alone."""
    layer = next(l for l in moe.layers if l.moe_experts)
    assert layer.num_params == ATTENTION + EXPERT_PARAMS + REPLICATED
    tp = layer.tp
    assert tp.moe == ("mlp",) and "mlp.experts.0.gate_proj" in tp.colwise
    assert (tp.sharded_params, tp.moe_sharded_params) == (ATTENTION + EXPERT_PARAMS, EXPERT_PARAMS)
    ep = tp.under_ep()
    assert ep.colwise == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") and ep.rowwise == ("self_attn.o_proj",)
    assert ep.sharded_params == ATTENTION
    # all-reduced: o_proj's output alone, 4 sequences x 64 tokens x 64 bf16 values
    assert ep.allreduce_bytes == 4 * SEQ * DIM * 2
    role = layer.tp_role
    assert role.sp_blocker == "" and role.gathers == ("self_attn",)  # never the MoE block: it runs on the shard
    assert role.norms == ("input_layernorm", "post_attention_layernorm")
    assert moe.sp_blocker_at(2) == ""
    assert moe.sp_blocker.startswith("the mixture-of-experts block layers.0.mlp runs on the sequence shards only with "
                                     "expert parallelism (ep > 1)")


@pytest.mark.parametrize("ep, experts", [(2, EXPERT_PARAMS // 2), (4, EXPERT_PARAMS // 4)])
def test_ep_with_tp_divides_the_experts_by_ep_only(moe, ep, experts):
    """tp 2 with sequence parallelism: attention halves, the experts divide by ep (never also by
    tp), the router and norms stay whole: tp2 ep2 holds 6,144 + 98,304 + 640 parameters of a MoE
    layer (as tp2 alone, whose TP halves the experts instead), tp2 ep4 6,144 + 49,152 + 640."""
    cluster = make_cluster("h100-sxm-80gb", 8)
    training = Training("bf16", "adamw", 16, 80 * GIB)
    table = atom_table(moe, cluster, training, 2, 2, ep=ep)
    for atom in table:
        layer = moe.layers[atom.first]
        if not layer.moe_experts:
            continue
        assert atom.params == ATTENTION // 2 + experts + REPLICATED
        assert atom.expert_params == experts
    alone = atom_table(moe, cluster, training, 2, 2)  # tp 2 without EP: TP halves the experts
    moe_atom = next(a for a in alone if moe.layers[a.first].moe_experts)
    assert moe_atom.params == ATTENTION // 2 + EXPERT_PARAMS // 2 + REPLICATED and moe_atom.expert_params == 0


def test_ep_with_tp_sends_each_rank_s_own_tokens(moe):
    """With tp 2 (sequence parallel) each rank routes its 1/2 of the tokens: the all-to-alls move
    half the rows of tp 1's; the FLOPs and activations are those of tp 2 without EP."""
    cluster = make_cluster("h100-sxm-80gb", 4)
    training = Training("bf16", "adamw", 16, 80 * GIB)
    link = links(cluster, Candidate(2, 1, 2, 2, 1, 0, "1f1b", sequence_parallel=True, ep=2)).ep
    a2a = comm.all_to_all(2, link)
    table = atom_table(moe, cluster, training, 2, 2, ep=2)
    plain = atom_table(moe, cluster, training, 2, 2)
    for atom, without in zip(table, plain):
        layer = moe.layers[atom.first]
        rows = layer.moe_dispatch_bytes * 2 / moe.batch_size  # micro-batch 2
        assert atom.ep_comm_s == pytest.approx(4 * a2a(rows / 2) if layer.moe_experts else 0.0)
        assert atom.act_bytes == without.act_bytes


def test_the_ep_group_spans_the_tp_ranks(moe):
    """dp 2 x tp 2: an EP group is ep consecutive ranks, tp ranks included (Megatron-Core's MoE
    parallel folding, torchtitan's EP borrowing tp). ep 2 is each tp pair: every expert on the 2 dp
    ranks at its position, whose gradients are all-reduced (an owner's already sum both tp ranks'
    tokens: no tp all-reduce); ep 4 is all four ranks: one copy of each expert, nothing to reduce,
    and each GPU holds half the experts ep 2 leaves it. Both groups sit inside a node."""
    cluster = make_cluster("h100-sxm-80gb", 8)
    training = Training("bf16", "adamw", 16, 80 * GIB)
    two, four = (stage_costs(moe, cluster, training, Candidate(2, 1, 2, 2, 1, 0, "1f1b", sequence_parallel=True, ep=ep))
                 for ep in (2, 4))
    assert (two.cand.expert_replicas, four.cand.expert_replicas) == (2, 1)
    assert two.expert_grad_sync_per_byte_s == pytest.approx(comm.allreduce(2, two.links.expert_dp).per_byte_s)
    assert four.expert_grad_sync_per_byte_s == 0.0 and four.links.expert_dp is None
    assert four.atoms.param_totals[1] == pytest.approx(two.atoms.param_totals[1] / 2)
    assert not two.links.ep_spans_nodes and not four.links.ep_spans_nodes
    # on nodes of 2 GPUs the 4-rank group crosses the network; the 2-rank one stays in its node
    small = make_cluster("h100-sxm-80gb", 8, gpus_per_node=2)
    assert [stage_costs(moe, small, training, c.cand).links.ep_spans_nodes for c in (two, four)] == [False, True]


def test_plan_runs_ep_with_tp_under_sequence_parallelism(tmp_path):
    out = tmp_path / "plan.json"
    assert main([str(EXAMPLES / "moe.py"), "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--ep", "2",
                 "--tp", "2", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    p = plan["parallel"]
    assert (p["dp"], p["tp"], p["ep"], p["sequence_parallel"]) == (2, 2, 2, True)
    assert any("Tensor parallelism leaves the experts whole" in line for line in plan["explanation"])
    layer = next(l for l in plan["model"]["layers"] if l["name"] == "layers.0")
    assert layer["tp"]["moe"] == ["mlp"] and layer["role"]["sp_blocker"] == ""


def test_hugging_face_ep_with_tp_plans_sequence_parallelism(tmp_path):
    """A Hugging Face decoder layer takes the rotary tables and the mask beside its hidden states,
    computed from the embeddings' sequence length: sequence parallelism takes the shard at the first
    layer (TPRole.shard_at), so EP with TP plans, each tp rank routing its own tokens. Profiled in
    fp32 the model runs on real tensors (torch's meta _grouped_mm takes bf16 only); its TP roles are
    still found on fake ones, in bf16 (it trained as one process does on dp 2 x tp 2 x ep 2 when this
    was written)."""
    pytest.importorskip("transformers")
    model, out = tmp_path / "hf_moe.py", tmp_path / "plan.json"
    model.write_text(TINY_MIXTRAL)
    assert main([str(model), "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--ep", "2", "--tp", "2",
                 "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["parallel"]["sequence_parallel"] and plan["parallel"]["ep"] == 2
    assert {layer["role"]["shard_at"] for layer in plan["model"]["layers"]} == {"model.layers.0"}
    assert any("profiled on real tensors" in w for w in plan["warnings"])


def test_ep_with_tp_is_refused_where_sequence_parallelism_cannot_run(tmp_path, capsys):
    """A block holding parameters outside its Linear pair and norms cannot run sequence-parallel,
    so no EP with TP (every tp rank would route the same tokens): refused in one line, with why."""
    model = tmp_path / "scaled_moe.py"
    model.write_text(f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import torch
from moe import CONFIG, build_moe, sample_batch


class Scaled(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.inner, self.scale = block, torch.nn.Parameter(torch.ones(CONFIG.dim))

    def forward(self, x, *args):
        return self.inner(x, *args) * self.scale


def build_model():
    model = build_moe(CONFIG)
    model.layers = torch.nn.ModuleList(Scaled(b) for b in model.layers)
    return model
""")
    code = main([str(model), "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--ep", "2", "--tp", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--ep 2 with --tp 2 needs sequence parallelism" in err and "which cannot run on this model" in err
    assert "holds parameters and is neither a Linear of the column/row-wise pair nor a norm" in err


GROUPED_MOE = """
import torch, torch.nn as nn, torch.nn.functional as F
D, F_, E, K = 4096, 8192, 4, 2  # large enough that the GEMMs, not kernel launches, set the time
class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = Experts()
    def forward(self, x):
        h = x.reshape(-1, D)
        probs = F.softmax(self.gate(h), dim=-1)
        slot = torch.arange(h.shape[0] * K)
        token, expert = slot % h.shape[0], slot // (h.shape[0] * K // E)
        offs = (torch.arange(1, E + 1) * (h.shape[0] * K // E)).to(torch.int32)
        y = self.experts(h[token], offs) * probs[token, expert][:, None]
        return torch.zeros_like(h).index_add(0, token, y).reshape(x.shape)
class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, F_) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, F_, D) * 0.1)
    def forward(self, rows, offs):
        return torch._grouped_mm(F.silu(torch._grouped_mm(rows, self.w1, offs=offs)), self.w2, offs=offs)
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.moe = MoE()
        self.head = nn.Linear(D, 32)
    def forward(self, x):
        return self.head(self.moe(self.emb(x)))
def build_model():
    return M()
def sample_batch(n):
    ids = torch.randint(0, 32, (n, 1025))
    return ids[:, :-1], ids[:, 1:]
"""


def test_grouped_gemms_run_in_fp8_under_transformer_engine_only(model_file):
    """An expert layer's grouped GEMMs are recorded apart (forward: rows x D x F and rows x F x D,
    backward twice that); Transformer Engine's FP8 runs them at the FP8 rate (its GroupedLinear) and
    casts their routed rows, torchao's Float8Linear, which swaps nn.Linear only, leaves them in 16 bits."""
    profile = profile_model(load_model_file(model_file(GROUPED_MOE)), batch_size=4, dtype="bf16", measure=False)
    layer = next(l for l in profile.layers if l.moe_experts)
    rows = 4 * 1024 * 2
    assert layer.fwd_grouped_flops == 2 * (2 * rows * 4096 * 8192)
    assert layer.bwd_grouped_flops == 2 * layer.fwd_grouped_flops
    assert layer.fwd_grouped_operand_bytes == 2 * rows * (4096 + 8192)  # the routed rows and the activation, bf16
    assert layer.fwd_linear_flops == 2 * 4 * 1024 * 4096 * 4  # the router (the head is another layer)
    # their shapes, for the table of GEMM speeds: rows of the 4 groups, out n, in k (fc2, fc1)
    assert layer.grouped_gemms == ((rows, 4096, 8192, 4), (rows, 8192, 4096, 4))
    cluster = make_cluster("h100-sxm-80gb", 1)
    seconds = {}
    for recipe in ("torchao", "te"):
        training = Training("fp8", "adamw", 4, 80 * GIB, fp8_recipe=recipe)
        atoms = atom_table(profile, cluster, training, 1, 4)
        seconds[recipe] = next(a.fwd_s + a.bwd_s for a in atoms if profile.layers[a.first].moe_experts)
    bf16 = next(a.fwd_s + a.bwd_s for a in atom_table(profile, cluster, Training("bf16", "adamw", 4, 80 * GIB), 1, 4)
                if profile.layers[a.first].moe_experts)
    assert seconds["te"] < 0.8 * seconds["torchao"] and seconds["torchao"] >= bf16


def test_the_experts_replicas_use_the_ports_they_have():
    """dp 64 over 8 nodes of 8 with ep 8: an EP group fills a node, so the 8 ranks that hold the
    same experts are one per node, each averaging and sharding the experts' gradients through its
    own port (not the node's eight); with ep 2, four of them share a node and its four ports."""
    cluster = make_cluster("b200", 64)
    gpu = cluster.gpu
    eight = links(cluster, Candidate(1, 1, 64, 1, 1, 1, "1f1b", ep=8))
    assert eight.expert_dp.bandwidth_Bps == pytest.approx(gpu.inter_node_bandwidth_Bps)
    assert eight.dp.bandwidth_Bps == pytest.approx(8 * gpu.inter_node_bandwidth_Bps)
    two = links(cluster, Candidate(1, 1, 64, 1, 1, 1, "1f1b", ep=2))
    assert two.expert_dp.bandwidth_Bps == pytest.approx(4 * gpu.inter_node_bandwidth_Bps)
    assert links(cluster, Candidate(1, 1, 64, 1, 1, 1, "1f1b")).expert_dp is None
    # ZeRO-1 (DDP's all-reduce, then the updated shards gathered): over their 8 replicas, on that link
    moe_profile = profile_model(load_model_file(EXAMPLES / "moe.py"), batch_size=4, dtype="bf16", measure=False)
    costs = stage_costs(moe_profile, cluster, Training("bf16", "adamw", 256, 180 * GIB), Candidate(1, 1, 64, 4, 1, 1, "1f1b", ep=8))
    assert costs.expert_grad_sync_per_byte_s == pytest.approx(comm.allreduce(8, eight.expert_dp).per_byte_s)


@pytest.mark.parametrize("experts, top_k, nodes, limit, remote", [
    # 2 of 4 experts, 2 a node: both on the token's node (1/6), both on the other (1/6), one each (4/6)
    (4, 2, 2, None, 1 / 6 + 4 / 6),
    # k consecutive experts of one node (a router limited to 1): that node is another one 7 times in 8
    (256, 8, 8, 1, 7 / 8),
    # a limit of 1 cannot hold 4 experts of 2 a node: both nodes it needs are used
    (16, 4, 8, 1, 2 * 7 / 8),
    # inside one node nothing crosses the network
    (8, 2, 1, None, 0.0),
])
def test_remote_nodes_per_token(experts, top_k, nodes, limit, remote):
    from planner.cost.topology import remote_nodes_per_token

    assert remote_nodes_per_token(experts, top_k, nodes, limit) == pytest.approx(remote)


def test_deepep_sends_a_token_over_the_network_once_a_node(moe):
    """--ep-dispatch deepep, ep = 8 over 2 nodes of 4 (examples/moe.py: 8 experts, top 2): a rank
    sends each token over the network once to the other node if one of its experts is there
    (1 - C(4,2)/C(8,2) = 22/28 of them), while its rows for its own node's GPUs, and those that
    arrive for them, cross NVLink at the same time: the longer of the two.
    The plain all-to-all sends each row of an expert on the other node (1/2 of them) through the
    port, and 3/8 over NVLink, one after the other."""
    cluster = make_cluster("h100-sxm-80gb", 8, gpus_per_node=4)
    gpu, eff = cluster.gpu, comm.LINK_EFFICIENCY
    plain = atom_table(moe, cluster, Training("bf16", "adamw", 16, 80 * GIB), 1, 2, ep=8)
    deepep = atom_table(moe, cluster, Training("bf16", "adamw", 16, 80 * GIB, ep_dispatch="deepep"), 1, 2, ep=8)
    remote = 1 - 6 / 28  # the other node holds one of the token's 2 experts
    per_byte_deepep = max(remote / 2 / gpu.inter_node_bandwidth_Bps, 3 / 4 / gpu.intra_node_bandwidth_Bps) / eff
    per_byte_plain = (3 / 8 / gpu.intra_node_bandwidth_Bps + 4 / 8 / gpu.inter_node_bandwidth_Bps) / eff
    for a, b in zip(plain, deepep):
        layer = moe.layers[a.first]
        if not layer.moe_experts:
            assert b.ep_comm_s == a.ep_comm_s == 0.0
            continue
        rows = layer.moe_dispatch_bytes * 2 / moe.batch_size
        fixed = a.ep_comm_s / 4 - per_byte_plain * rows  # each all-to-all's startup, the same for both
        assert b.ep_comm_s == pytest.approx(4 * (fixed + per_byte_deepep * rows))
        assert b.ep_comm_s < a.ep_comm_s
    # inside one node DeepEP's is the plain all-to-all
    node = make_cluster("h100-sxm-80gb", 4)
    assert [a.ep_comm_s for a in atom_table(moe, node, Training("bf16", "adamw", 16, 80 * GIB), 1, 2, ep=4)] == \
        [a.ep_comm_s for a in atom_table(moe, node, Training("bf16", "adamw", 16, 80 * GIB, ep_dispatch="deepep"), 1, 2, ep=4)]
