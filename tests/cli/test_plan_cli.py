"""`plan MODEL.py --gpus N` as a user runs it: the choice, the JSON, the exit codes."""

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.errors import EXIT_BAD_INPUT, EXIT_INFEASIBLE
from tests.conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.py")


def _plan_json(capsys, *args) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _run_refuses(capsys, path: Path, args: list, said: str) -> None:
    """The plan `args` make, written to `path`, is refused by plan run in one line that says `said`."""
    assert main([*args, "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err


def test_small_model_gets_data_parallelism(capsys):
    plan = _plan_json(capsys, GPT, "--gpus", "8")
    par = plan["parallel"]
    assert (par["dp"], par["tp"], par["pp"], par["zero"]) == (8, 1, 1, 0)
    assert plan["schema"] == "planner.Plan" and plan["version"] == 2
    for key in ("dp", "tp", "pp", "micro_batch", "num_microbatches", "zero", "schedule", "recompute"):
        assert key in par
    for key in ("step_time_s", "samples_per_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes"):
        assert plan["predicted"][key] > 0
    stage = plan["stages"][0]
    assert set(stage["memory_bytes"]) == {"weights", "grads", "optimizer", "activations", "reserve", "total"}
    assert stage["memory_bytes"]["total"] <= plan["cluster"]["memory_limit_bytes"]
    assert plan["model"]["num_params"] > 0 and len(plan["model"]["source_sha256"]) == 64
    assert plan["solver"]["status"] == "optimal"
    # 6 heads: tensor parallelism over 4 or 8 GPUs was left out, and the plan says why
    assert plan["solver"]["skipped"].get("tp=4 does not divide the heads or features") == 1
    assert any("Data parallelism is enough" in line for line in plan["explanation"])
    # the default global batch: GPT-3's 0.5M tokens for a small model, 1,953 sequences of 256,
    # rounded to 8 GPUs x a power of two; the micro-batch searched
    assert plan["training"]["global_batch"] == 2048 == 8 * par["micro_batch"] * par["num_microbatches"]
    assert any("0.5M tokens per step" in a for a in plan["assumptions"])


def test_user_configuration_is_evaluated_as_given(capsys):
    plan = _plan_json(
        capsys, GPT, "--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1",
        "--schedule", "gpipe", "--recompute", "full", "--micro-batch", "4", "--global-batch", "64",
    )
    par = plan["parallel"]
    assert (par["dp"], par["tp"], par["pp"], par["zero"], par["schedule"], par["recompute"]) == (2, 2, 2, 1, "gpipe", "full")
    assert (par["micro_batch"], par["num_microbatches"]) == (4, 8)
    layers = [name for st in plan["stages"] for name in st["layers"]]
    assert layers == plan["model"]["layer_names"]  # every layer once, in order, over the stages
    assert all(set(st["recompute_layers"]) == set(st["layers"]) for st in plan["stages"])


def test_70b_on_64_gpus_gets_a_split_that_fits(capsys):
    plan = _plan_json(capsys, str(EXAMPLES / "llama_70b.py"), "--gpus", "64", "--gpu", "a100-80gb")
    par = plan["parallel"]
    assert par["dp"] * par["tp"] * par["pp"] * par["cp"] == 64
    assert par["tp"] > 1 or par["pp"] > 1 or par["zero"] == 3  # a replica cannot fit
    limit = plan["cluster"]["memory_limit_bytes"]
    assert all(st["memory_bytes"]["total"] <= limit for st in plan["stages"])
    assert plan["data_parallel"]["fits"] is False


def test_70b_on_8_gpus_does_not_fit(capsys):
    code = main([str(EXAMPLES / "llama_70b.py"), "--gpus", "8", "--gpu", "a100-80gb"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_INFEASIBLE
    assert len(err.splitlines()) == 1
    assert "1.10 TB" in err and "687.19 GB" in err  # the state against the cluster's memory (8 x 81,920 MiB)
    assert "needs" in err and "16 GPUs of this type" in err


def test_175b_on_8_gpus_does_not_fit(capsys, model_file, monkeypatch):
    path = model_file(
        """
        from gpt import GPTConfig, build_gpt, gpt_batch
        CFG = GPTConfig(vocab=51200, seq_len=2048, n_layer=96, n_head=96, n_embd=12288)
        def build_model():
            return build_gpt(CFG)
        def sample_batch(b):
            return gpt_batch(CFG, b)
        """
    )
    import planner.planning as planning

    searched = []
    search = planning.search

    def counting(profile, request, cluster):
        searched.append((request.gpus, request.gpu, request.optimizer))
        return search(profile, request, cluster)

    monkeypatch.setattr(planning, "search", counting)
    code = main([str(path), "--gpus", "8"])
    err = capsys.readouterr().err
    assert code == EXIT_INFEASIBLE
    assert "nothing fits" in err and "64 GPUs of this type" in err
    # after the request's own search, the fixes are searched only where all the GPUs' memory can hold
    # the training state (2.80 TB): not on 16 or 32 H100s, nor on 8 of any larger GPU (at most 288 GB
    # each), nor with SGD's (2.10 TB)
    assert searched == [(8, "h100-sxm-80gb", "adamw"), (64, "h100-sxm-80gb", "adamw")], searched


def test_nothing_fits_with_the_users_choices_names_them_and_keeps_them_in_the_other_fixes(capsys, monkeypatch):
    """Where the fixed choices alone keep a plan from fitting, the error names the flags the user
    gave, and the GPU counts and optimizer it tries besides keep those flags (none fits here); a
    GPU with more memory is not offered while the user's --memory-limit is what binds."""
    import planner.planning as planning

    args = [str(EXAMPLES / "gpt.py"), "--gpus", "8", "--memory-limit", "2"]
    assert main(args) == 0  # the search fits it, at a micro-batch of its choosing
    capsys.readouterr()
    searched = []
    search = planning.search

    def counting(profile, request, cluster):
        searched.append((request.gpus, request.gpu, request.optimizer, request.fixed.micro_batch))
        return search(profile, request, cluster)

    monkeypatch.setattr(planning, "search", counting)
    code = main(args + ["--micro-batch", "256"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_INFEASIBLE and len(err.splitlines()) == 1
    assert err.endswith("Smallest changes that fit: drop --micro-batch 256."), err
    first, dropped, *others = searched
    assert first[3] == 256 and dropped[3] is None and others
    assert all(s[3] == 256 and s[1] == "h100-sxm-80gb" for s in others), others
    assert {s[0] for s in others} > {16, 32} and ("sgd" in {s[2] for s in others})


def test_output_file_is_never_overwritten(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main([GPT, "--gpus", "2", "-o", str(out)]) == 0
    first = out.read_text()
    assert json.loads(first)["parallel"]["dp"] == 2
    assert main([GPT, "--gpus", "2", "-o", str(out)]) == EXIT_BAD_INPUT
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == first
    assert main([GPT, "--gpus", "2", "-o", str(out), "--force"]) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "8", "--tp", "3"], "does not divide --gpus 8"),
        (["--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "1"], "not --gpus 8"),
        (["--gpus", "8", "--gpu", "h100"], "did you mean"),
        (["--gpus", "0"], "at least 1"),
        (["--gpus", "8", "--zero", "2", "--dp", "1"], "--dp is 1"),
        (["--gpus", "8", "--schedule", "gpipe", "--virtual-stages", "2"], "needs --schedule interleaved"),
        (["--gpus", "8", "--memory-limit", "-1"], "--memory-limit must be positive"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, args, message):
    assert main([GPT, *args]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_plan_then_run_on_cpu(capsys, tmp_path):
    """`plan MODEL.py --gpu cpu --gpus N --run`: plans, prints the plan, executes it, reports."""
    out = tmp_path / "plan.json"
    code = main([GPT, "--gpu", "cpu", "--gpus", "2", "--global-batch", "4", "--run", "--steps", "2", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "Plan for gpt" in printed and "measured / predicted" in printed
    report = json.loads((tmp_path / "plan.run.json").read_text())
    assert report["schema"] == "planner.RunReport"
    assert len(report["measured"]["losses"]) == 2 and report["measured"]["step_time_s"] > 0


def test_run_checkpoint_flags_need_a_directory(capsys, tmp_path):
    """`plan run` refuses --checkpoint-every / --resume without --checkpoint-dir, before anything starts."""
    out = tmp_path / "plan.json"
    assert main([GPT, "--gpu", "cpu", "--gpus", "2", "--global-batch", "4", "-o", str(out)]) == 0
    capsys.readouterr()
    for flags, message in ((["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
                           (["--resume"], "--resume needs --checkpoint-dir")):
        assert main(["run", str(out), *flags]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "plan.run.json").exists()


def test_inter_node_network_is_the_users(capsys):
    """--inter-node-gbps sets the network between nodes: stated in the plan, and a slower network
    never predicts a faster step for the same configuration."""
    args = [str(EXAMPLES / "llama.py"), "--gpus", "16", "--gpus-per-node", "8", "--global-batch", "64", "--zero", "3", "--dp", "16"]
    slow, fast = (_plan_json(capsys, *args, "--inter-node-gbps", str(g)) for g in (25, 400))
    assert any("(25 Gb/s) across nodes per GPU (--inter-node-gbps)" in a for a in slow["assumptions"])
    assert slow["predicted"]["step_time_s"] > fast["predicted"]["step_time_s"]
    assert main([*args, "--inter-node-gbps", "-1"]) == EXIT_BAD_INPUT
    assert "--inter-node-gbps must be positive" in capsys.readouterr().err


def test_sequence_parallelism_is_a_choice(capsys):
    """--sequence-parallel on|off fixes it (searched otherwise); the plan says which, and without
    it each GPU holds more activations for the same split."""
    args = [str(EXAMPLES / "llama.py"), "--gpus", "2", "--tp", "2", "--global-batch", "32", "--micro-batch", "16"]
    on, off = (_plan_json(capsys, *args, "--sequence-parallel", v) for v in ("on", "off"))
    assert on["parallel"]["sequence_parallel"] is True and off["parallel"]["sequence_parallel"] is False
    assert off["stages"][0]["memory_bytes"]["activations"] > on["stages"][0]["memory_bytes"]["activations"]
    assert any("without sequence parallelism" in line for line in off["explanation"])
    free = _plan_json(capsys, *args)
    assert free["parallel"]["sequence_parallel"] in (True, False)
    assert main([*args, "--sequence-parallel", "maybe"]) == EXIT_BAD_INPUT
    capsys.readouterr()


SP_BLOCKED = """
import torch
from gpt import GPT, Block, GPTConfig, gpt_batch

CFG = GPTConfig(vocab=512, seq_len=256, n_layer=4, n_head=4, n_embd=256)


class GatedBlock(Block):
    def forward(self, x, gate):
        return super().forward(x) * gate


class Gated(GPT):
    # every block also takes a per-position gate of the whole sequence: it meets the shard
    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.blocks:
            block.__class__ = GatedBlock

    def forward(self, idx):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        gate = (idx % 2).unsqueeze(-1).to(x.dtype)  # from the whole sequence's tokens, not the shard's
        for block in self.blocks:
            x = block(x, gate)
        return self.lm_head(self.ln_f(x))


def build_model():
    return Gated(CFG)


def sample_batch(batch_size):
    return gpt_batch(CFG, batch_size)
"""


def test_sequence_parallelism_only_where_the_model_runs_it(capsys, model_file):
    """What the runtime can split comes from the profile (its TP roles, which the plan carries):
    where a model cannot run sequence parallelism the search never chooses it and says why, and
    --sequence-parallel on is one line, exit 2."""
    path = str(model_file(SP_BLOCKED))
    args = [path, "--gpus", "2", "--tp", "2", "--global-batch", "8"]
    plan = _plan_json(capsys, *args)
    assert plan["parallel"]["sequence_parallel"] is False
    assert any("without sequence parallelism" in line and "this model cannot run it" in line for line in plan["explanation"])
    roles = [layer["role"] for layer in plan["model"]["layers"]]
    assert all(r["sp_blocker"] == roles[0]["sp_blocker"] != "" for r in roles)
    assert main([*args, "--sequence-parallel", "on"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sequence-parallel on: sequence parallelism cannot run on this model: the model "
                          "does not run on sequence shards (in blocks.0 (GatedBlock): RuntimeError: ") and "\n" not in err, err
    gpt = _plan_json(capsys, GPT, "--gpus", "2", "--tp", "2", "--global-batch", "8", "--sequence-parallel", "on")
    assert gpt["parallel"]["sequence_parallel"] is True  # examples/gpt.py runs it


def test_fp8_is_planned_where_the_gpu_has_fp8_and_refused_elsewhere(capsys, tmp_path):
    """A 7B model's 4096-wide GEMMs gain from FP8 more than their casts cost."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--global-batch", "64", "--dp", "8", "--micro-batch", "1", "--zero", "1"]
    bf16, fp8 = (_plan_json(capsys, *args, "--precision", p) for p in ("bf16", "fp8"))
    assert fp8["training"]["precision"] == "fp8"
    assert fp8["predicted"]["step_time_s"] < bf16["predicted"]["step_time_s"]
    assert any("for the FP8 Linear matmuls" in a for a in fp8["assumptions"])
    assert main([*args, "--precision", "fp8", "--gpu", "a100-80gb"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "--precision fp8: a100-80gb" in err and "no FP8 matmul peak" in err and "\n" not in err
    # the runtime runs FP8 on CUDA GPUs with FP8 tensor cores: here, none: one line before anything is launched
    out = tmp_path / "fp8.json"
    assert main([*args, "--precision", "fp8", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(out)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "FP8 training runs on CUDA GPUs with FP8 tensor cores" in err and "--precision bf16" in err and "\n" not in err


def test_nvfp4_is_planned_for_transformer_engine_on_blackwell_and_refused_elsewhere(capsys, tmp_path):
    """--precision fp4 plans NVFP4 Linears where the GPU has FP4 tensor cores and the trainer is
    Transformer Engine's (--trainer megatron): faster than FP8 on a GB200 for a 7B model; on an
    H100, or for another trainer, one line and exit 2; plan run refuses it in one line."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--gpu", "gb200", "--global-batch", "64", "--dp", "8",
            "--micro-batch", "1", "--zero", "1", "--trainer", "megatron"]
    fp8, fp4 = (_plan_json(capsys, *args, "--precision", p) for p in ("fp8", "fp4"))
    assert fp4["training"]["precision"] == "fp4"
    assert fp4["predicted"]["step_time_s"] < fp8["predicted"]["step_time_s"]
    assert any("for the FP4 Linear matmuls" in a for a in fp4["assumptions"])
    for bad, said in ((["--gpu", "h100-sxm-80gb"], "no FP4 matmul peak"), (["--trainer", "torchtitan"], "--trainer megatron")):
        assert main([*args, "--precision", "fp4", *bad]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip()
        assert "--precision fp4" in err and said in err and "\n" not in err
    _run_refuses(capsys, tmp_path / "fp4.json", [*args, "--precision", "fp4"], "NVFP4 training")


def test_tp_overlap_is_planned_when_asked_and_refused_by_the_runtime(capsys, tmp_path):
    """--tp-overlap on plans for a trainer that hides TP collectives behind the GEMMs: faster than
    the same plan without, stated in the plan, refused by plan run in one line; with SP off, exit 2."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--global-batch", "64", "--tp", "8", "--micro-batch", "1"]
    plain, over = (_plan_json(capsys, *args, "--tp-overlap", v) for v in ("off", "on"))
    assert over["parallel"]["tp_overlap"] is True and plain["parallel"]["tp_overlap"] is False
    assert over["predicted"]["breakdown_s"]["tp_comm"] < plain["predicted"]["breakdown_s"]["tp_comm"]
    assert over["predicted"]["step_time_s"] < plain["predicted"]["step_time_s"]
    assert any("beside the GEMMs: what they do not hide" in line for line in over["explanation"])
    free = _plan_json(capsys, str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--global-batch", "64", "--tp", "8")
    assert free["parallel"]["tp_overlap"] is False  # never offered unasked: the runtime cannot run it
    assert main([*args, "--tp-overlap", "on", "--sequence-parallel", "off"]) == EXIT_BAD_INPUT
    assert "needs --sequence-parallel on" in capsys.readouterr().err
    _run_refuses(capsys, tmp_path / "over.json", [*args, "--tp-overlap", "on"], "overlaps TP collectives")


def test_ep_overlap_is_planned_when_asked_and_refused_by_the_runtime(capsys, tmp_path):
    """--ep-overlap on plans for a trainer that runs the expert all-to-alls beside another
    micro-batch's compute: less EP time than the same plan without, stated in the plan, never
    offered unasked, refused by plan run in one line; with full recompute, exit 2."""
    args = [str(EXAMPLES / "moe.py"), "--gpus", "4", "--gpus-per-node", "1", "--global-batch", "16", "--ep", "4",
            "--micro-batch", "1"]
    plain, over = (_plan_json(capsys, *args, "--ep-overlap", v) for v in ("off", "on"))
    assert over["parallel"]["ep_overlap"] is True and plain["parallel"]["ep_overlap"] is False
    assert over["predicted"]["breakdown_s"]["ep_comm"] < plain["predicted"]["breakdown_s"]["ep_comm"]
    assert any("beside another micro-batch's compute" in line for line in over["explanation"])
    assert _plan_json(capsys, *args)["parallel"]["ep_overlap"] is False
    # one micro-batch a step: no other to pair with, and the plan says so
    single = _plan_json(capsys, *args[:-2], "--micro-batch", "4", "--ep-overlap", "on")
    assert single["parallel"]["ep_overlap"] is False
    assert any("no other to pair it with" in w for w in single["warnings"])
    assert main([*args, "--ep-overlap", "on", "--recompute", "full"]) == EXIT_BAD_INPUT
    assert "--ep-overlap on pairs each layer's forward" in capsys.readouterr().err
    _run_refuses(capsys, tmp_path / "over.json", [*args, "--ep-overlap", "on"],
                 "expert all-to-alls beside another micro-batch's compute")


def test_deepep_dispatch_and_a_node_limit_are_planned_and_stated(capsys, tmp_path):
    """--ep-dispatch deepep (NeMo AutoModel's by default) prices the expert all-to-alls across nodes
    as DeepEP sends them: less than the plain all-to-all's, less again when a token's experts come
    from one node (--expert-node-limit 1); the plan records and states both, and plan run says it
    sends the tokens its own way."""
    from planner.plan import Plan
    from runtime.layout import runtime_warnings

    args = [str(EXAMPLES / "moe.py"), "--gpus", "4", "--gpus-per-node", "2", "--global-batch", "16", "--ep", "4",
            "--micro-batch", "1"]
    plain = _plan_json(capsys, *args)
    deepep = _plan_json(capsys, *args, "--ep-dispatch", "deepep")
    one = _plan_json(capsys, *args, "--ep-dispatch", "deepep", "--expert-node-limit", "1")
    ep = [p["predicted"]["breakdown_s"]["ep_comm"] for p in (plain, deepep, one)]
    assert ep[0] > ep[1] > ep[2] > 0
    assert (plain["training"]["ep_dispatch"], deepep["training"]["ep_dispatch"]) == ("all_to_all", "deepep")
    assert (deepep["training"]["expert_node_limit"], one["training"]["expert_node_limit"]) == (None, 1)
    assert any("as DeepEP sends them" in line for line in deepep["assumptions"])
    assert any("at most 1 node(s)" in line for line in one["assumptions"])
    assert _plan_json(capsys, *args, "--trainer", "automodel")["training"]["ep_dispatch"] == "deepep"
    out = tmp_path / "deepep.json"
    assert main([*args, "--ep-dispatch", "deepep", "-o", str(out)]) == 0
    assert any("all_to_all_single" in w for w in runtime_warnings(Plan.load(out), ()))
    assert main([*args, "--expert-node-limit", "0"]) == EXIT_BAD_INPUT
    assert "--expert-node-limit" in capsys.readouterr().err


def test_hsdp_shards_inside_nodes_when_asked(capsys):
    """--hsdp on: ZeRO-3 over 16 GPUs in 2 nodes as 2 replicas of 8 shards, state sharded over 8,
    said in the plan; with ZeRO-1, exit 2."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "16", "--global-batch", "64", "--dp", "16", "--zero", "3"]
    flat, hsdp = (_plan_json(capsys, *args, "--hsdp", v) for v in ("off", "on"))
    assert flat["parallel"]["dp_replicate"] == 1 and hsdp["parallel"]["dp_replicate"] == 2
    assert hsdp["stages"][0]["memory_bytes"]["optimizer"] == pytest.approx(2 * flat["stages"][0]["memory_bytes"]["optimizer"], rel=1e-6)
    assert any("as HSDP" in line for line in hsdp["explanation"])
    assert main([*args[:-2], "--zero", "1", "--hsdp", "on"]) == EXIT_BAD_INPUT
    assert "--hsdp on shards with FSDP" in capsys.readouterr().err


NANOGPT = Path(__file__).parents[1] / "nanogpt_model.py"


def test_tp_with_pp_on_a_traced_model_cuts_where_the_layers_run_in_sequence(capsys):
    """A GPT written as nanoGPT is (token and position embeddings summed in forward) needs the
    pipelining tracer for a cut before its first block, and the runtime applies TP only to stages
    it splits without it: with --tp 2 --pp 2 the first stage ends at a block or later (the run
    itself: tests/distributed/test_parity.py, pp_dp_tp_nanogpt); 7 stages need more such cuts
    (6) than the model has (5): one line, exit 2."""
    base = [str(NANOGPT), "--gpu", "cpu", "--gpus", "8", "--global-batch", "8"]
    plan = _plan_json(capsys, *base, "--pp", "2", "--tp", "2", "--dp", "2")
    first_block = plan["model"]["layer_names"].index("h.0")
    assert plan["model"]["layer_names"].index(plan["stages"][0]["chunks"][0][-1]) >= first_block
    assert main([str(NANOGPT), "--gpu", "cpu", "--gpus", "28", "--global-batch", "8", "--pp", "7", "--tp", "2",
                 "--dp", "2", "--micro-batch", "1"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "a plain sequence of its layers only after h.0" in err and "fix --tp 1 or fewer stages" in err and "\n" not in err


def test_plan_run_refuses_tp_on_traced_stages_before_launch(capsys, tmp_path):
    """A plan edited by hand so that TP meets a cut only the tracer can make: plan run says why in
    one line, and launches nothing (no run folder)."""
    out = tmp_path / "pp.json"
    assert main([str(NANOGPT), "--gpu", "cpu", "--gpus", "8", "--global-batch", "8", "--pp", "2", "--tp", "2",
                 "--dp", "2", "--micro-batch", "1", "--schedule", "1f1b", "-o", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    names = data["model"]["layer_names"]
    data["stages"][0]["layers"] = data["stages"][0]["chunks"][0] = names[:1]  # cut after wte
    data["stages"][1]["layers"] = data["stages"][1]["chunks"][0] = names[1:]
    out.write_text(json.dumps(data))
    assert main(["run", str(out)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "tensor parallelism on pipeline stages split by the tracer" in err and "\n" not in err
    assert not (tmp_path / "pp.run.d").exists()


GLUE_AFTER_NORM = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)

    def forward(self, idx):
        if idx.min() < 0:   # a check on the data: the pipelining tracer cannot follow it
            raise ValueError("negative token id")
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 1:])   # glue between the last two layers, as HF heads slice

def build_model():
    return M()

def sample_batch(n):
    ids = torch.randint(0, 32, (n, 9))
    return ids[:, :-1], ids[:, 2:]
'''


def test_a_cut_followed_by_glue_is_not_offered(capsys, tmp_path):
    """The cut after the last block hands over one layer's output, but the layers after it do not
    run in sequence (the forward slices between norm and head, as Hugging Face heads do) and the
    pipelining tracer cannot follow the forward (it checks its data), so the runtime cannot start
    a stage there: --pp 2 gets one line and exit 2 before any launch, the free search no pipeline.
    (A forward the tracer follows is split by it: tests/distributed/test_pipeline_tracer.py.)"""
    model = tmp_path / "glue.py"
    model.write_text(GLUE_AFTER_NORM)
    assert main([str(model), "--gpu", "cpu", "--gpus", "2", "--pp", "2"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "cannot be split into pipeline stages" in err and "\n" not in err
    assert _plan_json(capsys, str(model), "--gpu", "cpu", "--gpus", "2")["parallel"]["pp"] == 1


def test_a_plan_for_another_trainer_prices_its_kernels(capsys, tmp_path):
    """--trainer megatron: Transformer Engine's fused kernels and cuDNN attention make the same
    configuration faster on an H100 than this runtime's eager kernels; the plan says which trainer
    it assumed and records it, plan run warns that it runs its own, and an unknown one is exit 2."""
    from planner.plan import Plan
    from runtime.layout import runtime_warnings

    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--global-batch", "64", "--dp", "8", "--zero", "1",
            "--micro-batch", "1", "--recompute", "none"]
    this, megatron = (_plan_json(capsys, *args, "--trainer", t) for t in ("this", "megatron"))
    assert (this["training"]["trainer"], megatron["training"]["trainer"]) == ("this", "megatron")
    assert megatron["predicted"]["step_time_s"] < this["predicted"]["step_time_s"]
    assert any(a.startswith("trainer: Megatron-LM") for a in megatron["assumptions"])
    out = tmp_path / "megatron.json"
    assert main([*args, "--trainer", "megatron", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert any("--trainer megatron" in w for w in runtime_warnings(plan, ()))
    assert main([*args, "--trainer", "colossalai"]) == EXIT_BAD_INPUT
    assert "--trainer" in capsys.readouterr().err


def test_a_plan_for_deepspeed_gathers_module_by_module(capsys):
    """--trainer deepspeed: its ZeRO-3 gathers each module's parameters with a collective of its
    own (a Llama block's nine where FSDP gathers the block at once), each paying its startup
    latency every micro-batch: the same configuration over two nodes spends longer in data-parallel
    traffic; the plan says which trainer it assumed."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "16", "--global-batch", "64", "--dp", "16", "--zero", "3",
            "--micro-batch", "1", "--recompute", "full"]
    this, deepspeed = (_plan_json(capsys, *args, "--trainer", t) for t in ("this", "deepspeed"))
    assert deepspeed["training"]["trainer"] == "deepspeed"
    assert deepspeed["predicted"]["breakdown_s"]["dp_comm"] > this["predicted"]["breakdown_s"]["dp_comm"]
    assert any(a.startswith("trainer: DeepSpeed") for a in deepspeed["assumptions"])


def test_a_plan_for_automodel_keeps_no_fp32_master_copy(capsys):
    """--trainer automodel (NeMo AutoModel steps the 16-bit parameters with Adam's state in their
    dtype): the same ZeRO-1 configuration holds a third of the optimizer state (4 bytes a parameter
    where an fp32 master copy, momentum and variance take 12), the same weights and gradients, and
    peaks lower; the plan says which trainer it assumed."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--global-batch", "64", "--dp", "8", "--zero", "1",
            "--micro-batch", "1", "--recompute", "full"]
    this, automodel = (_plan_json(capsys, *args, "--trainer", t) for t in ("this", "automodel"))
    assert automodel["training"]["trainer"] == "automodel"
    mine, theirs = this["stages"][0]["memory_bytes"], automodel["stages"][0]["memory_bytes"]
    assert mine["optimizer"] == pytest.approx(3 * theirs["optimizer"])
    assert (mine["weights"], mine["grads"]) == (theirs["weights"], theirs["grads"])
    assert automodel["predicted"]["peak_memory_bytes"] < this["predicted"]["peak_memory_bytes"]
    assert any(a.startswith("trainer: NeMo AutoModel") for a in automodel["assumptions"])


def test_a_plan_for_a_compiled_torchtitan_keeps_less_and_runs_faster(capsys):
    """--trainer torchtitan --compile: inductor's fused kernels (a faster step) and the compiled
    loss, which keeps the logits in bf16 rather than fp32 log-probabilities (a lower peak); the
    plan records it. Asked of a trainer that does not compile, one line and exit 2."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--global-batch", "64", "--dp", "8", "--zero", "3",
            "--micro-batch", "1", "--recompute", "full", "--trainer", "torchtitan"]
    eager, compiled = _plan_json(capsys, *args), _plan_json(capsys, *args, "--compile")
    assert (eager["training"]["compile"], compiled["training"]["compile"]) == (False, True)
    assert compiled["predicted"]["step_time_s"] < eager["predicted"]["step_time_s"]
    assert compiled["predicted"]["peak_memory_bytes"] < eager["predicted"]["peak_memory_bytes"]
    assert any("torch.compile" in a for a in compiled["assumptions"])
    assert main([*args[:-2], "--compile"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--compile" in err, err


def test_a_plan_whose_tensors_fit_without_the_allocators_slack_is_tight_not_refused(capsys):
    """The allocator's fragmentation (15% of what tensors need, an average) is room a run at the
    edge of memory gets back: a configuration whose tensors fit without it is planned with a
    warning and recorded as tight; one whose tensors do not fit at all is refused (exit 3)."""
    args = [str(EXAMPLES / "llama_7b.py"), "--gpus", "8", "--global-batch", "64", "--dp", "8", "--zero", "3",
            "--micro-batch", "2", "--recompute", "selective"]
    roomy = _plan_json(capsys, *args)
    assert roomy["predicted"]["fragmentation"] == pytest.approx(0.15)
    reserve = 2**30
    tensors = (roomy["predicted"]["peak_memory_bytes"] - reserve) / 1.15
    tight = _plan_json(capsys, *args, "--memory-limit", f"{(tensors * 1.05 + reserve) / 2**30:.3f}")
    assert tight["predicted"]["fragmentation"] == 0.0
    assert tight["predicted"]["peak_memory_bytes"] == pytest.approx(tensors + reserve, rel=0.01)
    assert tight["predicted"]["step_time_s"] == pytest.approx(roomy["predicted"]["step_time_s"])
    assert any(w.startswith("tight:") and "expandable_segments" in w for w in tight["warnings"])
    assert main([*args, "--memory-limit", f"{(tensors * 0.95 + reserve) / 2**30:.3f}"]) == EXIT_INFEASIBLE
    assert "nothing fits" in capsys.readouterr().err
