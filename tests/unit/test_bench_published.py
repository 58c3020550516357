"""bench/bench_published.py (its pieces in bench/published/) reads the copy of the published runs
kept in the repository: every row becomes a model, a cluster and a fixed configuration, and a
small row is predicted."""

from pathlib import Path

import pytest

from bench.published.models import model_source
from bench.published.predict import Profiles, predict
from bench.published.rows import REFERENCE, inter_node_Bps, korthikanti_model_flops, load_rows, publication_month, publication_year

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows():
    return load_rows()


def test_reference_copy_is_in_the_repository():
    assert REFERENCE.is_relative_to(ROOT) and REFERENCE.exists()
    assert (REFERENCE.parent / "README.md").exists()


def test_every_row_has_a_model_a_cluster_and_a_configuration(rows):
    assert len(rows) == 60
    assert len({r.id for r in rows}) == 60
    for r in rows:
        source = model_source(r.shape)
        compile(source, r.id, "exec")
        assert "def build_model" in source and "def sample_batch" in source
        f = r.fixed
        assert f.tp * f.pp * f.dp * f.cp == r.num_gpus, r.id
        assert f.zero in (0, 1, 2, 3) and (f.dp * f.cp > 1 or f.zero == 0), r.id
        assert f.micro_batch is None or r.global_batch % (f.dp * f.micro_batch) == 0, r.id
        assert r.measured_step_s > 0, r.id
        cluster = r.cluster()
        assert cluster.num_gpus == r.num_gpus and cluster.gpus_per_node == r.gpus_per_node
        assert r.training().memory_limit_bytes == r.gpu.memory_bytes


def test_the_trainers_recompute_is_known(rows):
    """Megatron-LM, DeepSpeed and Composer (llm-foundry) checkpoint reentrantly, rerunning the whole
    forward; torchtitan's non-reentrant (or compiled) checkpoint stops at the last saved tensor."""
    stops = {r.source for r in rows if not r.training().recompute_whole_forward}
    assert stops == {"torchtitan"}


def test_llm_foundrys_attention_and_loss_are_its_own(rows):
    """llm-foundry's benchmark table ran MPT with FlashAttention in Triton (attn_impl "triton", for
    ALiBi) and flash-attn's fused cross-entropy, which keeps the 16-bit logits (2 bytes each) where
    F.cross_entropy on logits.float() keeps fp32 log-probabilities (4)."""
    kernels = {r.source: r.training().attention_kernel for r in rows}
    assert kernels["llm_foundry"] == "triton" and kernels["torchtitan"] == "sdpa" and kernels["megatron_lm"] == "te"
    mpt = next(r for r in rows if r.source == "llm_foundry")
    namespace: dict = {}
    exec(compile(model_source(mpt.shape), mpt.id, "exec"), namespace)
    torch = namespace["torch"]
    logits = torch.randn(6, 11, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 11, (6,))
    loss = namespace["loss_fn"](logits, targets)
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits.float(), targets).item(), rel=1e-3)
    loss.backward()
    expected = torch.softmax(logits.detach().float(), -1) - torch.nn.functional.one_hot(targets, 11)
    assert logits.grad.dtype == torch.bfloat16
    assert torch.allclose(logits.grad.float(), expected / 6, atol=1e-3)


def test_nemo_automodel_rows_are_priced_for_its_trainer_not_megatron():
    """NeMo AutoModel (NeMo's PyTorch backend) is not NeMo's Megatron one: its rows are priced for
    --trainer automodel (bf16 parameters and optimizer state: 2 + 2 + 4 bytes a parameter, the loss
    on the bf16 logits), the Megatron-Bridge and NeMo rows for megatron (an fp32 master copy: 2 + 2 + 12)."""
    rows = load_rows(REFERENCE.parent / "held_out_runs.yaml")
    trainers = {r.source: r.trainer for r in rows}
    assert trainers["automodel_moe"] == "automodel" and trainers["megatron_bridge"] == trainers["nemo"] == "megatron"
    auto = next(r for r in rows if r.source == "automodel_moe")
    bridge = next(r for r in rows if r.source == "megatron_bridge")
    assert auto.training().bytes_per_param() == (2, 2, 4) and bridge.training().bytes_per_param() == (2, 2, 12)
    # its benchmarks' loss runs on the bf16 logits (MaskedCrossEntropy, fp32_upcast false)
    assert not auto.training().loss_upcast and bridge.training().loss_upcast


def test_expert_dispatch_and_node_limited_routing_are_read_from_the_row():
    """DeepEP's dispatch where a row names it (NeMo AutoModel's "TE + DeepEP") or describes it
    (DeepSeek-V3's own kernels: "forwarded via NVLink"); the most nodes a token's experts span from
    Hugging Face's topk_group (DeepSeek-V3: 4) or AutoModel's fake balanced gate (k consecutive
    experts: 1); Megatron-Bridge's rows name neither (its alltoall dispatcher, routing forced even)."""
    rows = load_rows(REFERENCE.parent / "held_out_runs.yaml")
    routing = {r.id: (r.training().ep_dispatch, r.training().expert_node_limit) for r in rows if r.shape.experts}
    assert routing["deepseek_v3_2048gpu"] == ("deepep", 4)
    assert all(v == ("deepep", 1) for k, v in routing.items() if k.startswith("automodel"))
    assert all(v == ("all_to_all", None) for k, v in routing.items() if k.startswith("megatron_bridge"))


def test_a_gpt_with_grouped_query_attention_or_another_mlp_width_is_built_at_its_widths(tmp_path):
    """A row whose MLP is not gated (GELU: GPT, BLOOM, Falcon, StarCoder) keeps the GPT model file
    with its own key/value heads, head width and MLP width (not a Llama's SwiGLU of that width, not
    refused); its model FLOPs come from its parameters (PaLM's formula), not from Korthikanti's
    formula for GPT-3's widths."""
    import yaml

    entry = {"id": "falcon_like", "source": {"paper": "A 2023 report"},
             "model": {"arch": "Falcon (multi-query groups, GELU MLP)", "layers": 2, "hidden": 256, "heads": 8, "kv_heads": 2,
                       "head_dim": 64, "ffn_hidden": 768, "vocab": 512, "seq_len": 128, "params_b": 0.002},
             "hardware": {"gpu": "A100 80GB", "gpus": 8, "gpus_per_node": 8}, "precision": "bf16", "global_batch": 16,
             "micro_batch": 1, "parallel": {"tp": 2, "pp": 1, "dp": 4, "zero": 1, "recompute": "none"},
             "measured": {"tflops_per_gpu": 100, "tflops_kind": "model"}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry]}))
    (row,) = load_rows(path)
    assert row.shape.arch == "gpt" and row.measured_step_s == pytest.approx(
        (6 * 0.002e9 * 16 * 128 + 12 * 2 * 256 * 128 * 16 * 128) / (100e12 * 8))
    namespace: dict = {}
    exec(compile(model_source(row.shape), row.id, "exec"), namespace)
    model = namespace["build_model"]()
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert (attn.q.out_features, attn.k.out_features, attn.proj.in_features, mlp.up.out_features) == (8 * 64, 2 * 64, 8 * 64, 768)
    tokens, targets = namespace["sample_batch"](2)
    namespace["torch"].nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    assert attn.k.weight.grad is not None
    # a gated MLP said anywhere in the arch is a Llama's, whatever else the text names
    gated = {**entry, "id": "gated", "model": {**entry["model"], "arch": "Mistral-style (SwiGLU; a GELU in its vision tower)"}}
    path.write_text(yaml.safe_dump({"entries": [gated]}))
    assert load_rows(path)[0].shape.arch == "llama"


