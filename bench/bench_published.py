"""The cost model against published training runs (bench/reference/published_runs.yaml).

For every row: build the model the row describes on fake tensors (profiled once per shape), fix
the published configuration (tp, pp, dp, micro-batch, ZeRO/FSDP stage, schedule, recompute) on
the row's cluster (its GPU, GPU count, GPUs per node and, when given, inter-node bandwidth per
GPU), predict step time and peak memory, and compare with what was measured. Prints one table,
then per source and overall: count, median and worst |error| for step time and peak memory, the
rows the cost model refused ("nothing fits"), and how many rows were approximated.

    python bench/bench_published.py             # the table (about a minute on 2 cores)
    python bench/bench_published.py --free      # + the free search's own plan for each row
    python bench/bench_published.py --fit       # grid-search MATMUL/MEMORY_EFFICIENCY on all rows
    python bench/bench_published.py --loso      # leave one source out: fit on the others, predict it
    python bench/bench_published.py --only megatron_lm,torchtitan   # some sources only

Models (examples/gpt.py and examples/llama.py, built per row):
- GPT rows: examples/gpt.py at the row's shape. Sources from 2021-22 (Narayanan et al. SC'21,
  Korthikanti et al.) ran Megatron-LM before flash attention (Dao et al. 2022) reached it:
  attention scores materialised, one fused scale-mask-softmax pass, dropout 0.1. Later sources
  (Megatron-Core r0.8, 2024) run fused flash attention: SDPA, whose dropout regenerates its mask
  from the RNG state and saves nothing (so the SDPA call here runs without dropout; the hidden
  dropout of 0.1, Megatron's default, stays).
- Llama rows (torchtitan): examples/llama.py (GQA, SwiGLU, RMSNorm, RoPE, untied head, SDPA
  flash attention as torchtitan runs it).
- MPT rows (llm-foundry): bias-free pre-LayerNorm GPT blocks of examples/gpt.py, tied embedding
  and head, no learned positions, SDPA flash attention, no dropout. Approximated: ALiBi's bias is
  fused into MPT's flash-attention kernel; SDPA cannot add it without leaving the flash path, so
  it is left out (a few FLOPs per attention score). MPT's fused Wqkv is three Linears here (same
  FLOPs).

What the cost model cannot express yet is predicted with the nearest configuration it can, and
named in the note column (these rows are counted apart in the summary, so work that removes a
note shows up as better numbers): fp8 (run as bf16), context parallelism (folded into tensor
parallelism when the degree is legal inside a node, else into data parallelism), sequence
parallelism off (the cost model always shards activations with TP), async TP / TP overlap (TP
communication counted exposed), torch.compile (eager op costs), Megatron's selective recompute
(attention core only; the cost model's selective keeps matmul outputs), a GPU that is not in the
catalogue (the nearest entry with the row's memory and HBM bandwidth). Figures a row does not
publish (micro-batch, recompute, schedule) are left to the search, and said so.

--fit re-evaluates each row's solved assignment (stages, recompute) under each grid point, as
the planner's constants are read at evaluation time (planner/cost/compute.py); the objective is
the mean |log(predicted / measured)| over the rows fitted.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner.cost import compute as compute_mod  # noqa: E402
from planner.cost.evaluate import evaluate  # noqa: E402
from planner.cost.setup import Training  # noqa: E402
from planner.cost.stage_costs import stage_costs  # noqa: E402
from planner.hardware import Cluster, GPUSpec, load_catalogue, make_cluster  # noqa: E402
from planner.model_file import load_model_file  # noqa: E402
from planner.profile import profile_model  # noqa: E402
from planner.search.search import run_search  # noqa: E402
from planner.search.space import Fixed  # noqa: E402

REFERENCE = Path(__file__).resolve().parent / "reference" / "published_runs.yaml"
GIB = 2**30


def value(x):
    """A plain scalar, or the value of an {value, uncertain, note} entry."""
    return x.get("value") if isinstance(x, dict) else x


# -- the rows -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """The model a row describes; equal shapes share one profile."""

    arch: str
    """"gpt", "llama" or "mpt"."""
    attention: str
    """"materialised" (Megatron-LM 2021-22) or "flash"."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq_len: int
    vocab: int


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    """The paper or repository the row comes from (source_group)."""
    shape: Shape
    gpu: GPUSpec
    """The catalogue GPU with the row's own figures where it gives them (inter-node bandwidth)."""
    num_gpus: int
    gpus_per_node: int
    precision: str
    global_batch: int
    fixed: Fixed
    measured_step_s: float
    measured_peak_bytes: float | None
    notes: tuple[str, ...]
    """What the cost model cannot express and was approximated."""
    assumed: tuple[str, ...]
    """Figures the row does not publish, left to the search or assumed."""

    def cluster(self) -> Cluster:
        return make_cluster(self.gpu, self.num_gpus, self.gpus_per_node)

    def training(self) -> Training:
        return Training(self.precision, "adamw", self.global_batch, self.gpu.memory_bytes)

    def config(self) -> str:
        f = self.fixed
        out = f"tp{f.tp} pp{f.pp} dp{f.dp} mb{f.micro_batch or '?'} z{f.zero}"
        if f.pp and f.pp > 1:
            out += f" {f.schedule or '?'}" + (f"x{f.virtual_stages}" if f.virtual_stages else "")
        return out + f" rc={f.recompute or '?'}"


