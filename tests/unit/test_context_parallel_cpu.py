"""Context parallelism on CPU (runtime.context_parallel): torch's ring attention with its causal load
balancing, run over gloo on two ranks, trains a tiny causal transformer exactly as one process
does. Each rank trains the reference itself (full sequence, same seed and data), then the CP
model with its sequence shard of the inputs, position ids and targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import json, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from runtime.context_parallel import load_balanced_order, sequence_sharded

VOCAB, SEQ, BATCH, DIM, HEADS, STEPS, LR = 64, 16, 2, 32, 4, 3, 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = (t.view(b, l, HEADS, d // HEADS).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up at call time: CP patches it
        x = x + self.proj(y.transpose(1, 2).reshape(b, l, d))
        return x + self.mlp(self.ln2(x))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx, pos):  # positions are an input: CP hands each rank a permuted shard
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).repeat(BATCH, 1)
    return tokens[:, :-1].clone(), pos, tokens[:, 1:].clone()


def model():
    torch.manual_seed(0)
    return Tiny()


def train(cp_mesh=None):
    m, losses, orders = model(), [], []
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for step in range(STEPS):
        idx, pos, tgt = batch(step)
        opt.zero_grad()
        if cp_mesh is None:
            loss = F.cross_entropy(m(idx, pos).flatten(0, 1), tgt.flatten())
            loss.backward()
        else:
            group = cp_mesh.get_group()
            with sequence_sharded(cp_mesh, [idx, pos, tgt], [1, 1, 1]):
                loss = F.cross_entropy(m(idx, pos).flatten(0, 1), tgt.flatten())  # mean over local tokens
                loss.backward()
            orders.append(pos[0].tolist())
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=group)
            loss /= cp_mesh.size()
            for p in m.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad /= cp_mesh.size()
        opt.step()
        losses.append(loss.item())
    return m, losses, orders


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ref, ref_losses, _ = train()
cp, cp_losses, orders = train(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
ref_params = dict(ref.named_parameters())
init_params = dict(model().named_parameters())
weight_diff = max((p - ref_params[n]).abs().max().item() for n, p in cp.named_parameters())
moved = max((p - init_params[n]).abs().max().item() for n, p in ref.named_parameters())
result = dict(ref_losses=ref_losses, cp_losses=cp_losses, weight_diff=weight_diff, moved=moved, orders=orders,
              expected_order=load_balanced_order(SEQ, world, rank), seq=SEQ, world=world)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


def test_context_parallel_matches_one_process(tmp_path):
    script = tmp_path / "cp_worker.py"
    script.write_text(textwrap.dedent(WORKER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(r["cp_losses"]) == len(r["ref_losses"]) == 3
        for step, (cp, ref) in enumerate(zip(r["cp_losses"], r["ref_losses"])):
            assert abs(cp - ref) <= 1e-5, (rank, step, cp, ref)
        assert r["weight_diff"] <= 1e-5, (rank, r["weight_diff"])
        assert r["moved"] > 1e-3  # the steps did train: matching weights are not the untouched init
        # torch's head-tail load balancing (its default for causal attention) is on: each rank holds
        # chunk r and chunk 2*cp-1-r of the sequence, not one contiguous half
        contiguous = list(range(rank * r["seq"] // r["world"], (rank + 1) * r["seq"] // r["world"]))
        for order in r["orders"]:
            assert order == r["expected_order"] != contiguous, (rank, order)