def test_the_trainers_fused_kernels_are_known(rows):
    """Megatron-LM's rows (every one of a publication that names it, Korthikanti et al.'s abstract
    rows too) and torch.compile'd torchtitan run fused memory-bound kernels; llm-foundry's
    Composer and torchtitan without compile run them op by op."""
    fused = {r.id for r in rows if r.training().fused_kernels}
    by_source = {s: {r.id for r in rows if r.source == s} for s in {r.source for r in rows}}
    for source in ("narayanan2021_t1", "narayanan2021_t2", "korthikanti2022", "megatron_lm"):
        assert by_source[source] <= fused, source
    assert not by_source["llm_foundry"] & fused
    assert "torchtitan_T1_8B_8gpu_0" not in fused and "torchtitan_T1_8B_8gpu_2" in fused


def test_torchtitan_compiles_its_loss_with_the_model_since_april_2025(rows):
    """torchtitan's loss builder compiles the loss under --compile since PR #1033 (April 2025):
    the Trainy H200 run (June 2025, compiled) keeps its logits in bf16; the December 2024 runs
    (compiled too) and every eager run keep fp32 log-probabilities."""
    compiled = {r.id for r in rows if r.training().compiled_loss}
    assert "torchtitan_trainy_h200_llama3_8b_32gpu" in compiled
    assert not {"torchtitan_T1_8B_8gpu_0", "torchtitan_T1_8B_8gpu_2"} & compiled
    assert {r.source for r in rows if r.id in compiled} == {"torchtitan"}


def test_torchtitan_runs_cudnns_attention_from_torch_2_11(rows, tmp_path):
    """torch's SDPA puts cuDNN first on Hopper from torch 2.11 (March 2026): torchtitan's rows of
    2024-2025 ran FlashAttention-2, a row of a later month (or of none: today's torchtitan) cuDNN's."""
    import yaml

    assert not any(r.training().sdpa_cudnn for r in rows)
    entry = next(e for e in yaml.safe_load(REFERENCE.read_text())["entries"] if e["id"] == "torchtitan_T1_8B_8gpu_0")
    later = {**entry, "id": "later", "source": {**entry["source"], "path": "benchmarks/llama3_h100_202605_torchtitan.md"}}
    undated = {**entry, "id": "undated", "source": {"repo": "pytorch/torchtitan", "path": "docs/performance.md"}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry, later, undated]}))
    assert [r.training().sdpa_cudnn for r in load_rows(path)] == [False, True, True]


@pytest.mark.parametrize("text, month", [
    ("benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, dec 2024)", (2024, 12)),
    ("llama3-8b_h200_202506_trainy-whitefiber.md (trainy on whitefiber, june 2025)", (2025, 6)),
    ("benchmarks/asynctp_llama3_h100_2025-06_torchtitan.md (torch 38410cf9)", (2025, 6)),
    ("blog post, 2025/03/30", (2025, 3)),
    ("pytorch/torchtitan docs/performance.md", None),
    ("commit 2025012345", None),
])
def test_a_rows_month_is_read_from_its_source_text(text, month):
    assert publication_month(text) == month


@pytest.mark.parametrize("source, year", [
    ({"paper": "Narayanan et al. 2021, Efficient Large-Scale ... (SC'21)", "where": "scripts removed 2024-10-28"}, 2021),
    ({"paper": "Korthikanti et al. 2022 (arXiv 2205.05198)"}, 2022),
    ({"repo": "NVIDIA/Megatron-LM", "path": "README.md (added 2024-07-15)"}, 2024),
    ({"repo": "NVIDIA-NeMo/Megatron-Bridge", "path": "docs/performance-summary.md"}, None),
])
def test_a_rows_year_is_its_papers_own(source, year):
    assert publication_year({"source": source}) == year


def test_megatron_rows_overlap_their_pipeline_sends_from_2023():
    """Megatron-LM's interleaved schedule overlaps its sends since Megatron-Core (2023): the
    README's H100 runs (2024) are predicted with it, SC'21's (2021) and Korthikanti et al.'s
    (2022) without; other trainers never."""
    rows = load_rows(REFERENCE)
    overlap = {r.source: r.training().p2p_overlap for r in rows}
    assert overlap["megatron_lm"] and not overlap["narayanan2021_t1"] and not overlap["korthikanti2022"]
    assert not overlap["torchtitan"] and not overlap["llm_foundry"]


def test_megatron_lms_own_runs_compute_the_loss_unfused_and_nemo_and_megatron_bridge_fused():
    """Megatron-LM's own runs (SC'21, Korthikanti et al., its README's table) and MT-NLG ran its
    vocabulary-parallel cross-entropy op by op; NeMo's and Megatron-Bridge's configurations turn the
    fusion on; other trainers' losses are as the profile traced them."""
    from planner.cost.constants import VOCAB_PARALLEL_CE_BYTES

    rows = load_rows(REFERENCE) + load_rows(REFERENCE.parent / "held_out_runs.yaml")
    loss = {r.source: r.training().loss_bytes_per_logit for r in rows}
    for source in ("narayanan2021_t1", "korthikanti2022", "megatron_lm", "smith2022"):
        assert loss[source] == VOCAB_PARALLEL_CE_BYTES, source
    for source in ("megatron_bridge", "nemo", "torchtitan", "llm_foundry", "fms_fsdp"):
        assert loss[source] is None, source


def test_fms_fsdps_checkpoint_stops_early_and_an_unnamed_trainers_reruns_the_whole_forward():
    """fms-fsdp wraps its blocks in a non-reentrant checkpoint (torch 2.1 on: early stop);
    llm-foundry's table ran torch 1.13, whose checkpoint reruns a layer's whole forward, as a
    trainer not named is taken to."""
    rows = load_rows(REFERENCE) + load_rows(REFERENCE.parent / "held_out_runs.yaml")
    whole = {r.source: r.training().recompute_whole_forward for r in rows}
    assert not whole["fms_fsdp"] and whole["llm_foundry"] and whole["le2022"]


