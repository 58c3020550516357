"""What torch.compile keeps for backward, measured on the installed torch's inductor (CPU), against
what the cost model counts under Training.compiled and Training.compiled_loss: the partitioner
keeps what backward reads, where eager selective checkpointing keeps every matmul output and the
eager loss fp32 log-probabilities. Each measurement compiles once (about 10 s)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cost.setup import Candidate, Training
from planner.cost.stage_costs import NONE, SELECTIVE, stage_costs
from planner.hardware import make_cluster
from tests.unit.test_cost_formulas import gpt_bf16  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0 and ("InductorError" in proc.stderr or "CppCompileError" in proc.stderr):
        pytest.skip("torch.compile cannot build kernels here: " + proc.stderr.strip().splitlines()[-1][:200])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# torch.compile of the default loss (what torchtitan runs under --compile): the tensors its forward
# saves for backward, counted by a saved-tensors hook (which sees the compiled graph's saves too).
COMPILED_SCRIPT = "import json; from bench.compiled_memory import loss_saved; print(json.dumps(loss_saved()))"


def test_a_compiled_loss_saves_the_logits_in_their_dtype():
    """Eager F.cross_entropy on logits.float() saves the fp32 log-probabilities (two 16-bit
    copies); compiled, the 16-bit logits and a few figures per row (Training.compiled_loss)."""
    saved = _run(COMPILED_SCRIPT)  # in 16-bit logits
    assert saved["eager"] == pytest.approx(2.0, rel=0.02)
    assert saved["compiled"] == pytest.approx(1.0, rel=0.02)


def test_a_compiled_loss_keeps_less_for_the_head(gpt_bf16):  # noqa: F811
    """Training.compiled_loss: the head keeps the bf16 logits, not the fp32 log-probabilities (half
    the profile's head activations here), and its backward one bf16 gradient; on vocabulary shards
    (tp 2: loss_parallel) and for a model file's own loss, nothing changes."""
    cluster, limit = make_cluster("a100-80gb", 2), 80 * 2**30
    head = gpt_bf16.layers[-1]
    eager, compiled = (Training("bf16", "adamw", 8, limit, compiled_loss=c) for c in (False, True))
    cand = Candidate(1, 1, 2, 4, 1, 0, "1f1b")
    a, b = (stage_costs(gpt_bf16, cluster, t, cand) for t in (eager, compiled))
    assert a.atoms[-1].act_bytes[NONE] - b.atoms[-1].act_bytes[NONE] == pytest.approx(head.activation_bytes / 2 * 4, rel=0.01)
    assert b.atoms[-1].act_bytes[NONE] == pytest.approx(a.atoms[-1].act_bytes[NONE] - gpt_bf16.output_bytes * 4, rel=0.01)
    blocks = max(2 * x.act_bytes[NONE] for x in b.atoms[:-1])
    assert b.working_bytes == pytest.approx(max(blocks, gpt_bf16.output_bytes * 4), rel=0.01)
    assert b.working_bytes < a.working_bytes
    sharded = Candidate(2, 1, 1, 4, 1, 0, "1f1b")
    assert (stage_costs(gpt_bf16, cluster, compiled, sharded).atoms[-1].act_bytes
            == stage_costs(gpt_bf16, cluster, eager, sharded).atoms[-1].act_bytes)
    own = dataclasses.replace(gpt_bf16, own_loss=True)
    assert stage_costs(own, cluster, compiled, cand).atoms[-1].act_bytes == stage_costs(own, cluster, eager, cand).atoms[-1].act_bytes


# One Llama block (examples/llama.py) under selective checkpointing that keeps every matmul-like
# output (runtime/recompute.py's policy), compiled as torchtitan compiles its blocks (checkpoint
# inside the compiled region); the saved-tensors hook sees what the compiled graph keeps.
BLOCK_SCRIPT = ("import json; from bench.compiled_memory import block_saved; "
                "print(json.dumps({'saved': block_saved()[0], 'whole': block_saved(recompute=False)[0]}))")


def test_a_compiled_block_under_selective_recompute_keeps_what_backward_reads(tmp_path):
    """Compiled, a Llama block under save-matmuls checkpointing keeps its input and every matmul
    output but its last Linear's (read only by the residual add): the profile's selective figure
    less activation_matmul_tail_bytes, within the per-row figures (log-sum-exp) the partitioner
    adds. Without checkpointing it keeps what each fused chain of memory-bound ops reads, not
    what the chain makes and reads itself (RMSNorm's fp32 copy, SiLU's output): the profile's
    activation_fused_bytes, 19.6 hidden-size tensors where eager keeps 27.1."""
    from planner.model_file import load_model_file
    from planner.profile import profile_model
    from tests.conftest import EXAMPLES

    source = "import sys\nsys.path.insert(0, %r)\n" % str(EXAMPLES) + """
from llama import LlamaConfig, build_llama, llama_batch
CFG = LlamaConfig(dim=256, n_layers=1, n_heads=8, n_kv_heads=2, ffn_dim=896, vocab=256, seq_len=512)
def build_model():
    return build_llama(CFG)
def sample_batch(b):
    return llama_batch(CFG, b)
"""
    path = tmp_path / "block.py"
    path.write_text(source)
    prof = profile_model(load_model_file(path), measure=False, dtype="bf16")
    block = next(l for l in prof.layers if l.name == "layers.0")
    hidden = 512 * 256 * 2
    assert block.activation_matmul_tail_bytes == hidden  # the down projection's output
    kept = block.activation_matmul_bytes - block.activation_matmul_tail_bytes + hidden  # and the block's input
    measured = _run(BLOCK_SCRIPT)
    assert kept <= measured["saved"] <= kept * 1.02
    assert measured["whole"] == pytest.approx(block.activation_fused_bytes, rel=0.02)
    assert block.activation_fused_bytes < 0.75 * block.activation_bytes

    cluster, limit = make_cluster("h100-sxm-80gb", 1), 80 * 2**30
    eager, compiled = (Training("bf16", "adamw", 8, limit, compiled=c, fused_kernels=c) for c in (False, True))
    cand = Candidate(1, 1, 1, 4, 1, 0, "1f1b")
    a, b = (stage_costs(prof, cluster, t, cand) for t in (eager, compiled))
    i = next(k for k, atom in enumerate(a.atoms) if atom.first <= block.index <= atom.last)
    assert a.atoms[i].act_bytes[SELECTIVE] - b.atoms[i].act_bytes[SELECTIVE] == pytest.approx(4 * hidden)
    assert a.atoms[i].act_bytes[NONE] - b.atoms[i].act_bytes[NONE] == pytest.approx(
        4 * (block.activation_bytes - block.activation_fused_bytes))
