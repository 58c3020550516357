"""The cost model against published training runs (../shared/reference/published_runs.yaml).

For every row with a measured (or derived) step time: build the GPT of that shape
(examples/gpt.py) as those runs ran it (Megatron-LM 2021-22: attention scores materialised, one
fused scale-mask-softmax pass over them, dropout 0.1; no flash attention yet), profile it on fake
tensors, fix the published configuration (tp, pp, dp,
micro-batch, schedule, recompute) and predict the step time; then run the free search on the
same model, cluster and batch. Prints one table with measured, predicted, error, the free
search's plan and time, and the median and worst error.

    python bench/bench_published.py            # the table
    python bench/bench_published.py --fit      # grid-search the two compute efficiencies
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cost import compute as compute_mod  # noqa: E402
from planner.cost.setup import Training  # noqa: E402
from planner.hardware import make_cluster  # noqa: E402
from planner.model_file import load_model_file  # noqa: E402
from planner.profile import profile_model  # noqa: E402
from planner.search.search import run_search  # noqa: E402
from planner.search.space import Fixed  # noqa: E402

RUNS = Path(__file__).resolve().parents[2] / "shared" / "reference" / "published_runs.yaml"
GPUS = {"A100-SXM4-80GB": "a100-80gb", "A100-SXM4-40GB": "a100-40gb", "H100-SXM5-80GB": "h100-sxm-80gb"}

MODEL_FILE = """
import sys
sys.path.insert(0, {examples!r})
import torch
import torch.nn.functional as F
import gpt
from gpt import GPTConfig, build_gpt, gpt_batch


def megatron_attention(self, x):
    # Megatron-LM's attention (2021-22): q scaled, one bmm for the scores, ONE fused
    # scale-mask-softmax kernel (a single pass over the s x s scores; the causal mask is applied
    # inside it, so it costs what a plain softmax costs), dropout, bmm. No flash attention.
    B, T, C = x.shape
    q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2) * self.head_dim ** -0.5
    k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
    v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
    att = self.attn_dropout(F.softmax(q @ k.transpose(-2, -1), dim=-1))
    y = (att @ v).transpose(1, 2).reshape(B, T, -1)
    return self.resid_dropout(self.proj(y))


gpt.CausalSelfAttention.forward = megatron_attention
CFG = GPTConfig(vocab={vocab}, seq_len={seq}, n_layer={layers}, n_head={heads}, n_embd={hidden},
                dropout=0.1, attn="math")
def build_model():
    return build_gpt(CFG)
def sample_batch(b):
    return gpt_batch(CFG, b)