def test_deepspeed_zero3_rows_gather_as_deepspeed_did_then(tmp_path):
    """SC'21's DeepSpeed ZeRO-3 runs (2021) gather parameter by parameter (DeepSpeed before v0.5);
    the same run published from 2022 module by module; every other row a layer at once."""
    import yaml

    rows = load_rows(REFERENCE)
    gathers = {r.id: r.training().zero3_gathers for r in rows}
    zero3 = {i for i in gathers if i.startswith("megatron_sc21_t2_zero3")}
    assert len(zero3) == 3 and {gathers[i] for i in zero3} == {"tensor"}
    assert {g for i, g in gathers.items() if i not in zero3} == {"layer"}
    entry = next(e for e in yaml.safe_load(REFERENCE.read_text())["entries"] if e["id"] in zero3)
    later = {**entry, "source": {"paper": "A later paper 2023", "where": "a table"}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [later]}))
    (row,) = load_rows(path)
    assert row.training().zero3_gathers == "module"


def test_a_rows_data_parallel_overlap_is_its_trainers():
    """What hides a row's data-parallel traffic is what its trainer did: Megatron-LM before
    --overlap-grad-reduce (SC'21, Korthikanti et al.) all-reduced the gradients after the
    backward, and so did DeepSpeed's pipeline engine (BLOOM); DeepSpeed's ZeRO-3 of 2021 synchronised
    the device at every gather: nothing hidden (0). Megatron with --overlap-grad-reduce: all of it
    (1). PyTorch's FSDP and DDP (torchtitan, llm-foundry, fms-fsdp): what their contention leaves (OVERLAP_CONTENTION:
    None). DeepSpeed's pipeline engine scatters what crosses a cut over the TP ranks, as
    Megatron-LM does; torch's pipelining does not."""
    overlap = {r.id: r.training().dp_overlap for r in load_rows(REFERENCE)}
    held = {r.id: r.training() for r in load_rows(REFERENCE.parent / "held_out_runs.yaml")}
    assert {overlap[i] for i in overlap if i.startswith(("megatron_sc21", "korthikanti"))} == {0.0}
    assert {overlap[i] for i in overlap if i.startswith("megatron_h100_weak")} == {1.0}
    assert {overlap[i] for i in overlap if i.startswith(("torchtitan", "llmfoundry"))} == {None}
    assert held["bloom_176b_384gpu"].dp_overlap == 0.0 and held["bloom_176b_384gpu"].p2p_scatter_gather
    assert held["mtnlg_530b_2240gpu"].dp_overlap == 0.0 and held["mtnlg_530b_2240gpu"].p2p_scatter_gather
    assert held["ibm_fsdp_llama2_70b_a100_128gpu"].dp_overlap is None
    assert not held["torchtitan_T5_405B_512gpu_13"].p2p_scatter_gather


def test_rows_whose_trainer_overlaps_the_expert_all_to_alls_are_predicted_with_it():
    """Megatron-Bridge's Qwen3 235B H100 runs (its perf config: moe_a2a_overlap) and DeepSeek-V3's
    DualPipe run the expert all-to-alls beside another micro-batch's compute (--ep-overlap);
    the same model's B200 runs (moe_a2a_overlap=False) and dense rows do not."""
    rows = {r.id: r for r in load_rows(REFERENCE.parent / "held_out_runs.yaml")}
    overlapped = {i for i, r in rows.items() if r.fixed.ep_overlap}
    assert overlapped == {"megatron_bridge_2511_qwen3_235b_h100_256gpu_fp8cs",
                          "megatron_bridge_2602_qwen3_235b_h100_256gpu_fp8cs", "deepseek_v3_2048gpu"}
    assert all(r.fixed.ep_overlap is None for r in rows.values() if r.fixed.ep is None)


def test_a_run_published_as_tflops_per_gpu_alone_is_read(tmp_path):
    """A run that gives only TFLOP/s per GPU is read, not refused: BLOOM's 150 hardware TFLOP/s
    (recompute counted, Narayanan et al.'s Eq. 3) give the step its paper derives (104.5 s); the same
    figure as model FLOPs gives a step 3/4 as long less the logits' share; a figure of no stated
    kind reads as model FLOPs from 2022 on, as hardware FLOPs before, with a note."""
    import yaml

    entries = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"]
    bloom = next(e for e in entries if e["id"] == "bloom_176b_384gpu")
    kinds = [bloom["measured"]["tflops_kind"], "model FLOPs", None]
    path = tmp_path / "runs.yaml"
    earlier = {**bloom, "id": "bloom_2021", "source": {"paper": "A 2021 paper"}, "derived": None, "measured": {"tflops_per_gpu": 150}}
    path.write_text(yaml.safe_dump({"entries": [
        {**bloom, "id": f"bloom_{i}", "derived": None, "measured": {"tflops_per_gpu": 150, "tflops_kind": kind}}
        for i, kind in enumerate(kinds)] + [earlier]}))
    hardware, model, unsaid, before_palm = load_rows(path)
    # before PaLM named model FLOPs (2022), a TFLOP/s figure counted the recompute
    assert before_palm.measured_step_s == hardware.measured_step_s and "read as hardware FLOPs" in before_palm.notes[-1]
    assert hardware.measured_step_s == pytest.approx(104.5, rel=1e-3)
    s, l, h, v = 2048, 70, 14336, 250880
    logits = v / (16 * l * h) / (1 + s / (6 * h) + v / (16 * l * h))  # the logits' share of Eq. 3
    assert model.measured_step_s == pytest.approx(hardware.measured_step_s * (0.75 * (1 - logits) + logits))
    assert unsaid.measured_step_s == model.measured_step_s
    assert "TFLOP/s of no stated kind read as model FLOPs" in unsaid.notes


def test_every_way_a_run_publishes_its_speed_gives_the_same_step(tmp_path):
    """Throughput in all (tokens/s, sequences/s, days per 300B tokens), all GPUs' PFLOP/s, and a
    utilisation (MFU or HFU, as a fraction or a percent) read as the same step as BLOOM's 150
    hardware TFLOP/s per GPU; a utilisation without `peak_used_tflops` is of the catalogue's 16-bit
    peak of the row's GPU (the A100's 312), with a note."""
    import yaml

    entries = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"]
    bloom = next(e for e in entries if e["id"] == "bloom_176b_384gpu")
    hardware = {"tflops_per_gpu": 150, "tflops_kind": bloom["measured"]["tflops_kind"]}
    ways = [hardware, {"aggregate_pflops": 150 * 384 / 1e3, "tflops_kind": "hardware"}, {"hfu": 150 / 312},
            {"hfu": 100 * 150 / 312, "peak_used_tflops": 312}]
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [
        {**bloom, "id": f"bloom_{i}", "derived": None, "measured": way} for i, way in enumerate(ways)]}))
    rows = load_rows(path)
    step = rows[0].measured_step_s
    assert [r.measured_step_s for r in rows] == pytest.approx([step] * len(ways))
    assert "hfu of the catalogue's 16-bit peak (312 TFLOP/s)" in rows[2].notes and not any("hfu" in n for n in rows[3].notes)
    gb, seq = bloom["global_batch"], bloom["model"]["seq_len"]
    mfu = korthikanti_model_flops(rows[0].shape, gb) / (step * 384) / 312e12  # the same run's model FLOPs
    others = [{"tokens_per_s": gb * seq / step}, {"samples_per_s": gb / step},
              {"training_days_300B_tokens": 300e9 / (gb * seq) * step / 86400}, {"mfu": mfu}, {"mfu": 100 * mfu}]
    path.write_text(yaml.safe_dump({"entries": [
        {**bloom, "id": f"bloom_{i}", "derived": None, "measured": way} for i, way in enumerate(others)]}))
    assert [r.measured_step_s for r in load_rows(path)] == pytest.approx([step] * len(others))


