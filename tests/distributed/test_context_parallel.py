"""Context parallelism run against one process: each sequence split over cp ranks (torch's
context_parallel, load-balanced causal attention as a ring, on CPU/gloo), alone, with data
parallelism (DDP and FSDP over dp x cp) and with tensor parallelism; fp32, SGD.

The model is examples/llama.py's decoder (RoPE tables as buffers of seq_len rows, causal SDPA),
small; each configuration trains 5 steps from the same weights and data, and every step's loss
and the final parameters must match one process training on the whole global batch. One launch
per world size. Also: a plan with cp > 1 on a model whose attention cannot be split is refused
before launch, in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.search.space import Fixed
from tests.conftest import EXAMPLES
from tests.distributed.reference import assert_matches, make_plans, run_by_world, single_process

STEPS = 5
GLOBAL_BATCH = 4

MODEL = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import torch
from llama import LlamaConfig, build_llama, llama_batch

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab=64, seq_len=32)


def build_model():
    return build_llama(CFG)


def sample_batch(batch_size):
    # new data each step: the runtime seeds torch before each call
    return llama_batch(CFG, batch_size, seed=int(torch.randint(0, 2**31 - 1, ())))
"""

CONFIGS = {
    "cp": (2, Fixed(dp=1, tp=1, pp=1, cp=2, zero=0, micro_batch=2, recompute="none")),
    "dp_cp_fsdp": (4, Fixed(dp=2, tp=1, pp=1, cp=2, zero=3, micro_batch=1, recompute="full")),
    "tp_cp": (4, Fixed(dp=1, tp=2, pp=1, cp=2, zero=0, micro_batch=2, recompute="none", sequence_parallel=False)),
    "tp_cp_sp": (4, Fixed(dp=1, tp=2, pp=1, cp=2, zero=1, micro_batch=2, recompute="selective", sequence_parallel=True)),
    "pp_cp": (4, Fixed(dp=1, tp=1, pp=2, cp=2, zero=0, micro_batch=1, recompute="none", schedule="1f1b")),
    # HSDP on 2 "nodes" of 2: each node's cp pair is a shard group, the nodes are replicas
    "hsdp_cp": (4, Fixed(dp=2, tp=1, pp=1, cp=2, zero=3, micro_batch=1, recompute="none", hsdp=True)),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cp")
    (path / "model.py").write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def plans(workdir) -> dict[str, Path]:
    return make_plans(workdir / "model.py", CONFIGS, workdir, GLOBAL_BATCH)


@pytest.fixture(scope="module")
def runs(plans, workdir):
    return run_by_world(plans, CONFIGS, workdir, STEPS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process(name, plans, runs):
    report, params_path = runs[name]
    assert_matches(name, report.measured.losses, params_path, single_process(plans[name], STEPS))
    log = (params_path.parent.parent / "launch.log").read_text(errors="replace")
    assert "sequence buffers sharded: layers.*.self_attn.rope_cos, layers.*.self_attn.rope_sin" in log  # RoPE tables
    parallel = json.loads(plans[name].read_text())["parallel"]
    assert parallel["cp"] == 2 and parallel["dp_replicate"] == (2 if name == "hsdp_cp" else 1)
    # the profiled step (runtime.phases): the ring's traffic is CP's, apart from TP's
    phases = report.profiled.phases_s
    assert phases["cp_comm"] > 0 and (phases["tp_comm"] > 0) == (parallel["tp"] > 1), phases
    assert "CP communication" in {r.name for r in report.phases}


def test_dry_run_shows_the_sequence_split(plans, capsys):
    assert main(["run", str(plans["dp_cp_fsdp"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "context parallel: each sequence of 32 in 2 x 2 chunks" in out
    assert "rank 3: dp 1/2, cp 1/2, tp 0/1" in out


def test_cp_on_a_model_it_cannot_split_is_refused_before_launch(plans, workdir, capsys):
    data = json.loads(plans["cp"].read_text())
    data["model"]["cp_blocker"] = "blocks.0.attn computes attention scores with matmuls, not scaled_dot_product_attention"
    edited = workdir / "blocked.json"
    edited.write_text(json.dumps(data))
    assert main(["run", str(edited)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("parallel.cp 2: context parallelism cannot run on this model: blocks.0.attn computes "
                        "attention scores with matmuls, not scaled_dot_product_attention") and "\n" not in err
    assert not (workdir / "blocked.run.d").exists()


def test_checkpoints_with_saved_sequence_buffers_refused_before_launch(workdir, capsys):
    """Each CP rank holds its own rows of the RoPE tables: kept in the model's state (persistent),
    a checkpoint would hold one rank's rows under that name for all."""
    saved = workdir / "saved_rope"
    saved.mkdir()
    (saved / "model.py").write_text(MODEL + """

_build = build_model


def build_model():
    model = _build()
    for layer in model.layers:  # the RoPE tables saved with the model's state
        layer.self_attn._non_persistent_buffers_set.clear()
    return model
""")
    plan = make_plans(saved / "model.py", {"cp": CONFIGS["cp"]}, saved, GLOBAL_BATCH)["cp"]
    assert main(["run", str(plan), "--checkpoint-dir", str(saved / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "context parallelism cannot checkpoint buffer layers.0.self_attn.rope_cos" in err and "\n" not in err
    assert "persistent=False" in err and not (saved / "cp.run.d").exists()
