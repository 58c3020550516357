"""The default loss's memory, measured on the installed torch, against what the cost model holds
for it: the fused cross-entropy on whole logits, and torch's loss_parallel on vocabulary shards
(the head split by tensor parallelism), which holds LOSS_PARALLEL_EXTRA more fp32 copies."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner.cost.constants import LOSS_PARALLEL_EXTRA
from planner.cost.setup import Candidate, Training
from planner.cost.stage_costs import FULL, NONE, loss_working_bytes, stage_costs
from planner.hardware import make_cluster
from tests.unit.test_cost_formulas import gpt_bf16  # noqa: F401  (fixture)

# One process, a one-rank gloo group (a DTensor on a one-rank mesh runs loss_parallel's own ops,
# so its memory per shard is what every rank of a larger group holds). MemTracker counts the
# bytes of live tensors, on any device.
SCRIPT = """
import json, os, socket
import torch, torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor, Shard
from planner.model_file import default_loss

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))
B, T, V, H = 2, 1024, 8000, 32
targets = torch.randint(0, V, (B, T))
out = {}
for kind in ("whole", "sharded", "16-bit"):
    x = torch.randn(B, T, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    if kind == "sharded":
        w = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
        x = DTensor.from_local(x, mesh, [Replicate()])
    tracker = MemTracker()
    tracker.track_external(x, w)
    with tracker:
        logits = torch.nn.functional.linear(x, w)
        if kind == "16-bit":  # no fp32 upcast (NeMo AutoModel's MaskedCrossEntropy, fp32_upcast false)
            torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1)).backward()
        else:
            default_loss(logits, targets).backward()
    peaks = tracker.get_tracker_snapshot("peak")
    out[kind] = max(d.get("Total", 0) for d in peaks.values()) / (B * T * V * 4)
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_the_loss_holds_what_the_cost_model_counts():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])  # in fp32 logits (shards)
    # the model's 16-bit logits (alive until backward ends), the saved fp32 log-probabilities (the
    # head's activations in the profile), and the working set: two copies, or loss_parallel's more
    assert peak["whole"] == pytest.approx(0.5 + 1 + 2, rel=0.05)
    assert peak["sharded"] == pytest.approx(0.5 + 1 + 2 + LOSS_PARALLEL_EXTRA, rel=0.05)
    # on the 16-bit logits (Training.loss_upcast False): the logits, their log-softmax saved in
    # 16 bits, and two 16-bit gradients of them (nll_loss's, log_softmax's)
    assert peak["16-bit"] == pytest.approx(0.5 + 0.5 + 2 * 0.5, rel=0.05)


def test_the_profile_measures_the_losss_working_set(gpt_bf16):  # noqa: F811
    """examples/gpt.py's default loss, F.cross_entropy on logits.float(): its forward leaves the
    fp32 log-probabilities (the head's activations in the profile), and at its peak it holds two
    more fp32 copies of the logits (MemTracker on the fake trace); the logits themselves are
    bf16, half a copy."""
    head = gpt_bf16.layers[-1]
    assert not gpt_bf16.own_loss
    assert gpt_bf16.loss_working_bytes == pytest.approx(2 * head.activation_bytes, rel=0.01)
    assert gpt_bf16.output_bytes == pytest.approx(head.activation_bytes / 2, rel=0.01)
    assert gpt_bf16.loss_saved_bytes == pytest.approx(head.activation_bytes, rel=0.01)  # the log-probabilities