def test_torchtitans_interleaved_schedule_runs_two_stages_per_rank_unless_said(tmp_path):
    """torchtitan's interleaved 1F1B without split points runs two stages per rank (its
    generate_split_points default): a torchtitan row that does not say how many gets two; another
    trainer's is left to the search."""
    import yaml

    rows = yaml.safe_load(REFERENCE.read_text())["entries"]
    t5 = next(e for e in rows if e["id"] == "torchtitan_T5_405B_512gpu_12")
    bridge = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][1]  # pp 8
    for entry, want in ((t5, 2), (bridge, None)):
        entry = {**entry, "parallel": {**entry["parallel"], "interleaving": "Interleaved 1F1B"}}
        path = tmp_path / f"{entry['id']}.yaml"
        path.write_text(yaml.safe_dump({"entries": [entry]}))
        (row,) = load_rows(path)
        assert (row.fixed.schedule, row.fixed.virtual_stages) == ("interleaved", want), row.id



def test_torchtitans_pipeline_runs_one_micro_batch_per_stage_of_the_whole_pipeline(tmp_path):
    """torchtitan splits a rank's local batch into as many micro-batches as the pipeline has
    stages in all (build_pipeline_schedule: pp x stages per rank when not set): Table 5's local
    batch of 32 over 8 ranks is 8 micro-batches of 4 under 1F1B, and 16 of 2 under interleaved
    1F1B's two stages per rank (which its measured memory, 10 GiB under 1F1B's, bears out)."""
    import yaml

    rows = yaml.safe_load(REFERENCE.read_text())["entries"]
    t5 = next(e for e in rows if e["id"] == "torchtitan_T5_405B_512gpu_12")
    for schedule, micro in (("1F1B", 4), ("Interleaved 1F1B", 2), ("Interleaved 1F1B, 4 stages per rank", 1)):
        entry = {**t5, "parallel": {**t5["parallel"], "interleaving": schedule}}
        path = tmp_path / "t5.yaml"
        path.write_text(yaml.safe_dump({"entries": [entry]}))
        (row,) = load_rows(path)
        assert row.fixed.micro_batch == micro, schedule
        assert f"{32 // micro} pipeline micro-batches" in " ".join(row.assumed), row.assumed

def test_sources_come_from_the_source_fields(rows):
    by_source = {}
    for r in rows:
        by_source.setdefault(r.source, []).append(r.id)
    assert set(by_source) == {
        "narayanan2021_t1", "narayanan2021_t2", "korthikanti2022", "megatron_lm", "torchtitan", "llm_foundry",
    }
    assert all(i.startswith("megatron_sc21_t2") for i in by_source["narayanan2021_t2"])
    assert all(i.startswith("llmfoundry_") for i in by_source["llm_foundry"])


def test_models_and_approximations_follow_the_rows(rows):
    by_id = {r.id: r for r in rows}
    sc21 = by_id["megatron_sc21_t1_1.7B"]
    assert (sc21.shape.arch, sc21.shape.attention, sc21.precision, sc21.notes) == ("gpt", "materialised", "fp16", ())
    assert by_id["megatron_h100_weak_1.7B"].shape.attention == "flash"
    llama = by_id["torchtitan_T4_70B_256gpu_10"]
    assert (llama.shape.arch, llama.shape.kv_heads, llama.shape.ffn) == ("llama", 8, 28672)
    assert llama.fixed.zero == 3 and llama.precision == "fp8"
    # the 96 GB part: the 80 GB entry's usable memory (81,559 MiB) scaled to 96, its own HBM rate
    assert llama.gpu.memory_bytes == pytest.approx(81559 * 2**20 * 96 / 80, rel=1e-4) and llama.gpu.hbm_bandwidth_Bps == 2.4e12
    # its 500 W power limit (against the SXM's 700 W TDP): peaks x (500 / 700)^(1/3), named in the notes
    assert llama.gpu.peak("bf16") == pytest.approx(989.4e12 * (500 / 700) ** (1 / 3)) and any("500 W" in n for n in llama.notes)
    assert by_id["torchtitan_trainy_h200_llama3_8b_32gpu"].gpu.peak("bf16") == pytest.approx(989.4e12)  # no limit stated
    cp = by_id["torchtitan_T2_8B_8gpu_6"]
    assert (cp.fixed.cp, cp.fixed.tp) == (8, 1) and not any("CP" in n for n in cp.notes)  # as published
    assert by_id["llmfoundry_mpt7b_a100_40gb_8gpu_seq2048"].shape.arch == "mpt"
    assert by_id["korthikanti_530B_2240gpu_full_recompute"].assumed  # no global batch published


def test_inter_node_bandwidth_per_gpu():
    assert inter_node_Bps("RDMA backend network, 400 Gb/s per GPU", 8) == 50e9
    assert inter_node_Bps("8x 400 Gb/s NDR InfiniBand per node (DGX H100)", 8) == 50e9
    assert inter_node_Bps("1600 Gbps node-to-node RoCE per node (=200 Gb/s per GPU)", 8) == 25e9
    assert inter_node_Bps(None, 8) is None
    # as other clusters write it: NICs counted per node, terabits, bare InfiniBand generations
    assert inter_node_Bps("Slingshot-11, 4 x 200 Gb/s NICs per node", 8) == 12.5e9  # Frontier: 8 GCDs
    assert inter_node_Bps("3.2 Tbps EFA", 8) == inter_node_Bps("8x NDR400", 8) == inter_node_Bps("RoCE 400G per GPU", 8) == 50e9
    assert inter_node_Bps("4x HDR200 per node", 4) == inter_node_Bps("50 GB/s per node", 8) * 4 == 25e9
    assert inter_node_Bps("NVLink Switch System", 8) is None
    assert inter_node_Bps("8 InfiniBand adapters of 100 Gb/s per server", 16) == 6.25e9  # DGX-2H
    assert inter_node_Bps("8x 100 GbE RoCE", 8) == 12.5e9


