"""Expert parallelism run against one process: each mixture-of-experts block's experts split over
ep consecutive ranks, tokens dispatched to them and combined back by all-to-all (CPU/gloo, fp32,
SGD), with DDP, ZeRO-1 and FSDP2 (ZeRO-2/3) over one and two expert replicas, full and selective
recompute (the all-to-alls run again in backward), a pipeline, and tensor parallelism with
sequence parallelism (dp2 x tp2, each tp rank routing its own sequence shard through the experts,
which tp leaves whole and EP splits over consecutive ranks, tp ranks included: ep2 over each tp
pair, the experts replicated over dp, with ZeRO-1, and FSDP ZeRO-3 with full recompute; ep4 over
all four ranks, on the Hugging Face model), and context parallelism (each cp rank routing the
tokens of its part of the sequence: ep2 over the cp pair; over each cp pair of dp2 x cp2 with
ZeRO-1 and selective recompute, and with FSDP ZeRO-3 and full recompute).

Two models: examples/moe.py's decoder, small (a ModuleList of experts that the block's own loop
calls: record / replay), and a tiny Hugging Face Mixtral built from a config (stacked expert
weights, ``MixtralExperts``). Each configuration trains 5 steps from the same weights and data;
every step's loss and the final parameters (each rank's experts gathered) must match one process
training on the whole global batch. One launch per world size, which also checkpoints every 2
steps (with a few AdamW configurations, whose optimizer state a resume must restore); a second
launch per world size resumes some of them from step 2 to 5, which must match the uninterrupted
run, and the checkpoints hold every expert once, in the whole model's layout. Also: a plan with ep
on a model without experts, with ep not dividing the experts or dp x tp, or with tp but without
sequence parallelism is refused before launch, in one line (plan files edited: the planner does
not make them); ``--dry-run`` shows the split.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torch

from planner.cli import main
from planner.model_file import load_model_file
from planner.planning import PlanRequest, make_plan, profile_for
from planner.search.space import Fixed
from runtime.launch import launch
from tests.conftest import EXAMPLES
from tests.distributed.reference import assert_matches, make_plans, single_process

STEPS = 5
CKPT_EVERY = 2
GLOBAL_BATCH = 4
NUM_EXPERTS = 6  # 3 a rank with ep 2; ep 4 does not divide them

MOE_MODEL = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import torch
from moe import MoEConfig, build_moe
from llama import llama_batch

CFG = MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab=64, seq_len=16,
                n_experts={NUM_EXPERTS}, top_k=2)


def build_model():
    return build_moe(CFG)


def sample_batch(batch_size):
    # new data each step: the runtime seeds torch before each call
    return llama_batch(CFG, batch_size, seed=int(torch.randint(0, 2**31 - 1, ())))
"""

DENSE_MODEL = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import torch
from llama import LlamaConfig, build_llama, llama_batch

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab=64, seq_len=16)


def build_model():
    return build_llama(CFG)


def sample_batch(batch_size):
    return llama_batch(CFG, batch_size, seed=int(torch.randint(0, 2**31 - 1, ())))
"""

HF_MODEL = """
import torch
from transformers import MixtralConfig, MixtralForCausalLM

CFG = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=16, use_cache=False, experts_implementation="eager")
SEQ = 16


def build_model():
    return MixtralForCausalLM(CFG)