def _year(text: str) -> int | None:
    m = re.search(r"\b(20\d\d)\b", text)
    return int(m.group(1)) if m else None


def source_group(entries: list[dict]) -> dict[str, str]:
    """id -> source group: the repository (owner/name -> name), or the paper (first author and
    year), split by the table a row comes from when a paper's rows come from several tables."""
    pub, table = {}, {}
    for e in entries:
        src = e["source"]
        if src.get("repo"):
            pub[e["id"]] = src["repo"].split("/")[-1].lower().replace("-", "_")
            continue
        author = src["paper"].split()[0].lower()
        pub[e["id"]] = f"{author}{_year(src['paper']) or ''}"
        m = re.match(r"\s*Table (\d+)", src.get("where", ""))
        table[e["id"]] = m.group(1) if m else None
    tables_of: dict[str, set] = {}
    for i, t in table.items():
        if t:
            tables_of.setdefault(pub[i], set()).add(t)
    return {
        i: p + (f"_t{table[i]}" if table.get(i) and len(tables_of.get(p, ())) > 1 else "")
        for i, p in pub.items()
    }


def _shape(e: dict) -> Shape:
    m = e["model"]
    arch_text = str(value(m.get("arch", "")))
    if "MPT" in arch_text:
        arch = "mpt"
    elif m.get("kv_heads") is not None or "llama" in arch_text.lower():
        arch = "llama"
    else:
        arch = "gpt"
    src = e["source"]
    year = _year(str(src.get("paper", ""))) or _year(str(src.get("path", "")))
    # Flash attention (Dao et al., 2022) reached Megatron-LM in 2023; llm-foundry and torchtitan
    # run it always.
    attention = "materialised" if arch == "gpt" and year is not None and year <= 2022 else "flash"
    heads = value(m["heads"])
    return Shape(
        arch=arch,
        attention=attention,
        layers=value(m["layers"]),
        hidden=value(m["hidden"]),
        heads=heads,
        kv_heads=value(m.get("kv_heads")) or heads,
        ffn=value(m.get("ffn_hidden")) or 4 * value(m["hidden"]),
        seq_len=value(m["seq_len"]),
        vocab=value(m["vocab"]),
    )


_GB_PER_S = re.compile(r"(\d+(?:\.\d+)?)\s*Gb(?:/s|ps)", re.I)


def inter_node_Bps(text: str | None, gpus_per_node: int) -> float | None:
    """Per-GPU, per-direction bytes/s from the row's inter-node link text ("400 Gb/s per GPU",
    "8x 400 Gb/s ... per node", "1600 Gbps ... per node (=200 Gb/s per GPU)"), or None."""
    if not text:
        return None
    per_gpu = re.search(r"(\d+(?:\.\d+)?)\s*Gb(?:/s|ps) per GPU", text)
    if per_gpu:
        return float(per_gpu.group(1)) * 1e9 / 8
    nics = re.search(r"(\d+)x\s*(\d+(?:\.\d+)?)\s*Gb(?:/s|ps)", text)
    if nics and "per node" in text:
        return int(nics.group(1)) * float(nics.group(2)) * 1e9 / 8 / gpus_per_node
    total = _GB_PER_S.search(text)
    if total and "per node" in text:
        return float(total.group(1)) * 1e9 / 8 / gpus_per_node
    return None