def test_a_small_row_is_predicted(rows):
    row = next(r for r in rows if r.id == "megatron_sc21_t1_1.7B")
    result = predict(row, Profiles().get(row))
    assert result.scored is not None
    assert result.scored.cand.tp == 1 and result.scored.cand.dp == 32 and result.scored.cand.micro_batch == 16
    assert 0.5 < result.step_s / row.measured_step_s < 2
    assert 0 < result.peak_bytes < row.gpu.memory_bytes


def test_the_free_search_keeps_the_trainers_tp_overlap(rows):
    """The free search frees every choice but what the row's trainer can do: with Megatron-LM's TP
    overlap (which this runtime lacks, so a plain free search never turns it on) it finds a plan
    at least as fast as the published configuration it would otherwise miss."""
    row = next(r for r in rows if r.id == "megatron_h100_weak_177B")
    assert row.fixed.tp_overlap
    result = predict(row, Profiles().get(row), free=True)
    assert result.free.cand.tp_overlap and result.free.step_time_s <= result.step_s * 1.001


def test_the_free_search_of_a_96_block_gpt_finds_the_published_speed(rows):
    """GPT-3 177B (96 identical blocks) on 96 H100s, published tp 8 pp 6: the free search returned
    ZeRO-3 over 96 GPUs, 1.21x slower, once its time went on costing each block alone (their
    dropout modules' names told them apart) and its budget ran out before the pipelines were
    solved. It finds a plan at least as fast as the published one's prediction."""
    from planner.search.search import run_search
    from planner.search.space import Fixed

    row = next(r for r in rows if r.id == "megatron_h100_strong_gpt3_177B_96gpu")
    profile = Profiles().get(row)
    published = predict(row, profile)
    found = run_search(profile, row.cluster(), row.training(), Fixed(tp_overlap=row.fixed.tp_overlap), top_k=1)
    assert found.best.step_time_s <= published.step_s * 1.001, found.best.cand.label()


def test_held_out_runs_read_whole_and_an_unknown_gpu_is_named_not_fatal(tmp_path):
    """bench/reference/held_out_runs.yaml (runs no constant was fitted on) reads in full; in a file
    from elsewhere, an entry on a GPU the catalogue lacks is left out and named (bench_published
    --reference prints it), or raised when the caller asks for every row."""
    import yaml

    held_out = REFERENCE.parent / "held_out_runs.yaml"
    unread: list = []
    rows = load_rows(held_out, unread)
    assert rows and unread == [] and {r.gpu.name for r in rows} >= {"h100-sxm-80gb", "b200", "gb200", "gb300", "a100-80gb"}
    # a GB200 row gives the host (a 4-GPU compute tray); its NVLink domain is the rack's, in equal
    # parts of racks at 256 GPUs
    gb200 = next(r for r in rows if r.gpu.name == "gb200" and r.num_gpus == 256)
    assert gb200.cluster().gpus_per_node == 64
    entries = yaml.safe_load(held_out.read_text())["entries"][:2]
    entries[1] = {**entries[1], "id": "on_a_tpu", "hardware": {**entries[1]["hardware"], "gpu": "TPU v5p"}}
    entries.append({**entries[0], "id": "in_nvfp4", "precision": "NVFP4"})  # an H100: no FP4, never read as 16-bit
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(yaml.safe_dump({"entries": entries}))
    rows = load_rows(mixed, unread)
    assert [r.id for r in rows] == [entries[0]["id"]]
    assert [u[0] for u in unread] == ["on_a_tpu", "in_nvfp4"] and "TPU v5p" in unread[0][1] and "no fp4 peak" in unread[1][1]
    with pytest.raises(AssertionError, match="TPU v5p"):
        load_rows(mixed)


def test_the_dgxc_runs_read_whole():
    """bench/reference/dgxc_runs.yaml (NVIDIA's DGX Cloud recipes: NeMo and Megatron-Bridge on H100
    and GB200, none fitted on) reads in full, Llama 4 Maverick's expert layers every 2nd layer."""
    unread: list = []
    rows = load_rows(REFERENCE.parent / "dgxc_runs.yaml", unread)
    assert len(rows) == 273 and {r.gpu.name for r in rows} == {"h100-sxm-80gb", "gb200"} and unread == []
    assert all(r.shape.moe_every == 2 for r in rows if "maverick" in r.id)
    # the recipes' TP overlap where their configs set it (Llama 3.1 70B and 405B on H100), not elsewhere
    tp8 = [r for r in rows if "llama31_405b_h100" in r.id]
    assert tp8 and all(r.fixed.tp_overlap for r in tp8)
    assert not any(r.fixed.tp_overlap for r in rows if r.gpu.name == "gb200")


def test_a_configuration_the_planner_cannot_express_is_named_not_fatal(monkeypatch):
    """A row whose published configuration the planner refuses (BadInput: a combination it does
    not plan) is listed with the planner's reason and left out of the figures, not a crash of the
    whole bench; asked without the list, the refusal is raised."""
    from bench.published import predict as predict_module
    from planner.errors import BadInput

    rows = load_rows(REFERENCE)[:2]
    real = predict_module.predict

    def predict(row, profile, free=False):
        if row is rows[0]:
            raise BadInput("--ep 8 with --cp 2: not planned")
        return real(row, profile, free)

    monkeypatch.setattr(predict_module, "predict", predict)
    unexpressed: list = []
    results = predict_module.predict_all(rows, predict_module.Profiles(), unexpressed=unexpressed)
    assert [r.row.id for r in results] == [rows[1].id] and results[0].step_s > 0
    assert unexpressed == [(rows[0].id, "--ep 8 with --cp 2: not planned")]
    with pytest.raises(BadInput):
        predict_module.predict_all(rows[:1], predict_module.Profiles())


def test_reference_that_is_not_a_file_of_runs_is_one_line_and_exit_2(tmp_path, capsys):
    from bench.bench_published import main

    bad = tmp_path / "runs.yaml"
    bad.write_text("entries: [\n")
    for path in (bad, tmp_path / "missing.yaml"):
        with pytest.raises(SystemExit) as exit_:
            main(["--reference", str(path)])
        assert exit_.value.code == 2
        assert f"--reference {path}" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("field,text,expect", [
    ("zero", "ZeRO stage 2", {"zero": 2}),
    ("zero", "FSDP HYBRID_SHARD (shard in a node)", {"zero": 3, "hsdp": True}),
    ("zero", "FSDP SHARD_GRAD_OP", {"zero": 2}),
    ("zero", "none", {"zero": 0}),
    ("recompute", True, {"recompute": "full"}),
    ("recompute", "no", {"recompute": "none"}),
    ("recompute", "activation checkpointing of every layer", {"recompute": "full"}),
    ("recompute", "selective, attention core", {"recompute": "selective"}),
    ("interleaving", "interleaved 1F1B, 4 model chunks per GPU", {"schedule": "interleaved", "virtual_stages": 4}),
    ("interleaving", "GPipe", {"schedule": "gpipe"}),
    ("interleaving", "none (1F1B non-interleaved)", {"schedule": "1f1b"}),
    ("interleaving", "zero bubble (ZB-H1)", {"schedule": "1f1b", "note": "schedule 'zero bubble (ZB-H1)' as 1F1B"}),
    ("tp_comm_overlap", True, {"tp_overlap": True}),
    ("overlap", "--overlap-grad-reduce --tp-comm-overlap", {"tp_overlap": True}),
    ("overlap", "--overlap-grad-reduce", {"tp_overlap": None}),
])
def test_the_ways_a_file_of_runs_from_elsewhere_states_a_configuration(tmp_path, field, text, expect):
    """A reference file written by someone else says ZeRO stages, recompute, pipeline schedules and
    TP overlap in words of its own: each reads as the configuration it names (or is approximated,
    with a note), not as a row the bench cannot read."""
    import yaml

    entry = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][1]  # tp4 pp8 dp2
    entry = {**entry, "parallel": {**entry["parallel"], "overlap": None, field: text}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry]}))
    (row,) = load_rows(path)
    for key, want in expect.items():
        if key == "note":
            assert want in row.notes
        else:
            assert getattr(row.fixed, key) == want, key


