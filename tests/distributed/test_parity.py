"""The runtime against a single process: DDP, FSDP, HSDP, TP, dp x tp and pipeline parallel (GPipe,
1F1B, interleaved; pp x dp; pp x dp x tp) on CPU/gloo, fp32, SGD.

Each configuration trains a tiny GPT for 5 steps from the same initial weights and data; the loss
after every step and the final parameters must match one process training on the whole global
batch. Launches are shared (one torchrun per world size runs several plans in turn): each costs
several seconds on two cores. Also: a rank that raises stops the run with its rank named, a
changed model or a pipeline plan the runtime cannot run is refused before launch, and --dry-run prints the layout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from planner.cli import main
from planner.model_file import load_model_file
from planner.planning import PlanRequest, make_plan, profile_for
from planner.search.space import Fixed
from runtime.launch import LaunchResult, RunFailed, launch
from tests.conftest import EXAMPLES
from tests.distributed.reference import assert_matches, single_process

STEPS = 5
CKPT_DIRS = {2: "ckpt_w2", 4: "ckpt_w4"}
"""world size -> where its launch of `runs` checkpoints (DIR/plan<i>/step-NNNNNNNN)."""
CKPT_EVERY = 2
RESUMED = ("ddp", "fsdp", "pp_1f1b", "zero1")
RESUMED_W4 = ("dp_tp", "dp_tp_zero1")
"""4-rank configurations resumed too (DDP over TP; with ZeRO-1): from the step-2 checkpoints of the
4-rank launch of `runs`, in one more 4-rank launch to STEPS."""
GLOBAL_BATCH = 8

MODEL = f"""
import os, sys
sys.path.insert(0, {str(EXAMPLES)!r})
import torch
from torch._subclasses.fake_tensor import FakeTensor
from gpt import GPT, GPTConfig, gpt_batch

CFG = GPTConfig(vocab=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)


class MaybeFailing(GPT):
    def forward(self, idx):
        fail = os.environ.get("PLAN_TEST_FAIL_RANK")
        if fail is not None and os.environ.get("RANK") == fail and not isinstance(idx, FakeTensor):
            raise RuntimeError("injected failure")
        kill = os.environ.get("PLAN_TEST_KILL_RANK")
        if kill is not None and os.environ.get("RANK") == kill and not isinstance(idx, FakeTensor):
            import signal
            os.kill(os.getpid(), signal.SIGKILL)  # dies without a word, as the OOM killer does
        return super().forward(idx)


def build_model():
    return MaybeFailing(CFG)


def sample_batch(batch_size):
    if os.environ.get("PLAN_TEST_FIXED_DATA") == "1":  # one batch every step: a loss that can fall
        return gpt_batch(CFG, batch_size, seed=0)
    # new data each step: the runtime seeds torch before each call
    return gpt_batch(CFG, batch_size, seed=int(torch.randint(0, 2**31 - 1, ())))