def test_a_vocabulary_parallel_head_adds_the_losss_working_set(gpt_bf16):  # noqa: F811
    """examples/gpt.py: its untied head's activations are the fp32 log-probabilities, larger than
    a block's. With tp 1 the working set is the loss's as measured (two copies of them); under tp
    2 loss_parallel's; with a trainer that fuses the loss, one gradient of the bf16 logits."""
    head = gpt_bf16.layers[-1]
    cluster, training = make_cluster("a100-80gb", 2), Training("bf16", "adamw", 8, 80 * 2**30)
    assert loss_working_bytes(gpt_bf16, 1, 4) == pytest.approx(2 * head.activation_bytes * 4, rel=0.01)
    assert loss_working_bytes(gpt_bf16, 1, 4, fused=True) == pytest.approx(head.activation_bytes * 4 / 2, rel=0.01)
    assert loss_working_bytes(gpt_bf16, 2, 4) == pytest.approx((2 + LOSS_PARALLEL_EXTRA) * head.activation_bytes * 4 / 2)
    for tp in (1, 2):
        costs = stage_costs(gpt_bf16, cluster, training, Candidate(tp, 1, 2 // tp, 4, 1, 0, "1f1b"))
        largest = max(a.act_bytes[NONE] for a in costs.atoms)
        assert costs.atoms[-1].act_bytes[NONE] == largest  # the head's
        expect = 2 * largest if tp == 1 else (2 + LOSS_PARALLEL_EXTRA) * largest
        assert costs.working_bytes == pytest.approx(expect, rel=0.01)
    fused = stage_costs(gpt_bf16, cluster, Training.for_trainer("megatron", "bf16", "adamw", 8, 80 * 2**30),
                        Candidate(1, 1, 2, 4, 1, 0, "1f1b"))
    # the head's own gradients (one copy of its activations) now outweigh the fused loss's logits
    blocks = max(2 * a.act_bytes[NONE] for a in fused.atoms[:-1])
    assert fused.working_bytes == pytest.approx(max(blocks, head.activation_bytes * 4), rel=0.01)
    assert fused.working_bytes < 2 * head.activation_bytes * 4


def test_a_loss_on_the_16_bit_logits_keeps_them_in_their_dtype(gpt_bf16):  # noqa: F811
    """Training.loss_upcast False (NeMo AutoModel's benchmarks): the head keeps the logits' size in
    bf16 where the profile measured fp32 log-probabilities (half of them), and backward holds two
    bf16 gradients of the logits, where the fp32 loss holds two fp32 copies (as measured above)."""
    head = gpt_bf16.layers[-1]
    cluster, cand = make_cluster("a100-80gb", 2), Candidate(1, 1, 2, 4, 1, 0, "1f1b")
    upcast = stage_costs(gpt_bf16, cluster, Training("bf16", "adamw", 8, 80 * 2**30), cand)
    own = stage_costs(gpt_bf16, cluster, Training("bf16", "adamw", 8, 80 * 2**30, loss_upcast=False), cand)
    assert upcast.atoms[-1].act_bytes[NONE] - own.atoms[-1].act_bytes[NONE] == pytest.approx(
        (gpt_bf16.loss_saved_bytes - gpt_bf16.output_bytes) * 4)
    assert gpt_bf16.output_bytes == pytest.approx(head.activation_bytes / 2, rel=0.01)
    assert upcast.working_bytes == pytest.approx(2 * head.activation_bytes * 4, rel=0.01)
    blocks = max(2 * a.act_bytes[NONE] for a in own.atoms[:-1])
    assert own.working_bytes == pytest.approx(max(blocks, 2 * gpt_bf16.output_bytes * 4), rel=0.01)


def test_recomputing_the_last_atom_lowers_no_peak(gpt_bf16):  # noqa: F811
    """The last atom's backward follows its forward at once, so its activations are held whatever
    the recompute choice; every other atom keeps less when recomputed."""
    costs = stage_costs(gpt_bf16, make_cluster("a100-80gb", 1), Training("bf16", "adamw", 8, 80 * 2**30),
                        Candidate(1, 1, 1, 4, 1, 0, "1f1b"))
    *rest, last = costs.atoms
    assert len(set(last.act_bytes)) == 1
    assert any(a.act_bytes[FULL] < a.act_bytes[NONE] for a in rest)