def test_hsdp_said_beside_fsdp_is_read(tmp_path):
    """`hsdp: true` beside `zero: FSDP` (rather than in its text) reads as HSDP."""
    import yaml

    entry = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][1]
    entry = {**entry, "parallel": {**entry["parallel"], "zero": "FSDP", "hsdp": True}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry]}))
    (row,) = load_rows(path)
    assert (row.fixed.zero, row.fixed.hsdp) == (3, True)


@pytest.mark.parametrize("text, name", [
    ("H100-SXM5-80GB", "h100-sxm-80gb"), ("H100 80GB HBM3", "h100-sxm-80gb"), ("H100 PCIe 80GB", "h100-pcie-80gb"),
    ("H100 NVL 94GB", "h100-nvl-94gb"), ("A100-SXM4-80GB", "a100-80gb"), ("A100 PCIe 80GB", "a100-pcie-80gb"),
    ("A100-SXM4-40GB", "a100-40gb"), ("GB200 NVL72", "gb200"), ("B200 180GB", "b200"), ("H800 80GB", "h800"),
    ("8xH100 SXM5 80GB", "h100-sxm-80gb"), ("NVIDIA GH200 96GB", "gh200"), ("H20 96GB", "h20"), ("H200 141GB", "h200"),
    ("AMD Instinct MI250X (one GCD, 64GB)", "mi250x"), ("MI-300X", "mi300x"), ("RTX 4090 24GB", "rtx4090"),
])
def test_a_rows_gpu_is_the_catalogue_part_of_its_family_memory_and_form_factor(text, name):
    """A PCIe card or an H100 NVL is not read as the SXM part of the same memory (nor an NVL72 rack
    as an H100 NVL); a row that names neither is the SXM part."""
    from bench.published.rows import gpu_of
    from planner.hardware import load_catalogue

    spec, note = gpu_of({"gpu": text, "gpus_per_node": 8}, load_catalogue())
    assert (spec.name, note) == (name, None)


def test_a_global_batch_in_tokens_is_read_in_sequences_of_whole_micro_batches(tmp_path):
    """The schema's global_batch {tokens: N} is N / seq_len sequences; a batch that does not split
    into whole micro-batches on every data-parallel rank is rounded to the nearest that does, with
    a note (never read as one sequence per GPU, nor refused for it)."""
    import yaml

    entry = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][0]  # dp 8, mb 1, seq 8192
    exact = {**entry, "id": "exact", "global_batch": {"tokens": 128 * 8192}}
    rough = {**entry, "id": "rough", "global_batch": {"tokens": 1_000_000}}
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"entries": [exact, rough]}))
    by_id = {r.id: r for r in load_rows(path)}
    assert by_id["exact"].global_batch == 128 and isinstance(by_id["exact"].global_batch, int) and not by_id["exact"].notes
    assert by_id["rough"].global_batch == 120  # 122.07 sequences: 15 per rank of 8
    assert any("as 120: whole micro-batches" in n for n in by_id["rough"].notes)


def test_a_row_with_only_model_flops_gets_its_step_from_the_formula_of_its_kind(tmp_path):
    """Without a step time or tokens/s, the step comes from model TFLOP/s per GPU: Korthikanti et
    al.'s formula for GPT, PaLM's 6N + 12 l h s per token for other decoders (noted: sources count
    attention differently); a row with none of them is named, not read."""
    import yaml

    from bench.published.rows import palm_model_flops

    entry = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][0]  # Llama 3 8B, 8 GPUs
    flops = {**entry, "id": "flops", "measured": {"model_tflops_per_gpu": 744}}
    none = {**entry, "id": "none", "measured": {}}
    path = tmp_path / "flops.yaml"
    path.write_text(yaml.safe_dump({"entries": [flops, none]}))
    unread: list = []
    (row,) = load_rows(path, unread)
    assert row.measured_step_s == pytest.approx(palm_model_flops(row.shape, 8.0, 128) / (744e12 * 8))
    assert any("PaLM's formula" in n for n in row.notes)
    assert [u[0] for u in unread] == ["none"]