"""


def value(x):
    return x.get("value") if isinstance(x, dict) else x


def load_rows() -> list[dict]:
    rows = []
    for e in yaml.safe_load(RUNS.read_text())["entries"]:
        measured = value(e.get("measured", {}).get("step_time_s")) or value(e.get("derived", {}).get("step_time_s"))
        if measured is None or value(e.get("global_batch")) is None:
            continue
        p = e["parallel"]
        inter = p.get("interleaving")
        if isinstance(inter, dict) and "model_chunks_per_gpu" in inter:
            v = inter["model_chunks_per_gpu"]
        elif isinstance(value(inter), int):
            v = value(inter)
        else:
            v = 1
        recompute = str(value(p.get("recompute"))).split()[0]
        rows.append(
            dict(
                id=e["id"], model=e["model"], gpu=GPUS[e["hardware"]["gpu"]], gpus=e["hardware"]["gpus"],
                gpus_per_node=e["hardware"]["gpus_per_node"], global_batch=value(e["global_batch"]),
                micro_batch=value(e["micro_batch"]), tp=value(p["tp"]), pp=value(p["pp"]), dp=value(p["dp"]),
                v=v, recompute=recompute, measured=float(measured),
                precision="fp16" if "fp16" in str(e.get("precision")) else "bf16",
            )
        )
    return rows


_profiles: dict[tuple, object] = {}


def profile_for(row: dict, tmp: Path):
    m = row["model"]
    key = (m["layers"], m["hidden"], m["heads"], m["seq_len"], value(m["vocab"]), row["precision"])
    if key not in _profiles:
        path = tmp / f"gpt_{'_'.join(map(str, key))}.py"
        path.write_text(MODEL_FILE.format(examples=str(ROOT / "examples"), vocab=key[4], seq=key[3], layers=key[0], heads=key[2], hidden=key[1]))
        _profiles[key] = profile_model(load_model_file(path), dtype=row["precision"], measure=False)
    return _profiles[key]


def predict(row: dict, profile, free: bool):
    cluster = make_cluster(row["gpu"], row["gpus"], row["gpus_per_node"])
    training = Training(row["precision"], "adamw", row["global_batch"], cluster.gpu.memory_bytes)
    if free:
        fixed = Fixed()
    else:
        fixed = Fixed(
            tp=row["tp"], pp=row["pp"], dp=row["dp"], micro_batch=row["micro_batch"], zero=0,
            schedule="interleaved" if row["v"] > 1 else "1f1b", virtual_stages=row["v"] if row["v"] > 1 else None,
            recompute=row["recompute"],
        )
    return run_search(profile, cluster, training, fixed, top_k=1)


def table(rows: list[dict], tmp: Path, free: bool = True) -> list[float]:
    errors = []
    print(f"{'run':38s} {'measured':>9s} {'predicted':>9s} {'error':>7s}   free search (same model, cluster, batch)")
    for row in rows:
        profile = profile_for(row, tmp)
        fixed = predict(row, profile, free=False)
        if fixed.best is None:
            print(f"{row['id']:38s} {row['measured']:9.2f} {'no fit':>9s}  (needs {fixed.min_need_bytes / 1e9:.0f} GB)")
            errors.append(float("inf"))
            continue
        pred = fixed.best.step_time_s
        err = pred / row["measured"] - 1
        errors.append(err)
        line = f"{row['id']:38s} {row['measured']:9.2f} {pred:9.2f} {err:+7.1%}"
        if free:
            t0 = time.perf_counter()
            search = predict(row, profile, free=True)
            dt = time.perf_counter() - t0
            if search.best is not None:
                b = search.best
                line += f"   {b.step_time_s:7.2f} s ({b.step_time_s / pred:.2f}x) in {dt:4.1f} s: {b.cand.label()}"
            else:
                line += f"   nothing found in {dt:.1f} s"
        print(line, flush=True)
    finite = [abs(e) for e in errors if e != float("inf")]
    print(f"\nrows {len(errors)}; median |error| {statistics.median(finite):.1%}; worst {max(finite):.1%}")
    return errors


def fit(rows: list[dict], tmp: Path) -> None:
    """Grid over the two compute efficiencies: minimise the worst, then the median, |log error|.
    Each row's stages and recompute are solved once; the grid re-evaluates that assignment."""
    import math

    from planner.cost.evaluate import evaluate
    from planner.cost.stage_costs import stage_costs

    solved = []
    for row in rows:
        r = predict(row, profile_for(row, tmp), free=False)
        solved.append((row, r.best))
    best = None
    for mm in [0.5 + 0.02 * i for i in range(26)]:
        for mem in [0.3 + 0.05 * i for i in range(13)]:
            compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY = mm, mem
            errs = []
            for row, b in solved:
                cluster = make_cluster(row["gpu"], row["gpus"], row["gpus_per_node"])
                training = Training(row["precision"], "adamw", row["global_batch"], cluster.gpu.memory_bytes)
                costs = stage_costs(profile_for(row, tmp), cluster, training, b.cand)
                ev = evaluate(costs, list(b.partition.bounds), list(b.partition.choice))
                errs.append(abs(math.log(ev.step_time_s / row["measured"])))
            score = (max(errs), statistics.median(errs))
            if best is None or score < best[0]:
                best = (score, mm, mem)
                print(f"matmul {mm:.2f} memory {mem:.2f}: worst {math.exp(score[0]) - 1:.1%} median {math.exp(score[1]) - 1:.1%}", flush=True)
    print(f"best: MATMUL_EFFICIENCY = {best[1]:.2f}, MEMORY_EFFICIENCY = {best[2]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="grid-search the compute efficiencies")
    ap.add_argument("--no-free", action="store_true", help="skip the free search column")
    args = ap.parse_args()
    rows = load_rows()
    with tempfile.TemporaryDirectory() as tmp:
        if args.fit:
            fit(rows, Path(tmp))
        else:
            table(rows, Path(tmp), free=not args.no_free)


if __name__ == "__main__":
    main()