def sample_batch(batch_size):
    ids = torch.randint(0, CFG.vocab_size, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def loss_fn(outputs, targets):
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
"""

# name -> (world size, fixed choices)
MOE_CONFIGS = {
    "ddp": (2, Fixed(dp=2, tp=1, pp=1, zero=0, micro_batch=1, recompute="none", ep=2)),
    "fsdp": (2, Fixed(dp=2, tp=1, pp=1, zero=3, micro_batch=2, recompute="none", ep=2)),
    "recompute": (2, Fixed(dp=2, tp=1, pp=1, zero=1, micro_batch=1, recompute="full", ep=2)),
    # selective checkpointing of layers whose experts are FSDP units of their own (FSDP2 enters a
    # record_function in the recompute that the forward did not: runtime/recompute.py passes it)
    "fsdp_selective": (2, Fixed(dp=2, tp=1, pp=1, zero=3, micro_batch=1, recompute="selective", ep=2)),
    "replicas_zero1": (4, Fixed(dp=4, tp=1, pp=1, zero=1, micro_batch=1, recompute="none", ep=2)),
    "replicas_fsdp": (4, Fixed(dp=4, tp=1, pp=1, zero=3, micro_batch=1, recompute="full", ep=2)),
    "pp": (4, Fixed(dp=2, tp=1, pp=2, zero=1, micro_batch=1, recompute="none", schedule="1f1b", ep=2)),
    # EP x TP (experts whole, each tp rank routing its own sequence shard; the EP group is consecutive
    # ranks, tp ranks included: ep2 over each tp pair, each expert on both dp ranks): ZeRO-1 over 2
    # micro-batches; FSDP ZeRO-3 with full recompute (the all-to-alls and TP collectives rerun)
    "tp_zero1": (4, Fixed(dp=2, tp=2, pp=1, zero=1, micro_batch=1, recompute="none", ep=2, sequence_parallel=True)),
    "tp_fsdp": (4, Fixed(dp=2, tp=2, pp=1, zero=3, micro_batch=2, recompute="full", ep=2, sequence_parallel=True)),
    # EP x CP (each cp rank routing the tokens of its part of the sequence): ep2 over the cp pair, one
    # replica; ep2 over each cp pair with the experts replicated over dp, ZeRO-1 and FSDP ZeRO-3 with full
    # recompute (their gradients divided by dp x cp)
    "cp": (2, Fixed(dp=1, tp=1, pp=1, cp=2, zero=0, micro_batch=2, recompute="none", ep=2)),
    "dp_cp_zero1": (4, Fixed(dp=2, tp=1, pp=1, cp=2, zero=1, micro_batch=1, recompute="selective", ep=2)),
    "dp_cp_fsdp": (4, Fixed(dp=2, tp=1, pp=1, cp=2, zero=3, micro_batch=2, recompute="full", ep=2)),
}
HF_CONFIGS = {
    "hf_ddp_selective": (2, Fixed(dp=2, tp=1, pp=1, zero=0, micro_batch=1, recompute="selective", ep=2)),
    "hf_fsdp_recompute": (2, Fixed(dp=2, tp=1, pp=1, zero=3, micro_batch=1, recompute="full", ep=2)),
    "hf_replicas_zero2": (4, Fixed(dp=4, tp=1, pp=1, zero=2, micro_batch=1, recompute="none", ep=2)),
}
# the same model with transformers' grouped-GEMM experts, whose fake-tensor run finds its sequence
# parallelism: an EP group over both dp indices and both tp ranks, one of the 4 experts a rank, each
# tp rank's sequence shard (taken at the first layer) routed to all four
HF_GROUPED_CONFIGS = {
    "hf_tp_ep4": (4, Fixed(dp=2, tp=2, pp=1, zero=1, micro_batch=1, recompute="none", ep=4, sequence_parallel=True)),
}
CONFIGS = {**MOE_CONFIGS, **HF_CONFIGS, **HF_GROUPED_CONFIGS}
# AdamW (optimizer state that a resume must restore; no single-process reference): the dense
# ZeRO-1 optimizer beside the experts' own; the stacked experts' ZeroRedundancyOptimizer over 2
# replicas; FSDP2 shards of stacked experts over 2 replicas
ADAMW_CONFIGS = {
    "adamw_zero1": (2, "moe", Fixed(dp=2, tp=1, pp=1, zero=1, micro_batch=1, recompute="none", ep=2)),
    "hf_adamw_replicas_zero1": (4, "hf", Fixed(dp=4, tp=1, pp=1, zero=1, micro_batch=1, recompute="none", ep=2)),
    "hf_adamw_replicas_fsdp": (4, "hf", Fixed(dp=4, tp=1, pp=1, zero=3, micro_batch=1, recompute="none", ep=2)),
}
WORLD = {**{n: w for n, (w, _) in CONFIGS.items()}, **{n: w for n, (w, _, _) in ADAMW_CONFIGS.items()}}
# resumed from their step-2 checkpoints, one launch per world size: list and stacked blocks, with
# ZeRO-0/1/2/3, one and two expert replicas, a pipeline, and tensor parallelism (ep2 over each tp
# pair: each expert held by both dp ranks, saved once)
RESUMED = {
    2: ("recompute", "fsdp", "hf_fsdp_recompute", "adamw_zero1"),
    4: ("replicas_zero1", "pp", "tp_zero1", "hf_replicas_zero2", "hf_adamw_replicas_zero1", "hf_adamw_replicas_fsdp"),
}


def with_ep(plan: Path, ep: int, out: Path | None = None) -> Path:
    """The plan with parallel.ep set (in place, or into `out`): what the planner would not make."""
    data = json.loads(plan.read_text())
    data["parallel"]["ep"] = ep
    out = out or plan
    out.write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ep")
    (path / "moe_model.py").write_text(MOE_MODEL)
    (path / "hf_model.py").write_text(HF_MODEL)
    (path / "hf_grouped_model.py").write_text(HF_MODEL.replace(', experts_implementation="eager"', ""))
    return path


def _adamw_plans(workdir: Path) -> dict[str, Path]:
    out = {}
    for kind in ("moe", "hf"):
        handle = load_model_file(workdir / f"{kind}_model.py")
        profile = None
        for name, (world, model, fixed) in ADAMW_CONFIGS.items():
            if model != kind:
                continue
            request = PlanRequest(gpus=world, gpu="cpu", global_batch=GLOBAL_BATCH, fixed=fixed, optimizer="adamw",
                                  precision="fp32")
            profile = profile or profile_for(handle, request)
            out[name] = workdir / f"{name}.json"
            out[name].write_text(make_plan(handle, request, profile).to_json())
    return out


@pytest.fixture(scope="module")
def plans(workdir) -> dict[str, Path]:
    return {
        **make_plans(workdir / "moe_model.py", MOE_CONFIGS, workdir, GLOBAL_BATCH),
        **make_plans(workdir / "hf_model.py", HF_CONFIGS, workdir, GLOBAL_BATCH),
        **make_plans(workdir / "hf_grouped_model.py", HF_GROUPED_CONFIGS, workdir, GLOBAL_BATCH),
        **_adamw_plans(workdir),
    }


def _names(world: int) -> list[str]:
    return [n for n, w in WORLD.items() if w == world]


@pytest.fixture(scope="module")
def runs(plans, workdir) -> dict[str, tuple[object, Path]]:
    """name -> (RunReport, params.pt): one launch per world size runs its plans in turn, each
    checkpointing every CKPT_EVERY steps into ``ckpt_w<world>/plan<i>``."""
    out = {}
    for world in (2, 4):
        names = _names(world)
        result = launch([plans[n] for n in names], world, steps=STEPS, save_params=True, timeout_s=300,
                        run_dir=workdir / f"w{world}", checkpoint_dir=workdir / f"ckpt_w{world}",
                        checkpoint_every=CKPT_EVERY)
        out.update({n: (result.reports[i], result.run_dir / f"plan{i}" / "params.pt") for i, n in enumerate(names)})
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process(name, plans, runs):
    report, params_path = runs[name]
    assert_matches(name, report.measured.losses, params_path, single_process(plans[name], STEPS))
    ep = CONFIGS[name][1].ep
    assert json.loads(plans[name].read_text())["parallel"]["ep"] == ep  # as planned (--ep)
    log = (params_path.parent.parent / "launch.log").read_text(errors="replace")
    blocks, experts = ("1 block", 6) if name == "pp" else ("2 blocks", 4 if name.startswith("hf") else 6)
    assert f"expert parallel: {blocks}, {experts} experts over {ep} ranks ({experts // ep} each), dispatch by all-to-all" in log
    phases = report.profiled.phases_s  # the profiled step (runtime.phases): the dispatch is EP's
    parallel = json.loads(plans[name].read_text())["parallel"]
    assert phases["ep_comm"] > 0 and (phases["cp_comm"] > 0) == (parallel["cp"] > 1), phases
    assert (phases["tp_comm"] > 0) == (parallel["tp"] > 1), phases


def test_dry_run_shows_the_expert_split(plans, capsys):
    assert main(["run", str(plans["replicas_zero1"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel: each mixture-of-experts block's experts split over 2 ranks" in out
    assert "rank 3: dp 3/4, ep 1/2, tp 0/1" in out
    assert main(["run", str(plans["tp_zero1"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # the EP group is consecutive ranks: ep2 splits the experts over each tp pair
    assert "rank 1: dp 0/2, ep 1/2, tp 1/2" in out and "rank 2: dp 1/2, ep 0/2, tp 0/2" in out
    assert "2 replica(s) of each expert" in out
    assert "expert parallel x tensor parallel: the mixture-of-experts blocks are not split by tp" in out
    assert "tp shard 1/2 of layers.*.self_attn.q_proj, layers.*.self_attn.k_proj, layers.*.self_attn.v_proj (colwise)" in out
    assert main(["run", str(plans["dp_cp_zero1"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # with CP too: ep2 over each cp pair (consecutive ranks), the experts replicated over dp
    assert "rank 1: dp 0/2, cp 1/2, ep 1/2, tp 0/1" in out and "rank 2: dp 1/2, cp 0/2, ep 0/2, tp 0/1" in out
    assert "2 replica(s) of each expert, their gradients summed and divided by dp x cp" in out


def _refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_ep_on_a_model_without_experts_is_refused_before_launch(workdir, capsys):
    dense = workdir / "dense"
    dense.mkdir()
    (dense / "model.py").write_text(DENSE_MODEL)
    plan = make_plans(dense / "model.py", {"ddp": (2, Fixed(dp=2, tp=1, pp=1, zero=0, micro_batch=1))}, dense, GLOBAL_BATCH)["ddp"]
    err = _refused(["run", str(with_ep(plan, 2))], capsys)
    assert err.endswith("parallel.ep 2: model.py has no mixture-of-experts block (a router and a list of identical "
                        "experts, or stacked expert weights)")
    assert not (dense / "ddp.run.d").exists()


def test_ep_not_dividing_the_experts_or_dp_is_refused_before_launch(plans, workdir, capsys):
    err = _refused(["run", str(with_ep(plans["replicas_zero1"], 4, workdir / "ep4.json"))], capsys)
    assert err.endswith(f"parallel.ep 4 does not divide the {NUM_EXPERTS} experts of layers.0.mlp.experts: re-plan "
                        "with an ep that divides it")
    err = _refused(["run", str(with_ep(plans["ddp"], 4, workdir / "ep4_dp2.json"))], capsys)
    assert "ep 4 does not divide dp x cp x tp 2" in err  # planner.schema refuses it on load
    assert not (workdir / "ep4.run.d").exists() and not (workdir / "ep4_dp2.run.d").exists()


def test_ep_with_tp_without_sequence_parallelism_is_refused_before_launch(plans, workdir, capsys):
    """Without sequence parallelism every tp rank would route the same tokens through the experts."""
    data = json.loads(plans["tp_zero1"].read_text())
    data["parallel"]["sequence_parallel"] = False
    edited = workdir / "tp_no_sp.json"
    edited.write_text(json.dumps(data))
    err = _refused(["run", str(edited)], capsys)
    assert err.endswith("parallel.ep 2 with tp 2 needs sequence parallelism (each tp rank routes its own sequence shard "
                        "through the experts; without it every tp rank would route the same tokens): re-plan with "
                        "--sequence-parallel on")
    assert not (workdir / "tp_no_sp.run.d").exists()


# --- checkpoint and resume (runtime/checkpoint.py) --------------------------------------------


def _ckpt_of(workdir: Path, name: str, step: int) -> Path:
    """The first launch's checkpoint of configuration `name` after `step` steps."""
    from runtime.checkpoint import plan_sha256, step_dir

    index = _names(WORLD[name]).index(name)
    return step_dir(workdir / f"ckpt_w{WORLD[name]}" / f"plan{index}", step, plan_sha256(workdir / f"{name}.json"))


@pytest.fixture(scope="module")
def resumed(plans, workdir, runs) -> dict[str, tuple[object, Path, Path]]:
    """RESUMED configurations, resumed from their step-2 checkpoints to STEPS: one fresh launch per
    world size (checkpointing too). name -> (RunReport, params.pt, its checkpoint folder)."""
    import shutil

    out = {}
    for world, names in RESUMED.items():
        root = workdir / f"resume_w{world}"
        for i, name in enumerate(names):
            source = _ckpt_of(workdir, name, 2)
            shutil.copytree(source, root / f"plan{i}" / source.name)
        result = launch([plans[n] for n in names], world, steps=STEPS, save_params=True, timeout_s=300,
                        run_dir=workdir / f"w{world}resume", checkpoint_dir=root, checkpoint_every=CKPT_EVERY,
                        resume=True)
        out.update({n: (result.reports[i], result.run_dir / f"plan{i}" / "params.pt", root / f"plan{i}")
                    for i, n in enumerate(names)})
    return out


@pytest.mark.parametrize("name", [n for names in RESUMED.values() for n in names])
def test_resume_matches_uninterrupted(name, resumed, runs, workdir):
    from runtime.checkpoint import plan_sha256, step_dir

    report, params_path, root = resumed[name]
    whole, whole_params = runs[name]
    uninterrupted = (list(whole.measured.losses), torch.load(whole_params, weights_only=True))
    assert_matches(f"{name} resumed", report.measured.losses, params_path, uninterrupted, first_step=2)
    assert any("resumed from" in w and "step-00000002" in w for w in report.warnings)
    assert (step_dir(root, 4, plan_sha256(workdir / f"{name}.json")) / "manifest.json").exists()  # it checkpoints too


@pytest.mark.parametrize("name, key, experts", [
    ("recompute", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", NUM_EXPERTS),
    ("tp_fsdp", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", NUM_EXPERTS),
    ("hf_fsdp_recompute", "model.model.layers.0.mlp.experts.gate_up_proj", 4),
    ("hf_replicas_zero2", "model.model.layers.0.mlp.experts.gate_up_proj", 4),
    ("hf_adamw_replicas_fsdp", "optim.state.model.layers.1.mlp.experts.down_proj.exp_avg", 4),
    ("hf_adamw_replicas_zero1", "optim.state.model.layers.1.mlp.experts.down_proj.exp_avg", 4),
])
def test_checkpoint_holds_every_expert_once(name, key, experts, runs, workdir):
    """The DCP metadata: a list block's experts each under its own index, a stacked parameter (and
    its optimizer state) as the whole [E, ...] tensor, its chunks (one per EP rank, or per FSDP2
    shard) covering it once, the replicas' copies not written again."""
    from torch.distributed.checkpoint import FileSystemReader

    from runtime.checkpoint import plan_sha256, sha256_file, verify

    path = _ckpt_of(workdir, name, 4)
    model = workdir / ("hf_model.py" if name.startswith("hf") else "moe_model.py")
    assert verify(path, plan_sha256(workdir / f"{name}.json"), sha256_file(model)) == 4  # before unpickling it
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if "{e}" in key:
        for i in range(2):
            for e in range(experts):
                assert key.format(i=i, e=e) in meta, f"{name}: no {key.format(i=i, e=e)} in the checkpoint"
                entry = meta[key.format(i=i, e=e)]
                covered = sum(torch.Size(c.sizes).numel() for c in entry.chunks)  # once, whatever holds it
                assert covered == torch.Size(entry.size).numel(), f"{name}: {key.format(i=i, e=e)} saved {len(entry.chunks)} times"
        return
    entry = meta[key]
    assert entry.size[0] == experts, f"{name}: {key} saved as {tuple(entry.size)}, not the whole {experts} experts"
    numel = torch.Size(entry.size).numel()
    covered = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
    assert covered == numel, f"{name}: {key}'s chunks hold {covered} elements of {numel} (duplicates or gaps)"
    starts = sorted(c.offsets[0] for c in entry.chunks)
    assert len(set(starts)) == len(starts), f"{name}: {key} chunks start at rows {starts}"