def test_a_mixture_of_experts_row_reads_its_experts_and_runs_them_as_grouped_gemms(tmp_path):
    """A row of a mixture-of-experts model (its experts, experts per token, expert width, head width
    and expert parallelism, in Megatron-LM's or Hugging Face's words) is built as one: a router and
    stacked experts that the profiler finds (planner/profile/moe.py), every expert given an equal
    share of the tokens x top-k rows (the benchmarks force-balance their routing), computed as a
    loop over the experts would."""
    from dataclasses import replace

    import torch

    from planner.profile.moe import find_moe

    rows = {r.id: r for r in load_rows(REFERENCE.parent / "held_out_runs.yaml")}
    qwen = rows["megatron_bridge_2511_qwen3_30b_a3b_gb300_8gpu"]
    assert (qwen.shape.experts, qwen.shape.top_k, qwen.shape.ffn, qwen.shape.head_dim, qwen.fixed.ep) == (128, 8, 768, 128, 8)
    assert rows["megatron_bridge_2511_llama3_8b_h100_8gpu"].shape.experts == 0
    # Megatron-Core's MoE parallel folding: EP 32 over TP 2 x DP 16, as the planner's EP spans the
    # tp and cp ranks too (no approximation); one larger than a pipeline stage is read as the stage's
    # dp x cp x tp, and said so
    folded = rows["megatron_bridge_2511_qwen3_235b_h100_256gpu_fp8cs"]
    assert (folded.fixed.tp, folded.fixed.dp, folded.fixed.ep) == (2, 16, 32) and not folded.notes
    import yaml

    entry = next(e for e in yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"]
                 if e["id"] == "megatron_bridge_2511_qwen3_235b_h100_256gpu_fp8cs")
    over_cp = {**entry, "id": "over_cp", "parallel": {**entry["parallel"], "tp": 1, "cp": 2, "ep": 32}}
    over_pp = {**entry, "id": "over_pp", "parallel": {**entry["parallel"], "tp": 1, "pp": 16, "dp": 16, "ep": 32}}
    path = tmp_path / "over_cp.yaml"
    path.write_text(yaml.safe_dump({"entries": [over_cp, over_pp]}))
    row, beyond = load_rows(path)
    assert (row.fixed.tp, row.fixed.cp, row.fixed.dp, row.fixed.ep) == (1, 2, 16, 32) and not row.notes
    assert (beyond.fixed.pp, beyond.fixed.dp, beyond.fixed.ep) == (16, 16, 16)
    assert "EP 32 as EP 16 over a stage's DP x CP x TP" in beyond.notes

    small = replace(qwen.shape, layers=1, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=48, experts=8, top_k=2,
                    vocab=128, seq_len=16)
    namespace: dict = {}
    exec(compile(model_source(small), "moe", "exec"), namespace)
    torch.manual_seed(0)
    model = namespace["build_model"]()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    (block,) = find_moe(model)
    assert block.stacked and block.num_experts == 8 and block.top_k == 2
    moe = model.get_submodule(block.name)
    assert model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)  # head width apart from hidden / heads
    assert sum(p.numel() for p in moe.experts.parameters()) == 8 * 3 * 64 * 48

    x = torch.randn(2, 16, 64)
    h = x.reshape(-1, 64)
    probs = torch.softmax(moe.gate(h), dim=-1)
    want = torch.zeros_like(h)
    share = h.shape[0] * 2 // 8
    for e in range(8):
        token = torch.arange(e * share, (e + 1) * share) % h.shape[0]
        gate, up = (h[token] @ moe.experts.w_fc1[e]).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ moe.experts.w_fc2[e]
        want.index_add_(0, token, y * probs[token, e : e + 1])
    out = moe(x)
    assert torch.allclose(out.reshape(-1, 64), want, atol=1e-5)
    (out * torch.randn_like(out)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.parameters())


def test_an_expert_model_is_never_read_as_a_dense_one(tmp_path):
    """Mixtral's name says 8 experts, top-2; DeepSeek-V3's fields (in a nested `moe` mapping or not)
    give its shared expert, its 3 dense first layers and its latent attention (DeepSeek-V3's ranks
    where a row names MLA without them, noted); expert layers every 2nd layer (Llama 4's
    interleave_moe_layer_step), the others dense of the row's ffn; experts without their top-k and
    expert parallelism on a dense model are left out and named."""
    import yaml

    entry = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][0]  # Llama 3 8B, dp 8
    model = {k: v for k, v in entry["model"].items() if k != "arch"}
    deepseek = {**model, "arch": "DeepSeek-V3 (MLA)", "moe": {"n_routed_experts": 64, "num_experts_per_tok": 6,
                "moe_intermediate_size": 1408, "n_shared_experts": 2, "first_k_dense_replace": 1}}
    entries = [
        {**entry, "id": "mixtral", "model": {**model, "arch": "Mixtral 8x7B"}, "parallel": {**entry["parallel"], "ep": 8}},
        {**entry, "id": "deepseek", "model": deepseek},
        {**entry, "id": "interleaved", "model": {**model, "num_experts": 16, "top_k": 1, "moe_layer_freq": 2}},
        {**entry, "id": "no_top_k", "model": {**model, "num_experts": 64}},
        {**entry, "id": "dense_ep", "parallel": {**entry["parallel"], "ep": 8}},
    ]
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({"entries": entries}))
    unread: list = []
    mixtral, deepseek, interleaved = load_rows(path, unread)
    assert (mixtral.shape.experts, mixtral.shape.top_k, mixtral.fixed.ep) == (8, 2, 8)
    s = deepseek.shape
    assert (s.experts, s.top_k, s.ffn, s.shared_ffn, s.dense_layers, s.dense_ffn) == (64, 6, 1408, 2 * 1408, 1, 14336)
    assert s.mla == (1536, 512, 128, 64, 128) and "latent attention's ranks and widths as DeepSeek-V3's" in deepseek.notes
    s = interleaved.shape
    assert (s.experts, s.top_k, s.moe_every, s.dense_layers, s.dense_ffn) == (16, 1, 2, 0, 14336)
    why = dict(unread)
    assert list(why) == ["no_top_k", "dense_ep"]
    assert "experts per token" in why["no_top_k"] and "dense model" in why["dense_ep"]
    # built as Llama 4 builds it: layers 1 and 3 of 4 hold the experts, 0 and 2 a dense MLP of ffn 14336 (here 96)
    from dataclasses import replace

    small = replace(s, layers=4, hidden=64, heads=4, kv_heads=4, ffn=32, dense_ffn=96, seq_len=16, vocab=128, head_dim=0)
    namespace: dict = {}
    exec(compile(model_source(small), "interleaved", "exec"), namespace)
    mlps = [type(layer.mlp).__name__ for layer in namespace["build_model"]().layers]
    assert mlps == ["FeedForward", "BalancedMoE", "FeedForward", "BalancedMoE"]


def test_deepseeks_layers_are_built_as_it_names_them():
    """The model file of a DeepSeek-style row: dense first layers, then routed experts beside a
    shared expert, and latent attention whose parameters are DeepSeek's (low-rank queries, one
    latent for keys and values, a shared rotary key); forward and backward run."""
    import torch

    from bench.published.rows import Shape
    from planner.profile.moe import find_moe

    shape = Shape(arch="llama", attention="flash", layers=3, hidden=64, heads=4, kv_heads=4, ffn=32, seq_len=16,
                  vocab=128, experts=8, top_k=2, shared_ffn=32, dense_layers=1, dense_ffn=96, mla=(48, 32, 16, 8, 16))
    namespace: dict = {}
    exec(compile(model_source(shape), "deepseek", "exec"), namespace)
    model = namespace["build_model"]()
    assert [b.name for b in find_moe(model)] == ["layers.1.mlp", "layers.2.mlp"]
    assert model.layers[0].mlp.down_proj.weight.shape == (64, 96)
    assert model.layers[1].mlp.shared.down_proj.weight.shape == (64, 32)
    attn = model.layers[0].self_attn
    h, (q_lora, kv_lora, nope, rope, v) = 4, shape.mla
    want = 64 * q_lora + q_lora + q_lora * h * (nope + rope) + 64 * (kv_lora + rope) + kv_lora + kv_lora * h * (nope + v) + h * v * 64
    assert sum(p.numel() for p in attn.parameters()) == want
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    out = model(torch.randint(0, 128, (2, 16)))
    assert out.shape == (2, 16, 128)
    (out * torch.randn_like(out)).sum().backward()
    assert attn.kv_b_proj.weight.grad.abs().sum() > 0 and model.layers[2].mlp.experts.w_fc2.grad.abs().sum() > 0