def gpu_of(hw: dict, catalogue: dict[str, GPUSpec]) -> tuple[GPUSpec, str | None]:
    """The catalogue GPU a row names (family and memory), with the row's figures replacing the
    catalogue's where it gives them; and a note when the GPU itself is not in the catalogue."""
    text = str(value(hw["gpu"]))
    family = re.search(r"(A100|H100|H200|V100|L40S|MI300X|RTX ?4090)", text, re.I)
    assert family, f"unknown GPU in the reference: {text!r}"
    fam = family.group(1).lower().replace(" ", "")
    names = sorted(n for n in catalogue if n.startswith(fam))
    assert names, f"no {fam} in the catalogue for {text!r}"
    mem = re.search(r"(\d+)\s*GB", text)
    same = [n for n in names if mem is None or round(catalogue[n].memory_gb) == int(mem.group(1))]
    note = None
    if same:
        spec = catalogue[same[0]]
    else:  # a variant the catalogue lacks: the family's entry with the row's memory (and HBM)
        spec = catalogue[names[-1]]
        spec = replace(spec, memory_bytes=int(int(mem.group(1)) * 1e9))
        hbm = re.search(r"(\d+(?:\.\d+)?)\s*TB/s", text)
        if hbm:
            spec = replace(spec, hbm_bandwidth_Bps=float(hbm.group(1)) * 1e12)
        note = f"GPU {mem.group(1)}GB variant: {spec.name} peaks"
    bw = inter_node_Bps(value(hw.get("inter_node_link")), hw["gpus_per_node"])
    if bw is not None and bw != spec.inter_node_bandwidth_Bps:
        spec = replace(spec, inter_node_bandwidth_Bps=bw)
    return spec, note


def korthikanti_model_flops(shape: Shape, batch: int) -> float:
    """Model FLOPs of one step: 72 B s l h^2 (1 + s/6h + V/12lh) (Korthikanti et al. 2022;
    formulas.yaml korthikanti_model_flops_per_iteration; GPT with MHA and ffn = 4h)."""
    s, l, h, V = shape.seq_len, shape.layers, shape.hidden, shape.vocab
    return 72 * batch * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def measured_step(e: dict, shape: Shape, global_batch: int, gpus: int) -> float:
    """The measured step time, or derived from what was published: a step time, tokens/s per
    GPU, or model TFLOP/s per GPU (MFU x peak) with the model-FLOPs formula."""
    m, d = e.get("measured") or {}, e.get("derived") or {}
    for x in (m.get("step_time_s"), d.get("step_time_s")):
        if value(x):
            return float(value(x))
    tps = value(m.get("tokens_per_s_per_gpu"))
    if tps:
        return global_batch * shape.seq_len / (tps * gpus)
    tflops = value(d.get("model_tflops_per_gpu"))
    if tflops is None and value(m.get("mfu")) and value(m.get("peak_used_tflops")):
        tflops = value(m["mfu"]) * value(m["peak_used_tflops"])
    assert tflops and shape.arch == "gpt", f"{e['id']}: no step time, throughput or GPT MFU"
    return korthikanti_model_flops(shape, global_batch) / (tflops * 1e12 * gpus)


def _zero(p: dict, notes: list[str]) -> int:
    text = str(value(p.get("zero"))).lower()
    if "hsdp" in text or "hybrid" in text:
        notes.append("HSDP as FSDP")
    if value(p.get("fsdp")) or "zero-3" in text or "full_shard" in text or "full shard" in text:
        return 3
    if "zero-2" in text or "shard_grad_op" in text:
        return 2
    if "zero-1" in text or "distributed optimizer" in text:
        return 1
    return 0


def _recompute(p: dict, shape: Shape, notes: list[str], assumed: list[str]) -> str | None:
    text = value(p.get("recompute"))
    if text is None:
        assumed.append("recompute free")
        return None
    kind = str(text).split()[0].lower()
    assert kind in ("none", "selective", "full"), f"recompute {text!r}"
    # Megatron-LM's only selective mode recomputes the attention core (Korthikanti et al. 2022);
    # the GPT rows are Megatron-LM runs. torchtitan's is per-op (save matmuls), as the cost model's.
    if kind == "selective" and ("attention core" in str(text) or shape.arch == "gpt"):
        notes.append("attn-core selective as save-matmuls")
    return kind