"""

# name -> (world size, Fixed): the configurations each launch runs in turn
CONFIGS = {
    "ddp": (2, Fixed(dp=2, tp=1, pp=1, zero=0, micro_batch=2, recompute="none")),
    "ddp_selective": (2, Fixed(dp=2, tp=1, pp=1, zero=0, micro_batch=2, recompute="selective")),
    "zero1": (2, Fixed(dp=2, tp=1, pp=1, zero=1, micro_batch=2, recompute="none")),
    "fsdp": (2, Fixed(dp=2, tp=1, pp=1, zero=3, micro_batch=2, recompute="full")),
    "fsdp_zero2": (2, Fixed(dp=2, tp=1, pp=1, zero=2, micro_batch=4, recompute="none")),
    "tp": (2, Fixed(dp=1, tp=2, pp=1, zero=0, micro_batch=4, recompute="none", sequence_parallel=True)),
    "dp_tp": (4, Fixed(dp=2, tp=2, pp=1, zero=0, micro_batch=2, recompute="none", sequence_parallel=True)),
    "dp_tp_recompute": (4, Fixed(dp=2, tp=2, pp=1, zero=0, micro_batch=2, recompute="full", sequence_parallel=False)),
    "dp_tp_zero1": (4, Fixed(dp=2, tp=2, pp=1, zero=1, micro_batch=2, recompute="none")),
    "fsdp_tp": (4, Fixed(dp=2, tp=2, pp=1, zero=3, micro_batch=2, recompute="full", sequence_parallel=True)),
    # HSDP on 2 "nodes" of 2: FSDP2 shards in each pair, the pairs are replicas (2 micro-batches)
    "hsdp": (4, Fixed(dp=4, tp=1, pp=1, zero=3, micro_batch=1, recompute="none", hsdp=True)),
    # pipeline parallel (torch.distributed.pipelining): each schedule, then with dp and tp
    "pp_gpipe": (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="selective", schedule="gpipe")),
    "pp_1f1b": (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="none", schedule="1f1b")),
    "pp_interleaved": (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="none",
                                schedule="interleaved", virtual_stages=2)),
    "pp_dp": (4, Fixed(dp=2, tp=1, pp=2, zero=0, micro_batch=2, recompute="alternate", schedule="1f1b")),
    "pp_dp_zero1": (4, Fixed(dp=2, tp=1, pp=2, zero=1, micro_batch=2, recompute="none", schedule="1f1b")),
    "pp_dp_tp": (8, Fixed(dp=2, tp=2, pp=2, zero=0, micro_batch=2, recompute="none", schedule="1f1b", sequence_parallel=True)),
    # a GPT written as nanoGPT is (embeddings summed in forward, tied head: tests/nanogpt_model.py),
    # whose first cut the planner puts where the layers run in sequence, so that TP applies
    "pp_dp_tp_nanogpt": (8, Fixed(dp=2, tp=2, pp=2, zero=0, micro_batch=1, recompute="none", schedule="1f1b",
                                  sequence_parallel=True)),
    # a GPT whose attention views with its own head count and whose blocks write the MLP's output in
    # place (tests/own_heads_model.py, as OPT and Falcon do): each rank's head count divided, the output copied
    "tp_own_heads": (2, Fixed(dp=1, tp=2, pp=1, zero=0, micro_batch=4, recompute="none", sequence_parallel=True)),
    # a Hugging Face Llama (tests/hf_llama_model.py): the shard taken at its first layer, not at the embeddings
    "tp_hf_llama": (2, Fixed(dp=1, tp=2, pp=1, zero=0, micro_batch=4, recompute="none", sequence_parallel=True)),
    # and with context parallelism: its position ids sharded with the tokens, one sequence per row
    "tp_cp_hf_llama": (4, Fixed(dp=1, tp=2, pp=1, cp=2, zero=0, micro_batch=4, recompute="none",
                                sequence_parallel=True)),
    # the same model taking its inputs as a dict (keyword arguments): stage 0 gets them positionally
    "pp_interleaved_dict": (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="none",
                                     schedule="interleaved", virtual_stages=2)),
}
DICT_CONFIGS = {"pp_interleaved_dict"}
NANOGPT_CONFIGS = {"pp_dp_tp_nanogpt"}
NANOGPT = Path(__file__).parents[1] / "nanogpt_model.py"
OWN_HEADS_CONFIGS = {"tp_own_heads"}
OWN_HEADS = Path(__file__).parents[1] / "own_heads_model.py"
HF_LLAMA_CONFIGS = {"tp_hf_llama", "tp_cp_hf_llama"}
HF_LLAMA = Path(__file__).parents[1] / "hf_llama_model.py"
# the Hugging Face Llama given its position ids (context parallelism shards them with the tokens)
HF_LLAMA_POSITIONS = f"""
import sys
sys.path.insert(0, {str(HF_LLAMA.parent)!r})
from hf_llama_model import build_model, batch_with_positions as sample_batch  # noqa: F401
"""

# MODEL with its inputs as {"input_ids": ...}: same weights and data, so the same reference
DICT_MODEL = MODEL + """

class DictInputs(MaybeFailing):
    def forward(self, input_ids):
        return super().forward(input_ids)


def build_model():
    return DictInputs(CFG)


_tensor_batch = sample_batch


def sample_batch(batch_size):
    inputs, targets = _tensor_batch(batch_size)
    return {"input_ids": inputs}, targets
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("runtime")
    (path / "model.py").write_text(MODEL)
    (path / "dict_model.py").write_text(DICT_MODEL)
    (path / "hf_positions.py").write_text(HF_LLAMA_POSITIONS)
    return path


@pytest.fixture(scope="module")
def plans(workdir) -> dict[str, Path]:
    handle = load_model_file(workdir / "model.py")
    base = PlanRequest(gpus=2, gpu="cpu", global_batch=GLOBAL_BATCH, optimizer="sgd", precision="fp32")
    profile = profile_for(handle, base)  # one profile serves every plan of a model file
    dict_handle = load_model_file(workdir / "dict_model.py")
    dict_profile = profile_for(dict_handle, base)
    out = {}
    for name, (world, fixed) in CONFIGS.items():
        request = PlanRequest(gpus=world, gpu="cpu", global_batch=GLOBAL_BATCH, fixed=fixed, optimizer="sgd", precision="fp32",
                              gpus_per_node=2 if fixed.hsdp else None)
        if name in DICT_CONFIGS:
            plan = make_plan(dict_handle, request, dict_profile)
        elif name in NANOGPT_CONFIGS:
            plan = make_plan(load_model_file(NANOGPT), request)
        elif name in OWN_HEADS_CONFIGS:
            plan = make_plan(load_model_file(OWN_HEADS), request)
        elif name in HF_LLAMA_CONFIGS:
            plan = make_plan(load_model_file(HF_LLAMA if name == "tp_hf_llama" else workdir / "hf_positions.py"), request)
        else:
            plan = make_plan(handle, request, profile)
        out[name] = workdir / f"{name}.json"
        out[name].write_text(plan.to_json())
    return out