def test_a_row_without_its_node_size_or_data_parallel_degree_is_read(tmp_path):
    """A file of runs from elsewhere that leaves out gpus_per_node (the catalogue part's node, or its
    NVLink tray), dp (GPUs / (tp pp cp), the schema's definition) or the GPU count (tp pp dp cp)
    is read, not refused."""
    import yaml

    entry = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][1]  # tp4 pp8 dp2, 64 H100s
    hw = {k: v for k, v in entry["hardware"].items() if k != "gpus_per_node"}
    no_node = {**entry, "id": "no_node", "hardware": hw}
    no_dp = {**entry, "id": "no_dp", "parallel": {k: v for k, v in entry["parallel"].items() if k != "dp"}}
    no_count = {**entry, "id": "no_count", "hardware": {k: v for k, v in entry["hardware"].items() if k != "gpus"}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [no_node, no_dp, no_count]}))
    rows = {r.id: r for r in load_rows(path)}
    assert rows["no_node"].gpus_per_node == 8 and rows["no_node"].num_gpus == 64
    assert rows["no_dp"].fixed.dp == 2 and rows["no_count"].num_gpus == 64


def test_numbers_written_as_text_are_read_as_numbers(tmp_path):
    """A file of runs from elsewhere may write its figures as text ("1,536", "8"): they are read as
    the numbers they say, not refused or multiplied as strings."""
    import yaml

    entry = yaml.safe_load((REFERENCE.parent / "held_out_runs.yaml").read_text())["entries"][1]  # tp4 pp8 dp2, 64 H100s
    text = {**entry, "id": "text", "global_batch": "128", "micro_batch": "1",
            "model": {**entry["model"], "hidden": "8,192", "layers": "80"},
            "parallel": {**entry["parallel"], "tp": "4", "dp": "2"},
            "measured": {"tokens_per_s_per_gpu": "1,602"}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry, text]}))
    plain, texted = load_rows(path)
    assert (texted.shape, texted.fixed, texted.global_batch) == (plain.shape, plain.fixed, plain.global_batch)
    assert texted.measured_step_s == pytest.approx(plain.measured_step_s)


def test_a_free_plan_slower_than_the_published_one_says_why():
    """The free search ranks by step time plus each plan's margin (search.margin): a plan 1% slower
    without ZeRO-1 and with two chunks fewer beats one that must save 2% more (the bench says so);
    one that also scores worse would be a search that missed the faster plan, unless the published
    plan fits only without the allocator's fragmentation (which the search keeps)."""
    from dataclasses import dataclass

    from bench.published.predict import Result
    from bench.published.report import _simpler
    from planner.cost.setup import Candidate
    from planner.search.search import margin

    @dataclass
    class Plan:
        cand: Candidate
        step_time_s: float

        @property
        def score(self):
            return self.step_time_s * (1 + margin(self.cand))

    published = Plan(Candidate(4, 8, 8, 1, 32, 1, "interleaved", 4), 50.0)
    simpler = Plan(Candidate(8, 8, 4, 1, 64, 0, "interleaved", 2), 50.5)
    assert margin(published.cand) - margin(simpler.cand) == pytest.approx(0.02)
    row = object()
    r = Result(row, published, None, 0.0, free=simpler, free_s=1.0)
    assert "must save 2.0% more" in _simpler(r, r.free)
    r = Result(row, published, None, 0.0, free=Plan(simpler.cand, 52.0), free_s=1.0)
    assert "missed a faster plan" in _simpler(r, r.free)
    r = Result(row, published, None, 0.0, free=Plan(simpler.cand, 49.0), free_s=1.0)
    assert _simpler(r, r.free) == ""
    # a published plan that fits only without the allocator's fragmentation is no candidate of the search
    r = Result(row, published, None, 0.0, free=Plan(simpler.cand, 52.0), free_s=1.0, tight=True)
    assert "fits only without the allocator's fragmentation" in _simpler(r, r.free)


def test_the_lean_table_gives_each_gpu_and_trainer_its_signed_median(capsys):
    """bench_published's lean table: the signed median error per GPU type and trainer, which the
    |error| columns hide (here the A100 rows slow, the H100 ones fast); refused rows are left out."""
    from types import SimpleNamespace

    from bench.published.report import print_bias

    def result(gpu, trainer, error):
        return SimpleNamespace(error=error, row=SimpleNamespace(gpu=SimpleNamespace(name=gpu), trainer=trainer))

    print_bias([result("a100-80gb", "this", e) for e in (0.10, 0.20, 0.30)]
               + [result("h100-sxm-80gb", "this", e) for e in (-0.05, -0.15)] + [result("h100-sxm-80gb", "this", None)])
    lines = capsys.readouterr().out.splitlines()
    a100 = next(l for l in lines if l.startswith("a100-80gb")).split()
    h100 = next(l for l in lines if l.startswith("h100-sxm-80gb")).split()
    assert a100[1:] == ["this", "3", "+20.0%", "+30.0%", "+10.0%"]
    assert h100[1:] == ["this", "2", "-10.0%", "-5.0%", "-15.0%"]


def test_the_feature_table_puts_each_row_in_every_group_of_its_plan(capsys):
    """bench_published's feature table: a row counts in each feature of its predicted
    configuration (a TP x PP row in both), with the median |error|, the signed median and the
    error farthest from 0; refused rows are left out."""
    from types import SimpleNamespace

    from bench.published.report import print_features

    def result(error, tp=1, pp=1, zero=1, experts=0, precision="bf16", gpus=8):
        cand = SimpleNamespace(tp=tp, pp=pp, cp=1, ep=1, zero=zero, dp_replicate=1)
        row = SimpleNamespace(shape=SimpleNamespace(experts=experts), precision=precision, num_gpus=gpus,
                              cluster=lambda: SimpleNamespace(gpus_per_node=8))
        return SimpleNamespace(error=error, row=row, scored=SimpleNamespace(cand=cand) if error is not None else None)

    print_features([result(-0.20, tp=8, pp=4, gpus=64), result(0.10, tp=8), result(0.04, zero=3, precision="fp8"),
                    result(None, pp=2)])
    rows = {line[:22].strip(): line[22:].split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["dense"] == ["3", "10.0%", "+4.0%", "-20.0%"]
    assert rows["tensor parallel"] == ["2", "15.0%", "-5.0%", "-20.0%"]
    assert rows["pipeline"] == ["1", "20.0%", "-20.0%", "-20.0%"]
    assert rows["data parallel alone"] == rows["ZeRO-3 / FSDP"] == rows["FP8"] == ["1", "4.0%", "+4.0%", "+4.0%"]
    assert rows["one NVLink domain"] == ["2", "7.0%", "+7.0%", "+10.0%"]
    assert rows["across NVLink domains"] == ["1", "20.0%", "-20.0%", "-20.0%"]
    assert "mixture of experts" not in rows and "context parallel" not in rows