def _schedule(p: dict, pp: int, assumed: list[str]) -> tuple[str | None, int | None]:
    if pp == 1:
        return None, None
    inter = p.get("interleaving")
    if isinstance(inter, dict) and "model_chunks_per_gpu" in inter:
        v = inter["model_chunks_per_gpu"]
        return ("interleaved", v) if v > 1 else ("1f1b", None)
    v = value(inter)
    if isinstance(v, int):
        return ("interleaved", v) if v > 1 else ("1f1b", None)
    if v is None:
        assumed.append("schedule free")
        return None, None
    assert "1f1b" in str(v).lower() or str(v).lower().startswith("none"), f"interleaving {v!r}"
    return "1f1b", None


def _fits_tp(shape: Shape, tp: int) -> bool:
    return all(x % tp == 0 for x in (shape.heads, shape.kv_heads, shape.hidden, shape.ffn))


def make_row(e: dict, source: str, catalogue: dict[str, GPUSpec]) -> Row:
    notes: list[str] = []
    assumed: list[str] = []
    shape = _shape(e)
    hw = e["hardware"]
    gpus, per_node = hw["gpus"], hw["gpus_per_node"]
    gpu, gpu_note = gpu_of(hw, catalogue)
    if gpu_note:
        notes.append(gpu_note)
    precision_text = str(value(e.get("precision"))).lower()
    precision = "fp16" if "fp16" in precision_text else "bf16"  # same peak on every GPU here
    if "fp8" in precision_text:
        notes.append("fp8 as bf16")
    p = e["parallel"]
    tp, pp, dp, cp = (int(value(p.get(k)) or 1) for k in ("tp", "pp", "dp", "cp"))
    assert tp * pp * dp * cp == gpus, f"{e['id']}: tp*pp*dp*cp != {gpus}"
    gb = value(e.get("global_batch"))
    if gb is None:
        gb = gpus
        assumed.append(f"global batch {gb} (1 per GPU)")
    mb = e.get("micro_batch")
    if isinstance(mb, dict) and "local_batch_per_dp_rank" in mb:
        local = mb["local_batch_per_dp_rank"]  # no gradient accumulation: one step per local batch
        micro = local // pp if pp > 1 else local
        if pp > 1:
            assumed.append(f"{pp} pipeline micro-batches (torchtitan default)")
    else:
        micro = value(mb)
        if micro is None:
            assumed.append("micro-batch free")
    if value(p.get("sequence_parallel")) is False and tp > 1:
        notes.append("SP off as SP on")
    if value(p.get("async_tp")) and tp > 1:
        notes.append("async TP")
    if "tp-comm-overlap" in str(value(p.get("overlap"))) and tp > 1:
        notes.append("TP overlap")
    if value(p.get("torch_compile")):
        notes.append("compile")
    zero = _zero(p, notes)
    if cp > 1:  # context parallelism: nearest expressible split of each sequence's work
        if tp * cp <= per_node and _fits_tp(shape, tp * cp):
            notes.append(f"CP{cp} as TP")
            tp *= cp
        else:
            notes.append(f"CP{cp} as DP")
            dp *= cp
            micro = max(1, min(micro or 1, gb // dp))
    recompute = _recompute(p, shape, notes, assumed)
    schedule, v = _schedule(p, pp, assumed)
    fixed = Fixed(
        tp=tp, pp=pp, dp=dp, micro_batch=micro, zero=zero if dp > 1 else 0,
        schedule=schedule, virtual_stages=v, recompute=recompute,
    )
    peak_gib = value((e.get("measured") or {}).get("peak_memory_gib"))
    return Row(
        id=e["id"], source=source, shape=shape, gpu=gpu, num_gpus=gpus, gpus_per_node=per_node,
        precision=precision, global_batch=gb, fixed=fixed,
        measured_step_s=measured_step(e, shape, gb, gpus),
        measured_peak_bytes=peak_gib * GIB if peak_gib else None,
        notes=tuple(notes), assumed=tuple(assumed),
    )


def load_rows(path: Path = REFERENCE) -> list[Row]:
    entries = yaml.safe_load(path.read_text())["entries"]
    groups = source_group(entries)
    catalogue = load_catalogue()
    return [make_row(e, groups[e["id"]], catalogue) for e in entries]


# -- the models ---------------------------------------------------------------------------------
_HEADER = """
import sys
sys.path.insert(0, {examples!r})
import torch
import torch.nn.functional as F
from torch import nn
"""

_GPT = """
import gpt
from gpt import GPTConfig, build_gpt, gpt_batch
{attention}
CFG = GPTConfig(vocab={vocab}, seq_len={seq}, n_layer={layers}, n_head={heads}, n_embd={hidden},
                dropout=0.1, attn={attn!r})
def build_model():
    model = build_gpt(CFG)
    for block in model.blocks:  # this model's attention modules only (gpt.py stays as it is)
        block.attn.__class__ = Attention
    return model
def sample_batch(b):
    return gpt_batch(CFG, b)
"""

MEGATRON_ATTENTION = """
class Attention(gpt.CausalSelfAttention):
    def forward(self, x):
        # Megatron-LM's attention (2021-22): q scaled, one bmm for the scores, ONE fused
        # scale-mask-softmax kernel (a single pass over the s x s scores; the causal mask is
        # applied inside it, so it costs what a plain softmax costs), dropout, bmm. No flash
        # attention.
        B, T, C = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2) * self.head_dim ** -0.5
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        att = self.attn_dropout(F.softmax(q @ k.transpose(-2, -1), dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y))
"""

FLASH_ATTENTION = """
class Attention(gpt.CausalSelfAttention):
    def forward(self, x):
        # Fused flash attention (Megatron-Core with Transformer Engine): its dropout regenerates
        # the mask from the RNG state and saves nothing, so SDPA runs here without dropout (with
        # it, SDPA's CPU path would save an s x s mask).
        B, T, C = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)))
"""

_MPT = """
from gpt import Block, GPTConfig, gpt_batch

CFG = GPTConfig(vocab={vocab}, seq_len={seq}, n_layer={layers}, n_head={heads}, n_embd={hidden},
                dropout=0.0, attn="sdpa", bias=False)


class MPT(nn.Module):
    # llm-foundry MPT: tied embedding and head, no position embedding (ALiBi, left out: fused in
    # its flash-attention kernel), bias-free pre-LayerNorm blocks, ffn 4h with GELU, no dropout.
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model():
    return MPT(CFG)


def sample_batch(b):
    return gpt_batch(CFG, b)
"""

_LLAMA = """
from llama import LlamaConfig, build_llama, llama_batch

CFG = LlamaConfig(dim={hidden}, n_layers={layers}, n_heads={heads}, n_kv_heads={kv_heads},
                  ffn_dim={ffn}, vocab={vocab}, seq_len={seq}, rope_theta=500000.0)
def build_model():
    return build_llama(CFG)
def sample_batch(b):
    return llama_batch(CFG, b)
"""


def model_source(shape: Shape) -> str:
    """The model file (build_model, sample_batch) of a row's shape."""
    s = shape
    fields = dict(vocab=s.vocab, seq=s.seq_len, layers=s.layers, heads=s.heads, hidden=s.hidden, kv_heads=s.kv_heads, ffn=s.ffn)
    head = _HEADER.format(examples=str(ROOT / "examples"))
    if s.arch == "llama":
        return head + _LLAMA.format(**fields)
    assert s.ffn == 4 * s.hidden, f"{s}: examples/gpt.py's MLP is 4h wide"
    assert s.kv_heads == s.heads, f"{s}: examples/gpt.py has no grouped-query attention"
    if s.arch == "mpt":
        return head + _MPT.format(**fields)
    if s.attention == "materialised":
        return head + _GPT.format(attention=MEGATRON_ATTENTION, attn="math", **fields)
    return head + _GPT.format(attention=FLASH_ATTENTION, attn="sdpa", **fields)


def _profile(source: str, dtype: str):
    """Profile a model file's text on fake tensors (run in a worker process)."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.py"
        path.write_text(source)
        return profile_model(load_model_file(path), dtype=dtype, measure=False, force_meta=True)


class Profiles:
    """Profiles by shape (and tensor width), made on fake tensors once each per run."""

    def __init__(self) -> None:
        self.cache: dict[tuple, object] = {}
        self.seconds = 0.0

    @staticmethod
    def key(row: Row) -> tuple:
        # bf16 and fp16 profiles are the same (2-byte tensors, same FLOPs): one serves both
        return row.shape, "bf16" if row.precision in ("bf16", "fp16") else row.precision

    def prefetch(self, rows: list[Row], workers: int) -> None:
        """Profile every shape the rows need, `workers` at a time (one thread each)."""
        todo = list(dict.fromkeys(k for k in map(self.key, rows) if k not in self.cache))
        if not todo:
            return
        start = time.perf_counter()
        print(f"profiling {len(todo)} models on {workers} process(es) ...", file=sys.stderr, flush=True)
        if workers <= 1:
            for key in todo:
                self.cache[key] = _profile(model_source(key[0]), key[1])
        else:
            import concurrent.futures
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                # largest first, so the long ones do not come last
                todo.sort(key=lambda k: -k[0].layers * k[0].hidden**2 * k[0].seq_len)
                futures = {key: pool.submit(_profile, model_source(key[0]), key[1]) for key in todo}
                for key, future in futures.items():
                    self.cache[key] = future.result()
        self.seconds += time.perf_counter() - start

    def get(self, row: Row):
        if self.key(row) not in self.cache:
            self.prefetch([row], workers=1)
        return self.cache[self.key(row)]


# -- prediction ---------------------------------------------------------------------------------
@dataclass
class Result:
    row: Row
    scored: object | None
    """The planner's Scored plan for the published configuration, None when refused."""
    need_bytes: float | None
    """When refused: the least memory per GPU the configuration needs."""
    seconds: float
    free: object | None = None
    free_s: float | None = None

    @property
    def step_s(self) -> float | None:
        return self.scored.step_time_s if self.scored else None

    @property
    def peak_bytes(self) -> float | None:
        return self.scored.evaluation.peak_bytes if self.scored else self.need_bytes

    @property
    def error(self) -> float | None:
        return self.step_s / self.row.measured_step_s - 1 if self.scored else None

    @property
    def memory_error(self) -> float | None:
        m = self.row.measured_peak_bytes
        return self.peak_bytes / m - 1 if m and self.peak_bytes else None


def predict(row: Row, profile, free: bool = False) -> Result:
    cluster, training = row.cluster(), row.training()
    start = time.perf_counter()
    found = run_search(profile, cluster, training, row.fixed, top_k=1)
    result = Result(row, found.best, None if found.best else found.min_need_bytes, time.perf_counter() - start)
    if free:
        start = time.perf_counter()
        result.free = run_search(profile, cluster, training, Fixed(), top_k=1).best
        result.free_s = time.perf_counter() - start
    return result


def predict_all(rows: list[Row], profiles: Profiles, free: bool = False) -> list[Result]:
    return [predict(row, profiles.get(row), free) for row in rows]


# -- reporting ----------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return f"{x:+.0%}" if x is not None else "-"


def _gib(x: float | None) -> str:
    return f"{x / GIB:.1f}" if x else "-"


def plan_label(scored) -> str:
    c = scored.cand
    out = f"tp{c.tp} pp{c.pp} dp{c.dp} mb{c.micro_batch} z{c.zero}"
    if c.pp > 1:
        out += f" {c.schedule}" + (f"x{c.virtual_stages}" if c.schedule == "interleaved" else "")
    choice = set(scored.partition.choice)
    rc = "full" if choice == {2} else "selective" if choice == {1} else "none" if choice == {0} else "mixed"
    return out + f" rc={rc}"


def print_table(results: list[Result]) -> None:
    head = (
        f"{'id':44s} {'source':17s} {'GPU x count':20s} {'config (as predicted)':42s} {'meas s':>8s} "
        f"{'pred s':>8s} {'err':>6s} {'meas GiB':>8s} {'pred GiB':>8s} {'err':>6s}  note"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        row = r.row
        gpu = f"{row.gpu.name} x{row.num_gpus}"
        if r.scored is None:
            config, pred, err = row.config(), "refused", f"(needs {r.need_bytes / GIB:.0f} GiB)" if r.need_bytes else ""
        else:
            config, pred, err = plan_label(r.scored), f"{r.step_s:8.2f}", _pct(r.error)
        mem_pred = ("≥" if r.scored is None and r.need_bytes else "") + _gib(r.peak_bytes)
        note = "; ".join(row.notes + tuple(f"[{a}]" for a in row.assumed))
        print(
            f"{row.id:44s} {row.source:17s} {gpu:20s} {config:42s} {row.measured_step_s:8.2f} {pred:>8s} "
            f"{err:>6s} {_gib(row.measured_peak_bytes):>8s} {mem_pred:>8s} {_pct(r.memory_error):>6s}  {note}"
        )
        if r.free_s is not None:
            if r.free is None:
                print(f"{'':44s}   free search: nothing found in {r.free_s:.1f} s")
            elif r.step_s is None:
                print(f"{'':44s}   free search: {plan_label(r.free)}  {r.free.step_time_s:.2f} s in {r.free_s:.1f} s")
            else:
                ratio = r.free.step_time_s / r.step_s
                flag = "  <- over 1.3x faster than the published config: a symptom" if ratio < 1 / 1.3 else ""
                print(
                    f"{'':44s}   free search: {plan_label(r.free)}  {r.free.step_time_s:.2f} s "
                    f"({ratio:.2f}x the published config's prediction) in {r.free_s:.1f} s{flag}"
                )


def _stats(errors: list[float]) -> str:
    errors = [abs(e) for e in errors if e is not None]
    if not errors:
        return f"{'-':>3s} {'-':>7s} {'-':>7s}"
    return f"{len(errors):3d} {statistics.median(errors):7.1%} {max(errors):7.1%}"


def print_summary(results: list[Result]) -> None:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.row.source, []).append(r)
    groups["overall"] = results
    print(
        f"\n{'source':17s} {'rows':>4s} {'refused':>7s} {'approx':>6s} {'assumed':>7s} | "
        f"{'step: n':>7s} {'median':>7s} {'worst':>7s} | {'exact: n':>8s} {'median':>7s} {'worst':>7s} | "
        f"{'memory: n':>9s} {'median':>7s} {'worst':>7s}"
    )
    for name, rs in groups.items():
        exact = [r.error for r in rs if not r.row.notes]
        print(
            f"{name:17s} {len(rs):4d} {sum(r.scored is None for r in rs):7d} {sum(bool(r.row.notes) for r in rs):6d} "
            f"{sum(bool(r.row.assumed) for r in rs):7d} | {_stats([r.error for r in rs]):>23s} | "
            f"{_stats(exact):>24s} | {_stats([r.memory_error for r in rs]):>25s}"
        )
    print(
        "\nstep/memory: |predicted / measured - 1| over the rows predicted (refused rows have no step time;"
        "\ntheir memory error uses the least memory they need); exact: rows without an approximation note;"
        "\napprox: rows with a note (what the cost model cannot express); assumed: rows with figures"
        "\nnot published ([...] in the note: left to the search or assumed)."
    )


# -- fitting the compute efficiencies -----------------------------------------------------------
MATMUL_GRID = [round(0.50 + 0.02 * i, 2) for i in range(26)]
MEMORY_GRID = [round(0.30 + 0.05 * i, 2) for i in range(13)]


def grid_errors(results: list[Result], profiles: Profiles) -> dict[tuple[float, float], list[float]]:
    """(matmul, memory) -> |log(predicted / measured)| per predicted row, each row's assignment
    (stages, recompute) re-evaluated under the grid point's efficiencies."""
    saved = compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY
    setups = [(r, r.row.cluster(), r.row.training(), profiles.get(r.row)) for r in results if r.scored]
    out = {}
    try:
        for mm in MATMUL_GRID:
            for mem in MEMORY_GRID:
                compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY = mm, mem
                errs = []
                for r, cluster, training, profile in setups:
                    b = r.scored
                    costs = stage_costs(profile, cluster, training, b.cand)
                    ev = evaluate(costs, list(b.partition.bounds), list(b.partition.choice))
                    errs.append(math.log(ev.step_time_s / r.row.measured_step_s))
                out[mm, mem] = errs
    finally:
        compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY = saved
    return out


def best_point(grid: dict[tuple[float, float], list[float]], keep: list[bool]) -> tuple[float, float] | None:
    """The grid point with the least mean |log error| over the kept rows (None: no row kept)."""
    if not any(keep):
        return None

    def score(point):
        errs = [abs(e) for e, k in zip(grid[point], keep) if k]
        return sum(errs) / len(errs)

    return min(grid, key=score)


def _rel(log_errors: list[float]) -> list[float]:
    return [math.exp(e) - 1 for e in log_errors]


def fit(results: list[Result], profiles: Profiles, loso: bool) -> None:
    predicted = [r for r in results if r.scored]
    start = time.perf_counter()
    grid = grid_errors(predicted, profiles)
    print(f"\ngrid of {len(grid)} points x {len(predicted)} rows evaluated in {time.perf_counter() - start:.1f} s")
    current = (compute_mod.MATMUL_EFFICIENCY, compute_mod.MEMORY_EFFICIENCY)
    now = [math.log(r.step_s / r.row.measured_step_s) for r in predicted]
    best = best_point(grid, [True] * len(predicted))
    exact = [not r.row.notes for r in predicted]
    print(
        f"\n{'step time, constants':34s} {'matmul':>6s} {'memory':>6s} | {'all rows: n':>11s} {'median':>7s} {'worst':>7s} | "
        f"{'exact rows: n':>13s} {'median':>7s} {'worst':>7s}"
    )
    fits = [("current (planner/cost/constants)", current, now), ("fitted on all rows", best, grid[best])]
    best_exact = best_point(grid, exact)
    if best_exact is not None:
        fits.append(("fitted on exact rows (no note)", best_exact, grid[best_exact]))
    for label, point, errs in fits:
        ex = [e for e, k in zip(errs, exact) if k]
        print(f"{label:34s} {point[0]:6.2f} {point[1]:6.2f} | {_stats(_rel(errs)):>27s} | {_stats(_rel(ex)):>29s}")
    if loso:
        leave_one_source_out(predicted, grid, best)


def leave_one_source_out(predicted: list[Result], grid: dict, best: tuple[float, float]) -> None:
    """For each source: fit on the other sources' rows, predict the held-out source's rows."""
    print(
        f"\nleave one source out: fit on the other sources, predict the held-out one\n"
        f"{'held out':17s} {'matmul':>6s} {'memory':>6s} | {'held out: n':>11s} {'median':>7s} {'worst':>7s} | "
        f"{'in the all-rows fit: n':>22s} {'median':>7s} {'worst':>7s}"
    )
    held_all: list[float] = []
    for source in sorted({r.row.source for r in predicted}):
        keep = [r.row.source != source for r in predicted]
        point = best_point(grid, keep)
        if point is None:
            print(f"{source:17s} (no other source to fit on)")
            continue
        held = [e for e, k in zip(grid[point], keep) if not k]
        held_all += held
        inside = [e for e, k in zip(grid[best], keep) if not k]
        print(f"{source:17s} {point[0]:6.2f} {point[1]:6.2f} | {_stats(_rel(held)):>27s} | {_stats(_rel(inside)):>38s}")
    print(f"{'every row held out':31s} | {_stats(_rel(held_all)):>27s} | {_stats(_rel(grid[best])):>38s}")


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--free", action="store_true", help="also run the free search on each row's model, cluster and batch")
    ap.add_argument("--fit", action="store_true", help="grid-search MATMUL_EFFICIENCY and MEMORY_EFFICIENCY on all rows")
    ap.add_argument("--loso", action="store_true", help="leave one source out: fit on the others, predict it (implies --fit)")
    ap.add_argument("--only", default=None, help="comma-separated sources (or row ids) to run")
    ap.add_argument("--jobs", type=int, default=2, help="processes that profile the models (default 2)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = load_rows()
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if r.source in wanted or r.id in wanted]
    profiles = Profiles()
    profiles.prefetch(rows, workers=max(1, min(args.jobs, os.cpu_count() or 1)))
    results = predict_all(rows, profiles, free=args.free)
    print_table(results)
    print_summary(results)
    predict_s = sum(r.seconds for r in results)
    free_s = sum(r.free_s or 0.0 for r in results)
    print(
        f"\n{len(rows)} rows; {len(profiles.cache)} distinct models profiled in {profiles.seconds:.1f} s; "
        f"published configurations predicted in {predict_s:.1f} s" + (f"; free searches {free_s:.1f} s" if args.free else "")
    )
    if args.fit or args.loso:
        fit(results, profiles, loso=args.loso)
    print(f"bench took {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