@pytest.fixture(scope="module")
def reference(plans) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch per step: losses and final parameters."""
    return single_process(plans["ddp"], STEPS)


def _launch(plans: dict[str, Path], world: int, tmp: Path) -> tuple[LaunchResult, list[str]]:
    names = [n for n, (w, _) in CONFIGS.items() if w == world]
    # The 2- and 4-rank launches also checkpoint every CKPT_EVERY steps (CKPT_DIRS[world]/plan<i>/
    # step-NNNNNNNN): the resume tests (RESUMED, RESUMED_W4) start from those checkpoints.
    ckpt = dict(checkpoint_dir=tmp / CKPT_DIRS[world], checkpoint_every=CKPT_EVERY) if world in CKPT_DIRS else {}
    result = launch([plans[n] for n in names], world, steps=STEPS, save_params=True, timeout_s=300,
                    run_dir=tmp / f"w{world}", **ckpt)
    return result, names


@pytest.fixture(scope="module")
def runs(plans, workdir) -> dict[str, tuple[object, Path]]:
    """name -> (RunReport, params.pt) for every configuration: one launch per world size."""
    out = {}
    for world in sorted({w for w, _ in CONFIGS.values()}):
        result, names = _launch(plans, world, workdir)
        for i, name in enumerate(names):
            out[name] = (result.reports[i], result.run_dir / f"plan{i}" / "params.pt")
    return out


@pytest.fixture(scope="module")
def nanogpt_reference(plans) -> tuple[list[float], dict[str, torch.Tensor]]:
    return single_process(plans["pp_dp_tp_nanogpt"], STEPS)


@pytest.fixture(scope="module")
def own_heads_reference(plans) -> tuple[list[float], dict[str, torch.Tensor]]:
    return single_process(plans["tp_own_heads"], STEPS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process(name, runs, reference, request):
    report, params_path = runs[name]
    if name in NANOGPT_CONFIGS:
        reference = request.getfixturevalue("nanogpt_reference")
    elif name in OWN_HEADS_CONFIGS:
        reference = request.getfixturevalue("own_heads_reference")
    elif name in HF_LLAMA_CONFIGS:
        reference = single_process(request.getfixturevalue("plans")[name], STEPS)
    assert_matches(name, report.measured.losses, params_path, reference)
    assert report.measured.step_time_s > 0 and len(report.measured.peak_memory_bytes) == CONFIGS[name][0]


def test_each_run_measures_the_cost_models_phases(runs):
    """Each run profiles its last step (runtime.phases) into the phases of the plan's prediction,
    on every rank (its rank<r>.json): forward, backward and the optimizer everywhere; TP, pipeline
    (with its bubble), FSDP's data-parallel traffic and recompute on some rank where the plan has
    them (a pipeline stage may hold no TP-split layer), on none where it has not. The report shows
    the rank whose profiled step was slowest."""
    for name, (report, params_path) in runs.items():
        fixed, world = CONFIGS[name][1], CONFIGS[name][0]
        ranks = [json.loads((params_path.parent / f"rank{r}.json").read_text())["phases_s"] for r in range(world)]
        assert report.profiled is not None and report.profiled.phases_s == ranks[report.profiled.rank], name
        for phases in ranks:
            assert all(phases[k] > 0 for k in ("forward", "backward", "optimizer")), (name, phases)

        def some(kind: str) -> bool:
            return any(phases[kind] > 0 for phases in ranks)

        assert some("tp_comm") == (fixed.tp > 1) and some("pp_comm") == (fixed.pp > 1), (name, ranks)
        assert some("recompute") == (fixed.recompute != "none"), (name, ranks)
        if fixed.zero == 3:
            assert some("dp_comm"), (name, ranks)
        rows = {r.name: r for r in report.phases}
        assert rows["optimizer step"].predicted_s == report.predicted.breakdown_s["optimizer"]
        assert ("pipeline communication and bubble" in rows) == (fixed.pp > 1), name


@pytest.mark.parametrize("env, expected", [
    ({"PLAN_TEST_FAIL_RANK": "1"}, ("rank 1 failed", "injected failure")),
    # killed by a signal (no Python error to record): named from torchrun's own summary
    ({"PLAN_TEST_KILL_RANK": "0"}, ("rank 0 died: killed by SIGKILL",)),
], ids=["raises", "killed"])
def test_failing_rank_stops_the_run(plans, workdir, env, expected):
    start = time.perf_counter()
    with pytest.raises(RunFailed) as info:
        launch([plans["ddp"]], 2, steps=STEPS, timeout_s=120, pg_timeout_s=20,
               run_dir=workdir / f"fail-{next(iter(env))}", env=env)
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert all(part in message for part in expected) and "\n" not in message, message
    assert elapsed < 60, f"the run took {elapsed:.0f} s to stop"


def test_changed_model_refused_before_launch(plans, workdir, capsys):
    changed = workdir / "changed" / "model.py"
    changed.parent.mkdir()
    changed.write_text(MODEL + "\n# edited\n")
    assert main(["run", str(plans["ddp"]), "--model", str(changed)]) == 2
    err = capsys.readouterr().err
    assert "model.py changed since the plan was made: re-plan" in err
    assert not (workdir / "ddp.run.d").exists()


def test_plan_shapes(plans):
    """The pipeline plans are what the parity tests mean to cover (interleaved: 2 chunks a rank)."""
    from planner.plan import Plan

    inter = Plan.load(plans["pp_interleaved"])
    assert inter.parallel.schedule == "interleaved" and all(len(s.chunks) == 2 for s in inter.stages)
    assert Plan.load(plans["pp_gpipe"]).parallel.schedule == "gpipe"
    assert Plan.load(plans["pp_dp_tp"]).parallel.num_microbatches == 2
    selective = Plan.load(plans["ddp_selective"]).stages[0]
    assert selective.selective_layers and not selective.recompute_layers
    assert any(s.selective_layers for s in Plan.load(plans["pp_gpipe"]).stages)
    assert all(s.alternate_layers and not s.selective_layers for s in Plan.load(plans["pp_dp"]).stages)
    assert Plan.load(plans["zero1"]).parallel.zero == 1
    assert Plan.load(plans["hsdp"]).parallel.dp_replicate == 2
    # without position ids the model makes them from the embeddings' length: the shard is taken at its
    # first layer; given them, the embeddings hand on their shards (as context parallelism's ranks do)
    hf, hf_cp = Plan.load(plans["tp_hf_llama"]), Plan.load(plans["tp_cp_hf_llama"])
    assert hf.parallel.sequence_parallel and {l.role.shard_at for l in hf.model.layers} == {"model.layers.0"}
    assert hf_cp.parallel.sequence_parallel and hf_cp.parallel.cp == 2 and not hf_cp.model.cp_blocker


@pytest.mark.parametrize("name", ["ddp_selective", "zero1", "pp_gpipe", "pp_dp", "pp_dp_zero1"])
def test_runs_as_planned(name, runs):
    """Selective recompute (SAC), ZeRO-1 (DDP + ZeroRedundancyOptimizer) and DDP inside pipeline
    stages (with the alternate recompute policy) run as the plan says: no departure is reported."""
    assert not runs[name][0].warnings, runs[name][0].warnings


def test_pipeline_and_layer_mismatch_refused(plans, workdir, capsys):
    data = json.loads(plans["pp_1f1b"].read_text())
    data["parallel"]["schedule"] = "zbv"
    pipe = workdir / "pipe.json"
    pipe.write_text(json.dumps(data))
    assert main(["run", str(pipe)]) == 2
    assert 'parallel.schedule: "zbv" is not one of gpipe, 1f1b, interleaved' in capsys.readouterr().err

    data = json.loads(plans["pp_1f1b"].read_text())
    data["stages"][0]["chunks"] = [data["stages"][0]["chunks"][0][:-1]]
    data["stages"][1]["chunks"] = [[data["stages"][0]["layers"][-1], *data["stages"][1]["chunks"][0]][::-1]]
    pipe.write_text(json.dumps(data))
    assert main(["run", str(pipe)]) == 2
    assert "do not hold the model's layers in order" in capsys.readouterr().err

    data = json.loads(plans["ddp"].read_text())
    data["model"]["layer_names"][2] = "blocks.renamed"
    renamed = workdir / "renamed.json"
    renamed.write_text(json.dumps(data))
    assert main(["run", str(renamed)]) == 2
    assert "model.layers: their names differ from model.layer_names" in capsys.readouterr().err
    data["model"]["layers"][2]["name"] = "blocks.renamed"
    renamed.write_text(json.dumps(data))
    assert main(["run", str(renamed)]) == 2
    assert "layers differ from the plan's (missing blocks.renamed): re-plan" in capsys.readouterr().err
    data["version"] = 1  # a plan from before the plan carried the layers' TP split and roles
    renamed.write_text(json.dumps(data))
    assert main(["run", str(renamed)]) == 2
    assert "version 1 was written by an older planner" in capsys.readouterr().err


def test_tp_runs_vocabulary_and_sequence_parallel(runs, plans, capsys):
    """What the cost model assumes for tp > 1 (Megatron TP with sequence parallelism where the plan
    says so, vocabulary-parallel embeddings and head, the loss on vocabulary-sharded logits) is what
    ran: no run warning about it, each rank's log says so, and --dry-run shows the shards. (The parity
    tests above: it trains as one process does, with and without sequence parallelism.)"""
    off = "vocabulary-parallel: wte, wpe, lm_head; sequence parallel: False"
    assert off in (runs["dp_tp_recompute"][1].parent.parent / "launch.log").read_text(errors="replace")
    ran = "vocabulary-parallel: wte, wpe, lm_head; sequence parallel: True; lm_head's logits stay vocabulary-sharded"
    for name in ("tp", "dp_tp", "dp_tp_recompute", "fsdp_tp", "pp_dp_tp"):
        report, params_path = runs[name]
        from runtime.layout import SP_GATHER_WARNING

        departures = [w for w in report.warnings if w != SP_GATHER_WARNING]
        assert not any("vocabulary" in w or "sequence parallel" in w or "logits" in w for w in departures), (
            name, report.warnings)
        log = (params_path.parent.parent / "launch.log").read_text(errors="replace")
        assert ran in log or name in ("pp_dp_tp", "dp_tp_recompute"), name  # a pipeline stage logs its own layers
    log = (runs["pp_dp_tp"][1].parent.parent / "launch.log").read_text(errors="replace")
    assert "vocabulary-parallel: wte, wpe; sequence parallel: True" in log
    assert "vocabulary-parallel: lm_head; sequence parallel: True; lm_head's logits stay vocabulary-sharded" in log
    assert main(["run", str(plans["tp"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tp shard 1/2 of the vocabulary: wte rows 32-63 of 64, wpe rows 8-15 of 16, lm_head rows 32-63 of 64" in out
    assert "sequence parallel: positions 8-15 of 16 of the hidden states" in out


def test_dry_run_prints_command_and_layout(plans, capsys):
    assert main(["run", str(plans["dp_tp"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "-m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 --master-port" in out
    assert "-m runtime.worker --plan" in out
    assert "rank 3: dp 1/2, tp 1/2" in out
    assert "tp shard 1/2 of blocks.*.attn.q" in out and "blocks.*.mlp.down (rowwise)" in out
    assert "ZeRO-0: DDP" in out
    assert not plans["dp_tp"].with_name("dp_tp.run.json").exists()


def test_cli_run_writes_report(plans, capsys):
    path = plans["tp"]
    assert main(["run", str(path), "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "planner.RunReport" and report["version"] == 1
    assert len(report["measured"]["losses"]) == 2 and len(report["measured"]["peak_memory_bytes"]) == 2
    # the phases the runtime times apart, each against the plan's prediction of it
    phases = {p["name"]: p for p in report["phases"]}
    assert set(phases) == {"forward, backward, communication, bubble", "optimizer step"}
    assert 0 < phases["optimizer step"]["measured_s"] < report["measured"]["step_time_s"]
    assert phases["optimizer step"]["predicted_s"] == report["predicted"]["breakdown_s"]["optimizer"]
    written = path.with_name("tp.run.json")
    assert json.loads(written.read_text())["measured"]["losses"] == report["measured"]["losses"]
    assert main(["run", str(path), "--steps", "2"]) == 2  # never overwritten without --force
    assert "already exists" in capsys.readouterr().err


# --- checkpoint and resume (runtime/checkpoint.py) --------------------------------------------


def _ckpt_of(workdir: Path, name: str, step: int) -> Path:
    """The checkpoint of configuration `name` after `step` steps, written by the launch of its world
    size (CONFIGS) in `runs`."""
    from runtime.checkpoint import plan_sha256, step_dir

    world = CONFIGS[name][0]
    index = [n for n, (w, _) in CONFIGS.items() if w == world].index(name)
    return step_dir(workdir / CKPT_DIRS[world] / f"plan{index}", step, plan_sha256(workdir / f"{name}.json"))


@pytest.fixture(scope="module")
def resumed(plans, workdir, runs) -> dict[str, tuple[object, Path, Path]]:
    """RESUMED (2 ranks) and RESUMED_W4 (4 ranks) configurations: each world size's resumed in one
    fresh launch to STEPS, from copies of the step-2 checkpoints its launch in `runs` wrote."""
    import shutil

    out = {}
    for world, names, tag in ((2, RESUMED, ""), (4, RESUMED_W4, "_w4")):
        root = workdir / f"resume{tag}"
        for i, name in enumerate(names):
            source = _ckpt_of(workdir, name, 2)
            shutil.copytree(source, root / f"plan{i}" / source.name)
        result = launch([plans[n] for n in names], world, steps=STEPS, save_params=True, timeout_s=300,
                        run_dir=workdir / f"w{world}resume", checkpoint_dir=root, checkpoint_every=CKPT_EVERY,
                        resume=True)
        out.update({n: (result.reports[i], result.run_dir / f"plan{i}" / "params.pt", root / f"plan{i}")
                    for i, n in enumerate(names)})
    return out


def test_checkpoints_written_with_manifest(runs, workdir):
    from runtime.checkpoint import MANIFEST, plan_sha256, sha256_file, verify

    assert all(CONFIGS[n][0] == 2 for n in RESUMED) and all(CONFIGS[n][0] == 4 for n in RESUMED_W4)
    for name in ("ddp", "fsdp", "pp_interleaved", *RESUMED_W4):  # the 4-rank ones: what the w4 resume starts from
        for step in (2, 4):
            path = _ckpt_of(workdir, name, step)
            manifest = json.loads((path / MANIFEST).read_text())
            assert manifest["step"] == step and ".metadata" in manifest["files"]
            assert verify(path, plan_sha256(workdir / f"{name}.json"), sha256_file(workdir / "model.py")) == step
    for ckpt in CKPT_DIRS.values():
        assert not list((workdir / ckpt).glob("plan*/.step-*"))  # no partial directory left


@pytest.mark.parametrize("name", RESUMED + RESUMED_W4)
def test_resume_matches_uninterrupted(name, resumed, reference, workdir):
    from runtime.checkpoint import plan_sha256, step_dir

    report, params_path, root = resumed[name]
    assert_matches(f"{name} resumed", report.measured.losses, params_path, reference, first_step=2)
    assert any("resumed from" in w and "step-00000002" in w for w in report.warnings)
    assert (step_dir(root, 4, plan_sha256(workdir / f"{name}.json")) / "manifest.json").exists()  # it checkpoints too


def test_tampered_checkpoint_refused(plans, workdir, capsys):
    import shutil

    from runtime.checkpoint import find_latest, plan_sha256, sha256_file

    root = workdir / "tampered"
    good, bad = (root / _ckpt_of(workdir, "ddp", step).name for step in (2, 4))
    shutil.copytree(_ckpt_of(workdir, "ddp", 2), good)
    shutil.copytree(_ckpt_of(workdir, "ddp", 4), bad)
    shard = sorted(bad.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    plan_hash, model_hash = plan_sha256(plans["ddp"]), sha256_file(workdir / "model.py")
    # --resume skips the tampered newest checkpoint in favour of the older complete one, saying why
    found = find_latest(root, plan_hash, model_hash)
    assert found is not None and found.path == good and found.step == 2
    assert len(found.skipped) == 1 and f"{shard.name} does not match its sha256" in found.skipped[0]
    # the only checkpoint tampered: refused before launch, one line naming the file
    shutil.rmtree(good)
    assert main(["run", str(plans["ddp"]), "--checkpoint-dir", str(root), "--resume", "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no usable checkpoint" in err and f"{shard.name} does not match its sha256 in the manifest" in err, err
    assert "\n" not in err
    # no manifest (incomplete), or another plan's checkpoint: refused with the reason
    shutil.copytree(_ckpt_of(workdir, "ddp", 2), good)
    (good / "manifest.json").unlink()
    assert main(["run", str(plans["ddp"]), "--checkpoint-dir", str(root), "--resume", "--force"]) == 2
    assert "no manifest.json (incomplete, or not written by plan run)" in capsys.readouterr().err
    shutil.rmtree(root)
    shutil.copytree(_ckpt_of(workdir, "fsdp", 2), root / _ckpt_of(workdir, "fsdp", 2).name)
    assert main(["run", str(plans["ddp"]), "--checkpoint-dir", str(root), "--resume", "--force"]) == 2
    assert "made for a different plan" in capsys.readouterr().err
    assert not plans["ddp"].with_name("ddp.run.json").exists()  # nothing started


def test_checkpoints_not_signed_by_this_account_refused(plans, workdir, capsys, monkeypatch, tmp_path):
    """DCP's metadata is a pickle: a folder whose manifest this account's key did not sign (made
    elsewhere, unsigned, or edited after signing) is refused before anything is loaded."""
    import shutil

    from runtime.checkpoint import KEY_ENV, MANIFEST, find_latest, plan_sha256, sha256_file, verify

    plan_hash, model_hash = plan_sha256(plans["ddp"]), sha256_file(workdir / "model.py")
    source = _ckpt_of(workdir, "ddp", 2)
    path = tmp_path / "ckpt" / source.name
    shutil.copytree(source, path)
    manifest = json.loads((path / MANIFEST).read_text())
    run = ["run", str(plans["ddp"]), "--checkpoint-dir", str(path.parent), "--resume", "--force"]
    for change, reason in (
        (lambda m: m.pop("hmac"), "is not signed, so it was not written by plan run"),
        (lambda m: m.update(step=4), "signature does not match this account's key"),
        (lambda m: m["files"].update({".metadata": sha256_file(path / "__0_0.distcp")}), "signature does not match"),
    ):
        edited = json.loads(json.dumps(manifest))
        change(edited)
        (path / MANIFEST).write_text(json.dumps(edited))
        with pytest.raises(Exception, match=reason):
            verify(path, plan_hash, model_hash)
        assert main(run) == 2
        err = capsys.readouterr().err.strip()
        assert reason in err and "\n" not in err, err
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert find_latest(path.parent, plan_hash, model_hash).step == 2
    # another account's key (or none here): refused too, naming the key
    other = tmp_path / "other.key"
    other.write_bytes(b"k" * 32)
    other.chmod(0o600)
    monkeypatch.setenv(KEY_ENV, str(other))
    assert main(run) == 2
    assert f"does not match this account's key {other}" in capsys.readouterr().err
    other.chmod(0o644)
    assert main(run) == 2
    assert f"the signing key {other} is open to other users" in capsys.readouterr().err
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "missing.key"))
    assert main(run) == 2
    assert "no signing key at" in capsys.readouterr().err
    assert not plans["ddp"].with_name("ddp.run.json").exists()  # nothing started


def test_prune_deletes_only_old_checkpoints_of_this_plan(tmp_path):
    from runtime.checkpoint import prune, step_dir, write_manifest

    a, b = "a" * 64, "b" * 64
    for step, plan in ((2, a), (4, a), (6, a), (3, b), (5, b)):
        d = step_dir(tmp_path, step, plan)
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x")
        write_manifest(d, step, plan, "model")
    unsigned = step_dir(tmp_path, 1, a)
    unsigned.mkdir()  # no manifest: not provably ours
    leftover = tmp_path / f".{step_dir(tmp_path, 8, a).name}.partial-1-2"
    leftover.mkdir()  # a crashed save of plan a
    foreign = tmp_path / f".{step_dir(tmp_path, 8, b).name}.partial-1-2"
    foreign.mkdir()  # plan b's save, maybe running now
    (tmp_path / "notes.txt").write_text("mine")
    removed = prune(tmp_path, a, keep=2)
    assert sorted(removed) == sorted([leftover, step_dir(tmp_path, 2, a)])  # plan b's older checkpoint stays
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [foreign.name, "notes.txt", unsigned.name] + [step_dir(tmp_path, s, p).name for s, p in ((3, b), (4, a), (5, b), (6, a))])


def test_a_rank_killed_mid_save_then_resumed_matches_uninterrupted(plans, workdir, reference):
    """Two plans checkpoint into one folder; rank 1 of one of them is killed in the middle of its
    step-4 save (its shards written, the checkpoint not complete). The run fails, the step-2
    checkpoint stays loadable, the other plan's checkpoint is untouched; a resume continues from
    step 2, cleans the partial folder, and ends where an uninterrupted run ends."""
    import shutil

    from runtime.checkpoint import FAULT_ENV, plan_sha256, sha256_file, step_dir, verify

    root = workdir / "crash"
    other = _ckpt_of(workdir, "fsdp", 4)
    shutil.copytree(other, root / other.name)
    plan, plan_hash, model_hash = plans["ddp"], plan_sha256(plans["ddp"]), sha256_file(workdir / "model.py")
    with pytest.raises(RunFailed):
        launch([plan], 2, steps=4, timeout_s=300, run_dir=workdir / "wcrash", checkpoint_dir=root,
               checkpoint_every=CKPT_EVERY, env={FAULT_ENV: "save:4:1"})
    assert not step_dir(root, 4, plan_hash).exists()
    assert verify(step_dir(root, 2, plan_hash), plan_hash, model_hash) == 2
    assert list(root.glob(".step-00000004-*.partial-*"))  # what the crash left
    result = launch([plan], 2, steps=STEPS, save_params=True, timeout_s=300, run_dir=workdir / "wcrash2",
                    checkpoint_dir=root, checkpoint_every=CKPT_EVERY, resume=True)
    report = result.reports[0]
    assert_matches("ddp resumed after a crash", report.measured.losses, result.run_dir / "plan0" / "params.pt",
                   reference, first_step=2)
    assert not list(root.glob(".step-*"))  # the partial folder is gone
    assert verify(step_dir(root, 4, plan_hash), plan_hash, model_hash) == 4
    assert verify(root / other.name, plan_sha256(plans["fsdp"]), model_hash) == 4  # the other plan's, as it was


# --- the meta-device build (runtime/meta_init.py; PLAN_RUNTIME_META=1) ---------------------------

META_CONFIGS = ("pp_1f1b", "fsdp", "tp")
META_STEPS = 3


@pytest.fixture(scope="module")
def meta_runs(plans, workdir) -> dict[str, tuple[object, list[dict]]]:
    """pp2, dp2 FSDP and tp2 built on the meta device, one 2-rank launch on one fixed batch (random
    tokens every step leave nothing to learn): name -> (report, rank JSONs)."""
    result = launch([plans[n] for n in META_CONFIGS], 2, steps=META_STEPS, timeout_s=300,
                    run_dir=workdir / "w2meta", env={"PLAN_RUNTIME_META": "1", "PLAN_TEST_FIXED_DATA": "1"})
    out = {}
    for i, name in enumerate(META_CONFIGS):
        ranks = [json.loads((result.run_dir / f"plan{i}" / f"rank{r}.json").read_text()) for r in range(2)]
        out[name] = (result.reports[i], ranks)
    return out


@pytest.mark.parametrize("name", META_CONFIGS)
def test_meta_build_trains(name, meta_runs):
    import itertools
    import math

    from runtime.meta_init import WARNING

    report, ranks = meta_runs[name]
    losses = report.measured.losses
    assert len(losses) == META_STEPS and all(math.isfinite(x) for x in losses), losses
    assert sum(b - a for a, b in itertools.pairwise(losses)) < 0, f"{name}: losses do not decrease: {losses}"
    assert WARNING in report.warnings
    assert all(r["build"]["path"] == "meta" for r in ranks)


def test_meta_build_replicas_agree(meta_runs):
    """dp2 FSDP: both replicas initialised the same weights (before sharding) without communication,
    and hold the same parameters after step 1."""
    _, ranks = meta_runs["fsdp"]
    a, b = (r["build"] for r in ranks)
    assert a["init_sha256"] and a["init_sha256"] == b["init_sha256"]
    assert a["params_sha256_step1"] and a["params_sha256_step1"] == b["params_sha256_step1"]


def test_meta_build_fsdp_allocates_only_shards(meta_runs, reference):
    """dp2 FSDP on the meta path: sharded before materialising, so each rank allocates about half of
    the parameters and holds at most one layer whole while initialising."""
    _, ref_params = reference
    total = sum(p.numel() for p in ref_params.values())
    _, ranks = meta_runs["fsdp"]
    for r in ranks:
        build = r["build"]
        assert 0.45 * total <= build["materialized_parameters"] <= 0.55 * total, (build["materialized_parameters"], total)
        assert 0 < build["largest_unit_elements"] < 0.5 * total


def test_meta_build_materialises_only_own_stage(meta_runs, reference, plans):
    """pp2: rank 0 never allocated stage 1's layers, rank 1 not stage 0's (where the planner cuts
    depends on this machine's timings of the layers: the test reads the plan's stages)."""
    from planner.plan import Plan

    _, ref_params = reference
    _, ranks = meta_runs["pp_1f1b"]
    r0, r1 = (r["build"] for r in ranks)
    stages = [tuple(s.chunks[0]) for s in Plan.load(plans["pp_1f1b"]).stages]
    assert stages[0] and stages[1]

    def under(name: str, layers: tuple[str, ...]) -> bool:
        return any(name == l or name.startswith(l + ".") for l in layers)

    assert not any(under(n, stages[1]) for n in r0["materialized_names"])
    assert not any(under(n, stages[0]) for n in r1["materialized_names"])
    total = sum(p.numel() for p in ref_params.values())
    other = sum(p.numel() for n, p in ref_params.items() if under(n, stages[1]))
    assert other > 0 and r0["materialized_parameters"] == total - other


def test_default_build_not_warned(runs):
    from runtime.meta_init import WARNING

    assert WARNING not in runs["ddp"][0].warnings


def test_materialize_stage_with_init_hook_walking_every_layer():
    """llama's init_weights walks every layer (RoPE tables): on a stage whose other layers are stubs
    the meta layers are put back for the call; replicas built twice agree."""
    import sys

    sys.path.insert(0, str(EXAMPLES))
    from llama import LlamaConfig, build_llama, rope_tables

    from runtime.meta_init import materialize_sharded
    from runtime.pipeline import build_stage_module

    cfg = LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=64, seq_len=16)
    names = ["embed_tokens", *(f"layers.{i}" for i in range(4)), "norm", "lm_head"]
    keep = ("layers.2", "layers.3", "norm", "lm_head")

    def build():
        with torch.device("meta"):
            full = build_llama(cfg)
        stage = build_stage_module(full, names, keep, first=False)
        info = materialize_sharded(stage, full, torch.device("cpu"), names)
        return stage, info

    (a, info_a), (b, info_b) = build(), build()
    assert info_a.init_sha256 == info_b.init_sha256
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not any(t.is_meta for t in (*a.parameters(), *a.buffers()))
    assert not any(n.startswith(("layers.0.", "layers.1.", "embed_tokens")) for n in info_a.materialized_names)
    cos, _ = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
    assert torch.equal(a.get_submodule("layers.3").self_attn.rope_cos, cos)
    assert torch.all(a.get_submodule("norm").weight == 1)
    w = a.get_submodule("layers.2").mlp.up_proj.weight
    assert abs(w.std().item() - 0.02) < 0.005
    x = torch.randn(2, cfg.seq_len, cfg.dim)
    assert torch.isfinite(a(x)).all()


