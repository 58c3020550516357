"""The published runs as rows: each entry of bench/reference/published_runs.yaml becomes a model
shape, a cluster, a fixed configuration and the measured step time and peak memory.

A row's configuration (tp, pp, dp, micro-batch, ZeRO/FSDP stage, schedule, recompute) is fixed on
the row's cluster: its GPU, GPU count, GPUs per node and, when given, inter-node bandwidth per GPU.
What the cost model cannot express yet is predicted with the nearest configuration it can, and
named in the row's notes (these rows are counted apart in the summary, so work that removes a
note shows up as better numbers): Megatron's selective recompute (attention core only; the cost
model's selective keeps matmul outputs), a pipeline schedule it lacks (zero bubble, DualPipe: as
1F1B), torchtitan's FSDP2 without resharding under a pipeline (as ZeRO-2), a GPU that is not in
the catalogue (the nearest entry with the row's memory and HBM bandwidth). What the row's trainer
does is read from its source: its FP8 recipe, whether its full recompute reruns the whole forward,
whether it fuses its memory-bound ops, its data-parallel overlap. Figures a row does not
publish (micro-batch, recompute, schedule) are left to the search, and said so (`assumed`).
A mixture-of-experts model is read from its expert fields (Megatron-LM's or Hugging Face's names)
or its arch text, with its expert parallelism, shared experts, dense first layers and multi-head
latent attention; one that no model file here builds (expert layers interleaved with dense ones)
is left out and named, never predicted as a dense model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from planner.cost.constants import VOCAB_PARALLEL_CE_BYTES
from planner.cost.setup import LOW_PRECISIONS, Training
from planner.hardware import Cluster, GPUSpec, load_catalogue, make_cluster
from planner.search.space import Fixed

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "published_runs.yaml"
GIB = 2**30


def value(x):
    """A plain scalar, or the value of an {value, uncertain, note} entry."""
    return x.get("value") if isinstance(x, dict) else x


def num(x):
    """value(x), a number written as text ("1,536", "8") read as one; other text as it is."""
    v = value(x)
    if isinstance(v, str):
        text = v.replace(",", "").replace("_", "").strip()
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
    return v


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
    head_dim: int = 0
    """Width of one attention head where the model sets it apart from hidden / heads (0: that)."""
    experts: int = 0
    """Mixture of experts: the routed experts of each layer's MLP (0: a dense MLP of `ffn`)."""
    top_k: int = 0
    """Experts each token is routed to."""
    # with experts, `ffn` is one expert's hidden width
    shared_ffn: int = 0
    """Width of the shared experts every token also runs (DeepSeek, Qwen2-MoE), all of them as one."""
    dense_layers: int = 0
    """Layers before the first expert layer, with a dense MLP of `dense_ffn` (DeepSeek-V3: 3)."""
    dense_ffn: int = 0
    moe_every: int = 1
    """After the dense layers, an expert layer every this many (the others dense, of `dense_ffn`):
    Llama 4 Maverick's interleave_moe_layer_step 2 makes layers 1, 3, 5, ... its expert layers."""
    mla: tuple[int, ...] = ()
    """Multi-head latent attention: (q_lora_rank (0: none), kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim); () for grouped-query attention."""


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    """The paper or repository the row comes from (source_group); its expert models apart ("_moe")."""
    shape: Shape
    gpu: GPUSpec
    """The catalogue GPU with the row's own figures where it gives them (inter-node bandwidth)."""
    num_gpus: int
    gpus_per_node: int | None
    """The GPUs of one NVLink domain; None: the catalogue's (a rack-scale part's, make_cluster)."""
    precision: str
    global_batch: int
    fixed: Fixed
    measured_step_s: float
    measured_peak_bytes: float | None
    notes: tuple[str, ...]
    """What the cost model cannot express and was approximated."""
    assumed: tuple[str, ...]
    """Figures the row does not publish, left to the search or assumed."""
    trainer: str = "this"
    """The trainer the publication names, as the cost model knows it (Training.for_trainer)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """Training fields the row's own text sets over its trainer's (its overlap, torch_compile)."""

    def cluster(self) -> Cluster:
        return make_cluster(self.gpu, self.num_gpus, self.gpus_per_node)

    def training(self) -> Training:
        return Training.for_trainer(self.trainer, self.precision, "adamw", self.global_batch, self.gpu.memory_bytes,
                                    **dict(self.settings))

    def config(self) -> str:
        f = self.fixed
        out = (f"tp{f.tp} pp{f.pp} dp{f.dp}" + (f" cp{f.cp}" if f.cp and f.cp > 1 else "") + (f" ep{f.ep}" if f.ep and f.ep > 1 else "")
               + f" mb{f.micro_batch or '?'} z{f.zero}")
        if f.pp and f.pp > 1:
            out += f" {f.schedule or '?'}" + (f"x{f.virtual_stages}" if f.virtual_stages else "")
        return out + f" rc={f.recompute or '?'}"


def _year(text: str) -> int | None:
    m = re.search(r"\b(20\d\d)\b", text)
    return int(m.group(1)) if m else None


def publication(e: dict) -> str:
    """The repository (owner/name -> name) or the paper (first author and year) of an entry."""
    src = e["source"]
    if src.get("repo"):
        return src["repo"].split("/")[-1].lower().replace("-", "_")
    return f"{src['paper'].split()[0].lower()}{_year(src['paper']) or ''}"


def source_group(entries: list[dict]) -> dict[str, str]:
    """id -> source group: the publication, split by the table a row comes from when a paper's
    rows come from several tables."""
    pub, table = {}, {}
    for e in entries:
        src = e["source"]
        pub[e["id"]] = publication(e)
        if src.get("repo"):
            continue
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


def _first(m: dict, keys: tuple[str, ...]):
    """The value of the first of `keys` the model entry gives."""
    return next((num(m[k]) for k in keys if value(m.get(k)) is not None), None)


# what a model entry may name its experts, experts per token, expert width and head width by
# (the names of Megatron-LM's flags and Hugging Face configs)
EXPERTS = ("experts", "num_experts", "n_experts", "num_moe_experts", "n_routed_experts", "num_local_experts", "moe_experts")
TOP_K = ("top_k", "moe_top_k", "moe_router_topk", "router_topk", "num_experts_per_tok", "experts_per_token", "active_experts")
EXPERT_FFN = ("moe_ffn_hidden", "expert_ffn_hidden", "moe_ffn_hidden_size", "moe_intermediate_size", "expert_hidden")
HEAD_DIM = ("head_dim", "kv_channels", "head_size")
SHARED_COUNT = ("n_shared_experts", "shared_experts", "num_shared_experts")
SHARED_WIDTH = ("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size", "shared_expert_ffn_hidden")
DENSE_FIRST = ("first_k_dense_replace", "first_k_dense", "dense_layers", "first_dense_layers")
# multi-head latent attention (DeepSeek-V2/V3): its ranks and head widths, and DeepSeek-V3's where
# a row names MLA without them (its config.json: q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim
# 128, qk_rope_head_dim 64, v_head_dim 128)
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_DEEPSEEK_V3 = (1536, 512, 128, 64, 128)
MLA_TEXT = re.compile(r"\bMLA\b|latent attention", re.I)


def _mla(m: dict, arch_text: str) -> tuple[int, ...]:
    """(q_lora_rank (0: none), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) of a
    model with multi-head latent attention, () for any other attention."""
    given = [_first(m, (k,)) for k in MLA_KEYS]
    if not MLA_TEXT.search(arch_text) and not any(v is not None for v in given[1:]):
        return ()
    return tuple(int(v) if v is not None else d for v, d in zip(given, MLA_DEEPSEEK_V3))


def _layout(m: dict, arch_text: str, expert_ffn: int) -> tuple[int, int, int]:
    """(shared experts' width, dense layers before the first expert layer, an expert layer every how
    many layers after them) of an expert model."""
    width = _first(m, SHARED_WIDTH)
    count = _first(m, SHARED_COUNT)
    if count is None:
        said = re.search(r"(\d+)\s*shared\s+experts?", arch_text, re.I)
        count = int(said.group(1)) if said else 0
    shared = int(width) if width else int(count) * expert_ffn
    dense = _first(m, DENSE_FIRST)
    freq = _first(m, ("moe_layer_freq", "interleave_moe_layer_step"))
    if dense is None and isinstance(freq, str):  # Megatron-LM's --moe-layer-freq "([0]*3+[1]*58)"
        lead = re.match(r"\W*\[0\]\s*\*\s*(\d+)\s*\+\s*\[1\]\s*\*\s*\d+\W*$", freq)
        assert lead, f"expert layers in the pattern {freq!r}: the model file here has them after the dense ones only"
        dense = int(lead.group(1))
    every = int(freq) if freq is not None and not isinstance(freq, str) else 1
    return shared, int(dense or 0), every


def _experts(m: dict, arch_text: str) -> tuple[int, int, int | None]:
    """(routed experts, experts per token, one expert's width) of a mixture-of-experts model entry:
    its fields (EXPERTS, TOP_K, EXPERT_FFN) or its arch text ("128 experts, top-8", Mixtral's
    "8x7B": 8 experts, top-2); (0, 0, None) for a dense model."""
    experts = _first(m, EXPERTS)
    if experts is None:
        said = re.search(r"(\d+)\s*(?:routed\s+)?experts", arch_text, re.I)
        mixtral = re.search(r"mixtral[^\d]*(\d+)\s*x\s*\d+\s*B", arch_text, re.I)
        experts = int(said.group(1)) if said else int(mixtral.group(1)) if mixtral else 0
    if not experts:
        return 0, 0, None
    top_k = _first(m, TOP_K)
    if top_k is None:
        said = re.search(r"top[- ]?(\d+)", arch_text, re.I)
        top_k = int(said.group(1)) if said else 2 if "mixtral" in arch_text.lower() else None
    assert top_k, f"mixture of experts without its experts per token (one of {', '.join(TOP_K)})"
    return int(experts), int(top_k), _first(m, EXPERT_FFN)


def _model_fields(e: dict) -> dict:
    """A row's model fields, those of a nested `moe` (or `mla`) mapping among them."""
    m = dict(e["model"])
    for key in ("moe", "mla", "attention"):
        if isinstance(m.get(key), dict):
            m = {**m.pop(key), **m}
    return m


# An MLP of two matrices and an activation between (GPT's, BLOOM's, Falcon's, StarCoder's), said in a
# row's arch: the GPT model file, with the row's attention heads and MLP width; else with kv_heads, a
# Llama's gated MLP
NOT_GATED = re.compile(r"\b(?:gelu|relu)\b|falcon|starcoder|neox|bloom|\bopt\b|\bgpt\b", re.I)
GATED = re.compile(r"swiglu|geglu|gated|\bglu\b", re.I)


def _not_gated(arch_text: str) -> bool:
    """The arch names an ungated MLP (NOT_GATED) and no gated one anywhere (GATED)."""
    return bool(NOT_GATED.search(arch_text)) and not GATED.search(arch_text)


def _shape(e: dict) -> Shape:
    m = _model_fields(e)
    arch_text = str(value(m.get("arch", "")))
    experts, top_k, expert_ffn = _experts(m, arch_text)
    dense_ffn = num(m.get("ffn_hidden")) or 4 * num(m["hidden"])
    shared, dense_layers, every = _layout(m, arch_text, expert_ffn or dense_ffn) if experts else (0, 0, 1)
    mla = _mla(m, arch_text)
    if "MPT" in arch_text:
        arch = "mpt"
    elif experts or mla or "llama" in arch_text.lower() or m.get("kv_heads") is not None and not _not_gated(arch_text):
        arch = "llama"  # a gated (SwiGLU) MLP
    else:
        arch = "gpt"
    src = e["source"]
    year = _year(str(src.get("paper", ""))) or _year(str(src.get("path", "")))
    # Flash attention (Dao et al., 2022) reached Megatron-LM in 2023; llm-foundry and torchtitan
    # run it always.
    attention = "materialised" if arch == "gpt" and year is not None and year <= 2022 else "flash"
    heads = num(m["heads"])
    head_dim = int(_first(m, HEAD_DIM) or 0)
    return Shape(
        arch=arch,
        attention=attention,
        layers=num(m["layers"]),
        hidden=num(m["hidden"]),
        heads=heads,
        kv_heads=num(m.get("kv_heads")) or heads,
        ffn=expert_ffn or dense_ffn,
        seq_len=num(m["seq_len"]),
        vocab=num(m["vocab"]),
        head_dim=0 if head_dim == num(m["hidden"]) // heads else head_dim,
        experts=experts,
        top_k=top_k,
        shared_ffn=shared,
        dense_layers=dense_layers,
        dense_ffn=dense_ffn if dense_layers or every > 1 else 0,
        moe_every=every,
        mla=mla,
    )


# A link's rate as written: "400 Gb/s", "3.2 Tbps", "400G", "100 GbE", "50 GB/s" (bytes), or InfiniBand's
# generation by name (EDR 100, HDR 200, NDR 400, XDR 800 Gb/s a port; "HDR200" too).
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([TG])(b|B)?(?:/s|ps|it/s|E)?(?![a-zA-Z])")
_IB = re.compile(r"\b(EDR|HDR|NDR|XDR)(?:\s*(\d+))?", re.I)
_IB_GBPS = {"edr": 100, "hdr": 200, "ndr": 400, "xdr": 800}


def inter_node_Bps(text: str | None, gpus_per_node: int) -> float | None:
    """Per-GPU, per-direction bytes/s from the row's inter-node link text ("400 Gb/s per GPU",
    "8x 400 Gb/s ... per node", "1600 Gbps ... per node (=200 Gb/s per GPU)", "Slingshot-11,
    4 x 200 Gb/s NICs per node", "8x NDR400", "8 InfiniBand adapters of 100 Gb/s"), or None when it
    gives no rate. A rate said per GPU is per GPU; a count of NICs, or "per node", is the node's,
    shared by its GPUs; a lone rate without either is one GPU's NIC below 1.6 Tb/s (no NIC was
    faster), a node's above."""
    if not text:
        return None
    per_gpu = re.search(r"(\d+(?:\.\d+)?)\s*Gb(?:/s|ps) per GPU", text)
    if per_gpu:
        return float(per_gpu.group(1)) * 1e9 / 8
    rate = _RATE.search(text)
    ib = _IB.search(text)
    if rate:
        bits = float(rate.group(1)) * (1e12 if rate.group(2) == "T" else 1e9) * (8 if rate.group(3) == "B" else 1)
        said = text[:rate.start()] + " " + text[rate.end():]
    elif ib:
        bits = float(ib.group(2) or _IB_GBPS[ib.group(1).lower()]) * 1e9
        said = text[:ib.start()] + " " + text[ib.end():]
    else:
        return None
    count = (re.search(r"(?<![\d.-])(\d+)\s*(?:[x×]|(?:[\w-]+\s+){0,2}(?:NIC|HCA|adapter|link|port|card|rail)s?\b)", said, re.I)
             or re.search(r"[x×]\s*(\d+)(?![\d.])", said))
    nics = int(count.group(1)) if count else 1
    if re.search(r"(per|each|one per|1 per)\s+GPU", text, re.I) and not count:
        return bits / 8
    if count or re.search(r"per node|node-to-node|/node", text, re.I) or bits >= 1.6e12:
        return nics * bits / 8 / gpus_per_node
    return bits / 8


def _family(text: str, catalogue: dict[str, GPUSpec]) -> str | None:
    """The catalogue family (the first part of a catalogue name: "h100", "mi300x", "rtx4090") a
    row's GPU text names, spaced or hyphenated as people write it ("RTX 4090", "MI-300X", "8xH100"),
    not inside another part's name: "GH200" is not an H200, nor "H200" an H20."""
    for family in sorted({n.split("-")[0] for n in catalogue}, key=len, reverse=True):
        spelled = r"[ -]?".join(re.findall(r"[a-z]+|\d+", family))  # a gap where letters meet digits
        if re.search(rf"(?:(?<![a-z0-9])|(?<=\dx)){spelled}(?!\d)", text, re.I):  # "8xH100s" too
            return family
    return None


def gpu_of(hw: dict, catalogue: dict[str, GPUSpec]) -> tuple[GPUSpec, str | None]:
    """The catalogue GPU a row names (family and memory), with the row's figures replacing the
    catalogue's where it gives them; and a note when the GPU itself is not in the catalogue."""
    text = str(value(hw["gpu"]))
    family = _family(text, catalogue)
    assert family, f"unknown GPU in the reference: {text!r}"
    names = sorted(n for n in catalogue if n.split("-")[0] == family)
    mem = re.search(r"(\d+)\s*GB", text)

    def labelled_gb(spec: GPUSpec) -> int:
        """The memory size in the part's name (80 for "H100 SXM5 80GB"): HBM in binary units."""
        return int(re.search(r"(\d+)\s*GB", spec.display_name).group(1))

    same = [n for n in names if mem is None or labelled_gb(catalogue[n]) == int(mem.group(1))]

    def form(t: str) -> str:
        """The part's form factor: a PCIe card, an H100 NVL (not an NVL72 rack), or SXM."""
        return "pcie" if re.search(r"pcie", t, re.I) else "nvl" if re.search(r"\bNVL\b", t) else "sxm"

    same = [n for n in same if form(catalogue[n].display_name) == form(text)] or same
    note = None
    if same:
        spec = catalogue[same[0]]
    else:  # a variant the catalogue lacks: the family's entry with the row's memory (and HBM),
        # its usable memory scaled from the family entry's (what nvidia-smi reports per labelled GB)
        spec = catalogue[names[-1]]
        spec = replace(spec, memory_bytes=int(spec.memory_bytes * int(mem.group(1)) / labelled_gb(spec)))
        hbm = re.search(r"(\d+(?:\.\d+)?)\s*TB/s", text)
        if hbm:
            spec = replace(spec, hbm_bandwidth_Bps=float(hbm.group(1)) * 1e12)
        note = f"GPU {mem.group(1)}GB variant: {spec.name} peaks"
    cap = re.search(r"(\d+)\s*W power limit", text)
    if cap and spec.tdp_w and float(cap.group(1)) < spec.tdp_w:
        capped = spec.power_capped(float(cap.group(1)))
        scale = capped.peak_flops["bf16"] / spec.peak_flops["bf16"]
        spec, note = capped, "; ".join(filter(None, [note, f"{cap.group(1)} W power limit: peaks x{scale:.2f}"]))
    domain = re.search(r"NVL(\d+)", text, re.I)
    if domain and spec.gpus_per_host:  # a rack-scale part in a smaller NVLink domain than the catalogue's
        spec = replace(spec, gpus_per_node=int(domain.group(1)))
    bw = inter_node_Bps(value(hw.get("inter_node_link")), num(hw.get("gpus_per_node")) or spec.gpus_per_host or spec.gpus_per_node)
    if bw is not None and bw != spec.inter_node_bandwidth_Bps:
        spec = replace(spec, inter_node_bandwidth_Bps=bw)
    return spec, note


def korthikanti_model_flops(shape: Shape, batch: int) -> float:
    """Model FLOPs of one step: 72 B s l h^2 (1 + s/6h + V/12lh) (Korthikanti et al. 2022;
    formulas.yaml korthikanti_model_flops_per_iteration; GPT with MHA and ffn = 4h)."""
    s, l, h, V = shape.seq_len, shape.layers, shape.hidden, shape.vocab
    return 72 * batch * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def _published(e: dict, key: str) -> float | None:
    """A figure of the row, measured or else derived."""
    return next((float(num(x[key])) for x in (e.get("measured") or {}, e.get("derived") or {}) if value(x.get(key))), None)


def palm_model_flops(shape: Shape, params_b: float, batch: int) -> float:
    """Model FLOPs of one step for any decoder: 6 N + 12 l h s per token (Chowdhery et al. 2022,
    PaLM, Appendix B: the parameters' matmuls forward and backward, and attention's)."""
    tokens = batch * shape.seq_len
    return 6 * params_b * 1e9 * tokens + 12 * shape.layers * shape.hidden * shape.seq_len * tokens


def active_params_b(shape: Shape) -> float:
    """Billions of parameters a token's matmuls use in a mixture-of-experts decoder (the Llama-style
    blocks of models.py): attention, the router, top_k SwiGLU experts per layer, and the head."""
    h, a = shape.hidden, shape.heads
    if shape.mla:
        q_lora, kv_lora, nope, rope, v = shape.mla
        q = a * (nope + rope) * (q_lora or h) + (h * q_lora if q_lora else 0)
        attention = q + h * (kv_lora + rope) + kv_lora * a * (nope + v) + a * v * h
    else:
        width = a * (shape.head_dim or h // a)
        attention = h * (2 * width + 2 * shape.kv_heads * (shape.head_dim or h // a))
    moe = h * shape.experts + 3 * h * (shape.top_k * shape.ffn + shape.shared_ffn)
    dense = 3 * h * shape.dense_ffn
    experts = (shape.layers - shape.dense_layers) // shape.moe_every
    layers = shape.layers * attention + (shape.layers - experts) * dense + experts * moe
    return (layers + shape.vocab * h) / 1e9


# The year model FLOPs became the figure runs publish: PaLM (Chowdhery et al. 2022, arXiv 2204.02311,
# Appendix B) named model FLOPs utilisation, against the hardware FLOPs (recompute counted) that
# Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021, Eq. 3), ZeRO (Rajbhandari et al. 2020) and
# their successors had reported as "TFLOP/s per GPU".
MODEL_FLOPS_NAMED = 2022


def measured_step(e: dict, shape: Shape, global_batch: int, gpus: int, full_recompute: bool = False,
                  notes: list[str] | None = None, peak_tflops: float | None = None) -> float:
    """The measured step time, or derived from what was published (measured first, then derived):
    a step time, throughput (tokens/s per GPU or in all, sequences/s, days per 300B tokens), or
    FLOP/s per GPU (TFLOP/s, all GPUs' PFLOP/s, or a utilisation: MFU, HFU, % of peak, times the
    row's `peak_used_tflops` or else `peak_tflops`, the catalogue's 16-bit peak of its GPU, with a
    note) with the model-FLOPs formula of its source (Korthikanti et al.'s for GPT, PaLM's for the
    others). FLOP/s that count the recompute ("hardware" FLOPs, as Megatron-LM's papers and BLOOM
    report them: Narayanan et al. 2021 Eq. 3; HFU) add the rerun forward of every layer but the
    logits under full recompute; TFLOP/s of no stated kind are read as hardware FLOPs before 2022
    (MODEL_FLOPS_NAMED), as model FLOPs after, with a note."""
    step = _published(e, "step_time_s")
    if step:
        return step
    tokens = global_batch * shape.seq_len
    for key, seconds in (("tokens_per_s_per_gpu", lambda x: tokens / (x * gpus)), ("tokens_per_s", lambda x: tokens / x),
                         ("samples_per_s", lambda x: global_batch / x), ("sequences_per_s", lambda x: global_batch / x),
                         ("training_days_300B_tokens", lambda x: x * 86400 * tokens / 300e9)):
        rate = _published(e, key)
        if rate:
            return seconds(rate)
    m = e.get("measured") or {}
    kind = str(value(m.get("tflops_kind")) or "").lower()
    hardware = "model" not in kind and bool(re.search(r"hardware|recompute", kind))

    def utilisation(key: str) -> float | None:
        share = _published(e, key)
        if not share:
            return None
        peak = _published(e, "peak_used_tflops")
        if peak is None and peak_tflops is None:
            return None
        if peak is None and notes is not None:
            notes.append(f"{key} of the catalogue's 16-bit peak ({peak_tflops:g} TFLOP/s)")
        return (share / 100 if share > 1 else share) * (peak or peak_tflops)  # 0.38 or 38 (%)

    tflops = _published(e, "model_tflops_per_gpu") or utilisation("mfu") or utilisation("mfu_model_flops")
    if tflops is not None:
        hardware = False
    elif _published(e, "tflops_per_gpu") or _published(e, "aggregate_pflops"):
        tflops = _published(e, "tflops_per_gpu") or _published(e, "aggregate_pflops") * 1e3 / gpus
        if not kind:  # before PaLM named model FLOPs utilisation (2022), FLOP/s counted what ran
            hardware = (publication_year(e) or 9999) < MODEL_FLOPS_NAMED
            if notes is not None:
                notes.append(f"TFLOP/s of no stated kind read as {'hardware' if hardware else 'model'} FLOPs")
    elif _published(e, "hfu") or _published(e, "pct_of_peak"):
        tflops, hardware = utilisation("hfu") or utilisation("pct_of_peak"), True
    assert tflops, f"{e['id']}: no step time, throughput or TFLOP/s"
    if shape.arch == "gpt" and (shape.kv_heads, shape.ffn, shape.head_dim) == (shape.heads, 4 * shape.hidden, 0):
        flops = korthikanti_model_flops(shape, global_batch)
    else:
        m = _model_fields(e)
        params_b = num(m.get("active_params_b")) or (active_params_b(shape) if shape.experts else num(m.get("params_b"))
                                                     or (num(m.get("params")) or 0) / 1e9)
        assert params_b, f"{e['id']}: model FLOP/s without params_b"
        flops = palm_model_flops(shape, params_b, global_batch)
    if hardware and full_recompute:  # one more forward (a third of forward + backward) of all but the logits
        logits = 6 * global_batch * shape.seq_len * shape.vocab * shape.hidden
        flops += (flops - logits) / 3
    return flops / (tflops * 1e12 * gpus)


def _zero(p: dict) -> tuple[int, bool]:
    """(ZeRO stage, HSDP) of a row's data parallelism."""
    text = str(value(p.get("zero"))).lower()
    return _zero_stage(p, text), "hsdp" in text or "hybrid" in text or value(p.get("hsdp")) is True


def _zero_stage(p: dict, text: str) -> int:
    """The ZeRO stage a row's `zero` text (lower case) and `fsdp` flag name: "ZeRO-3", "zero stage
    2", FSDP's FULL_SHARD / SHARD_GRAD_OP / hybrid sharding, Megatron's distributed optimizer."""
    stage = re.search(r"zero[-_ ]?(?:stage[-_ ]?)?([0-3])\b", text) or re.search(r"\bstage[-_ ]?([0-3])\b", text)
    if "shard_grad_op" in text:
        return 2
    if stage:
        return int(stage.group(1))
    if value(p.get("fsdp")) or any(t in text for t in ("full_shard", "full shard", "fsdp", "hsdp", "hybrid")):
        return 3
    if "distributed optimizer" in text or "optimizer state shard" in text:
        return 1
    return 0


_YES, _NO = ("true", "yes", "on", "all"), ("false", "no", "off", "none", "0", "n/a")


def _recompute(p: dict, shape: Shape, notes: list[str], assumed: list[str]) -> str | None:
    text = value(p.get("recompute"))
    if text is None:
        assumed.append("recompute free")
        return None
    lower = str(text).lower()
    first = (lower.split() or ["none"])[0].strip(",;:()")
    if text is True or first in _YES:
        kind = "full"
    elif text is False or first in _NO:
        kind = "none"
    elif isinstance(text, (int, float)):
        kind = "full" if text else "none"
    elif "selective" in lower or re.search(r"\bop\b|per[- ]op", lower):
        kind = "selective"  # torchtitan's per-op policy too ("op")
    elif "full" in lower or "checkpoint" in lower:
        kind = "full"  # "activation checkpointing (every layer)"
    else:  # some layers ("block", "partial"): the search chooses per layer, as the trainer did
        assumed.append(f"recompute {text!r} free")
        return None
    # Megatron-LM's only selective mode recomputes the attention core (Korthikanti et al. 2022);
    # the GPT rows are Megatron-LM runs. torchtitan's selective is its per-op policy (its default,
    # selective_ac_option "op": save every other matmul): the cost model's "alternate".
    if kind == "selective" and ("attention core" in str(text) or shape.arch == "gpt"):
        notes.append("attn-core selective as save-matmuls")
    elif kind == "selective" and "norm" in lower:
        # a selective recompute of the norms (and what else it names: DeepSeek-V3's MLA
        # up-projections) keeps the matmul outputs around them: the cost model's save-matmuls
        notes.append("selective recompute of the norms as save-matmuls")
    elif kind == "selective":
        return "alternate"
    return kind


# torchtitan's interleaved schedules without split points run two stages per rank
# (generate_split_points: "Multi-stage schedules support more than 2 stages per rank, but this is
# the default if no pipeline split is specified").
TORCHTITAN_STAGES_PER_RANK = 2


def _schedule(p: dict, pp: int, notes: list[str], assumed: list[str], trainer: str = "this") -> tuple[str | None, int | None]:
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
    text = str(v).lower()
    if "gpipe" in text:
        return "gpipe", None
    if any(text.startswith(w) for w in _NO) or "non-interleaved" in text:
        return "1f1b", None
    if "interleav" in text or "virtual" in text:
        chunks = re.search(r"(\d+)", text.replace("1f1b", ""))
        if chunks and int(chunks.group(1)) > 1:
            return "interleaved", int(chunks.group(1))
        if trainer == "torchtitan":
            assumed.append(f"{TORCHTITAN_STAGES_PER_RANK} model chunks per rank (torchtitan's default)")
            return "interleaved", TORCHTITAN_STAGES_PER_RANK
        assumed.append("model chunks per rank free")
        return "interleaved", None
    if "1f1b" not in text:
        notes.append(f"schedule {v!r} as 1F1B")  # zero-bubble, DualPipe: not in the cost model
    return "1f1b", None


# What a row's trainer does is read from what its publication says (the source fields of every
# row of it: a publication is one trainer, and the words may be in any of its rows).

# Which trainer (planner.cost.setup.TRAINERS) a publication names:
# - "megatron": Megatron-LM and the trainers on it (NeMo, Megatron-Bridge, MT-NLG's
#   Megatron-DeepSpeed): fused memory-bound kernels (Megatron's fused layer norm, bias-GeLU /
#   SwiGLU, bias-dropout-add, RoPE and softmax kernels, Transformer Engine's since Megatron-Core),
#   Transformer Engine's attention (cuDNN's kernels) and FP8, a reentrant full recompute, a
#   selective recompute of the attention core alone.
# - "torchtitan": torch's non-reentrant checkpoint (early stop on by default since torch 2.1), a
#   per-op selective policy that keeps reduce-scatter outputs, SDPA and torchao's Float8.
# - any other ("this", the runtime's own kernels) with a reentrant full recompute: DeepSpeed's
#   (SC'21 Table 2's ZeRO-3) and Composer's FSDP default (activation_checkpointing_reentrant=True,
#   llm-foundry) rerun the whole forward, torch.utils.checkpoint's long-standing default.
MEGATRON = ("megatron", "nemo", "transformer engine", "mt-nlg")
# FP8 scaled per tile or block (DeepSeek-V3's, arXiv 2412.19437 Sec. 3.3: "the majority of core
# computation kernels, i.e., GEMM operations, are implemented in FP8", activations cached in FP8
# for the backward, as Transformer Engine's recipes do; TE's own MXFP8 and block-wise recipes)
FINE_GRAINED_FP8 = ("block-wise", "blockwise", "tile-wise", "tilewise", "fine-grained")
TORCHTITAN = ("torchtitan",)
# - NeMo's and Megatron-Bridge's configurations turn Megatron-Core's loss fusion on (Megatron-
#   Bridge's performance configs, scripts/performance: cross_entropy_loss_fusion true,
#   cross_entropy_fusion_impl "te"; NeMo's launcher configs: cross_entropy_loss_fusion true); Megatron-LM's
#   own runs (SC'21, Korthikanti et al., its README's table) and Megatron-DeepSpeed's (MT-NLG) ran
#   its unfused vocabulary-parallel cross-entropy (Training.loss_bytes_per_logit)
MEGATRON_FUSED_LOSS = ("nemo", "megatron-bridge")
# - IBM's fms-fsdp checkpoints its blocks non-reentrantly (fms_fsdp/policies/ac_handler.py:
#   checkpoint_wrapper with CheckpointImpl.NO_REENTRANT), which torch 2.1 on stops early as this
#   runtime's does (Training.recompute_whole_forward False); a trainer not named is taken to
#   rerun a checkpointed layer's whole forward (a reentrant checkpoint, or torch before 2.1:
#   llm-foundry's benchmark table ran torch 1.13, its README says)
NON_REENTRANT = ("fms-fsdp",)
# - a trainer not named runs tensor parallelism on sequence-first tensors, as Megatron-LM and the
#   trainers built on it do (Megatron-DeepSpeed, GPT-NeoX): no layout copies beside its
#   collectives (Training.tp_batch_first), which DTensor's on batch-first tensors (torchtitan,
#   this runtime, NeMo AutoModel) pay
AUTOMODEL = ("automodel",)
# - llm-foundry's benchmark table (scripts/train/benchmarking): MPT with attn_impl "triton"
#   (submit_benchmarks.py's default; FlashAttention in Triton, for ALiBi) and its default loss,
#   flash-attn's fused cross-entropy (bench/published/models.py).
TRITON_ATTENTION = ("llm-foundry",)
# - torchtitan with torch_compile compiles its default loss too since its loss builder does
#   (pytorch/torchtitan PR #1033, merged 2025-04-01: "compiling the loss fn if
#   job_config.training.compile is set"); before, train.py left it eager ("TODO: compiling loss
#   function causes CUDA errors"). The row's month is read from its own source text ("Dec 2024",
#   "2025-06", "_202506_"); a row without one is taken as today's torchtitan.
TORCHTITAN_COMPILED_LOSS = (2025, 4)
# - torch's SDPA (torchtitan's attention) runs cuDNN's kernels first on Hopper and the B200 from
#   torch 2.11, released 2026-03-23 (planner/cost/constants.py SDPA_CUDNN_FROM_TORCH): a row
#   published from the month after on (or without a month: today's torchtitan) is taken to run it.
TORCHTITAN_SDPA_CUDNN = (2026, 4)
# - Megatron-LM runs an interleaved schedule's pipeline sends beside the compute
#   (Training.p2p_overlap) since Megatron-Core, 2023; the SC'21 and Korthikanti et al. (2022)
#   runs sent them between the compute. The year is the paper's (`publication_year`).
MEGATRON_P2P_OVERLAP = 2023
# - DeepSpeed's ZeRO-3 gathers each module's parameters with one coalesced all-gather since
#   v0.5 (PR 1188, September 2021); before, one per parameter (issue 1069, June 2021)
#   (Training.zero3_gathers). A row published before 2022 is taken to run the earlier, whose
#   gathers hid nothing: each called torch.cuda.synchronize() before the next ("the async version
#   is not async at all", PR 1188), so its data-parallel traffic is taken as exposed
#   (Training.dp_overlap 0).
DEEPSPEED_MODULE_GATHERS = 2022
# - Megatron-LM's data parallelism (its default LocalDDP) all-reduced the gradients once the
#   backward had ended (training.py: the model's allreduce_gradients() after forward_backward_func)
#   until --overlap-grad-reduce (Megatron-Core's DistributedDataParallel, 2023) hid them behind it:
#   a Megatron row published before 2023 that states no overlap has its gradient sync exposed
#   (Training.dp_overlap 0). The year is the paper's (`publication_year`).
MEGATRON_GRAD_OVERLAP = 2023
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")


def publication_month(text: str) -> tuple[int, int] | None:
    """The (year, month) a source text names ("Dec 2024", "June 2025", "2025-06", "2025/06",
    "202506"); the latest when it names several; None when it names none."""
    found = [(int(y), _MONTHS.index(m[:3]) + 1) for m, y in re.findall(r"\b([a-z]{3,9})\.? (20\d\d)\b", text)
             if m[:3] in _MONTHS]
    found += [(int(y), int(m)) for y, m in re.findall(r"(?<!\d)(20\d\d)[-/_]?(0[1-9]|1[0-2])(?!\d)", text)]
    return max(found, default=None)


def publication_year(e: dict) -> int | None:
    """The year a row's source was published: a paper's own ("Narayanan et al. 2021, ..."; the
    first year its citation names, not the dates of the notes on where the figures were read),
    else the latest month a repository's text names; None when it names none."""
    found = re.search(r"(?<!\d)(20\d\d)(?!\d)", str(e["source"].get("paper", "")))
    if found:
        return int(found.group(1))
    month = publication_month(_source_text(e))
    return month[0] if month else None


def _source_text(e: dict) -> str:
    src = e["source"]
    return " ".join(str(src.get(k, "")) for k in ("repo", "paper", "path", "where")).lower()


def _names(trainer_text: str, trainers: tuple[str, ...]) -> bool:
    return any(t in trainer_text for t in trainers)


# Expert parallelism's dispatch across nodes (Training.ep_dispatch): DeepEP's kernels (DeepSeek-V3's,
# arXiv 2412.19437 Sec. 3.2.2: "first transmitted via IB to the GPUs with the same in-node index
# on their target nodes ... forwarded via NVLink"), named as such or as Megatron-Core's flex
# dispatcher and HybridEP that run them.
DEEPEP = r"deepep|hybridep|flex[-_ ]dispatcher|forwarded (?:via|over) nvlink"


def _expert_routing(e: dict, model: dict, text: str) -> dict[str, Any]:
    """The Training settings of a mixture-of-experts row's routing and dispatch: DeepEP's dispatch
    where the row names it (anywhere, its trainer's sources included); the most nodes a token's
    experts span: Hugging Face's topk_group (DeepSeek-V3's node-limited routing: its n_group 8
    groups are the 8 nodes of its EP 64), 1 for NeMo AutoModel's FakeBalancedGate (token i to
    experts i k ... i k + k - 1: one node's when k divides the experts a node holds)."""
    out: dict[str, Any] = {}
    said = f"{text} {json.dumps(e, default=str)}".lower()
    if re.search(DEEPEP, said):
        out["ep_dispatch"] = "deepep"
    groups = num(_first(model, ("topk_group",)))
    if groups:
        out["expert_node_limit"] = int(groups)
    elif re.search(r"fake[-_ ]balanced[-_ ]gate", said):
        out["expert_node_limit"] = 1
    return out


def _trainer(trainer_text: str) -> str:
    if _names(trainer_text, AUTOMODEL):  # NeMo's PyTorch backend, not its Megatron one
        return "automodel"
    if _names(trainer_text, MEGATRON):
        return "megatron"
    return "torchtitan" if _names(trainer_text, TORCHTITAN) else "this"


def make_row(e: dict, source: str, catalogue: dict[str, GPUSpec], trainer_text: str) -> Row:
    """`trainer_text`: what the entry's publication says of its trainer (every row's source)."""
    notes: list[str] = []
    assumed: list[str] = []
    shape = _shape(e)
    hw = dict(e["hardware"])
    p = e["parallel"]
    tp, pp, cp = (int(num(p.get(k)) or 1) for k in ("tp", "pp", "cp"))
    if value(hw.get("gpus")) is None and value(p.get("dp")):  # the schema's dp = gpus / (tp pp cp)
        hw["gpus"] = tp * pp * int(num(p["dp"])) * cp
    gpus = int(num(hw["gpus"]))
    dp = int(num(p.get("dp")) or gpus // (tp * pp * cp))
    gpu, gpu_note = gpu_of(hw, catalogue)
    if value(hw.get("gpus_per_node")) is None:  # not said: the catalogue part's node (or NVLink domain)
        hw["gpus_per_node"] = gpu.gpus_per_host or gpu.gpus_per_node
    per_node = int(num(hw["gpus_per_node"]))
    if gpu_note:
        notes.append(gpu_note)
    if gpu.gpus_per_host and per_node <= gpu.gpus_per_host:
        per_node = None  # the row gives a host of a rack-scale NVLink domain (a GB200 NVL72 tray): the
        # cluster is in domains (make_cluster: whole racks, or equal parts of them)
    model = _model_fields(e)
    if shape.mla and any(_first(model, (k,)) is None for k in MLA_KEYS):  # _mla filled them in
        notes.append("latent attention's ranks and widths as DeepSeek-V3's")
    if re.search(r"sliding[- ]window", str(value(model.get("arch", ""))), re.I) or value(model.get("sliding_window")):
        notes.append("sliding-window attention as full attention")
    precision_text = str(value(e.get("precision"))).lower()
    if re.search(r"int4", precision_text):
        raise ValueError(f"{e['id']}: precision {precision_text!r}: the cost model has no integer training")
    precision = "fp16" if "fp16" in precision_text else "bf16"  # same peak on every GPU here
    if "fp8" in precision_text:
        precision = "fp8"  # Float8 Linears (torchtitan, torchao): the cost model's --precision fp8
    if "fp4" in precision_text:
        precision = "fp4"  # NVFP4 Linears (Transformer Engine's recipe): the cost model's --precision fp4
    if precision in LOW_PRECISIONS and precision not in gpu.peak_flops:
        raise ValueError(f"{e['id']}: precision {precision_text!r} on {gpu.name}, which has no {precision} peak in the catalogue")
    assert tp * pp * dp * cp == gpus, f"{e['id']}: tp*pp*dp*cp != {gpus}"
    # expert parallelism: the experts split over `ep` consecutive ranks of a stage (dp x cp x tp)
    # (Megatron-LM's --expert-model-parallel-size, which carves EP out of TP x CP x DP with expert TP
    # 1: Megatron-Core's MoE parallel folding)
    ep = int(_first(p, ("ep", "expert_parallel", "expert_model_parallel", "ep_size")) or 1)
    assert ep == 1 or shape.experts, f"{e['id']}: ep {ep} for a dense model"
    if dp * cp * tp % ep:
        # an EP that spans pipeline stages, which no trainer runs: the largest that a stage holds
        folded, ep = ep, math.gcd(ep, dp * cp * tp)
        notes.append(f"EP {folded} as EP {ep} over a stage's DP x CP x TP")
    etp = _first(p, ("etp", "expert_tensor_parallel", "expert_tp"))
    planned_etp = 1 if ep > 1 else tp  # with EP the planner keeps experts whole (stage_costs), without it TP splits them
    if shape.experts and etp is not None and int(etp) != planned_etp:
        notes.append(f"expert TP {etp} as {planned_etp}")
    gb = e.get("global_batch")
    if isinstance(gb, dict) and "tokens" in gb:  # the schema's {tokens: N}: sequences of the row's length
        gb = num(gb["tokens"]) / shape.seq_len
    gb = num(gb)
    if isinstance(gb, str):  # "4M tokens", "1.5K sequences"
        said = re.match(r"\s*([\d.]+)\s*([kmb])?\b", gb.replace(",", ""), re.I)
        if not said:
            raise ValueError(f"global batch {gb!r}: not a number of sequences or tokens")
        unit = (said.group(2) or "").lower()
        gb = float(said.group(1)) * {"k": 1e3, "m": 1e6, "b": 1e9, "": 1}[unit]
        if "token" in e["global_batch"].lower():  # "4M tokens" of 2,048-token sequences: 2,048 of them (2^22)
            binary = float(said.group(1)) * {"k": 2**10, "m": 2**20, "b": 2**30, "": 1}[unit] / shape.seq_len
            gb = binary if binary.is_integer() and not (gb / shape.seq_len).is_integer() else gb / shape.seq_len
    if gb is None:
        gb = gpus
        assumed.append(f"global batch {gb} (1 per GPU)")
    trainer = _trainer(trainer_text)
    schedule, v = _schedule(p, pp, notes, assumed, trainer)
    mb = e.get("micro_batch")
    if isinstance(mb, dict) and "local_batch_per_dp_rank" in mb:
        local = int(num(mb["local_batch_per_dp_rank"]))  # no gradient accumulation: one step per local batch
        # torchtitan's pipeline runs as many micro-batches as there are stages in all
        # (build_pipeline_schedule: n_microbatches = pp x stages per rank when not set)
        stages = pp * (v or 1)
        micro = local // stages if pp > 1 else local
        if pp > 1:
            assumed.append(f"{stages} pipeline micro-batches (torchtitan's default: one per stage)")
    else:
        micro = num(mb)
        micro = int(micro) if micro is not None else None
        if micro is None:
            assumed.append("micro-batch free")
    whole = dp * (micro or 1)  # a step is whole micro-batches on every data-parallel rank
    if gb % whole:
        said, gb = gb, whole * max(1, round(gb / whole))
        notes.append(f"global batch {said:g} as {gb}: whole micro-batches of {micro or 1} per data-parallel rank")
    gb = int(gb)
    sp = value(p.get("sequence_parallel"))
    if sp is None and tp > 1:
        assumed.append("sequence parallelism free")
    # TP overlap: Megatron-LM's --tp-comm-overlap, torchtitan's async TP (the cost model's --tp-overlap)
    overlap_text = str(value(p.get("overlap"))).lower()
    named = re.search(r"tp[-_ ]comm[-_ ]overlap|async[-_ ]tp", overlap_text)
    # Megatron's --overlap-grad-reduce: the distributed optimizer's reduce-scatter hidden behind
    # the backward (Training.dp_overlap); other trainers' overlap is what contention leaves (OVERLAP_CONTENTION)
    dp_overlap = 1.0 if re.search(r"overlap[-_ ]grad[-_ ]reduce", overlap_text) and dp * cp > 1 else None
    tp_overlap = tp > 1 and bool(value(p.get("async_tp")) or value(p.get("tp_comm_overlap")) or named)
    # EP overlap: Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm, Megatron-Bridge's
    # moe_a2a_overlap) and DeepSeek-V3's DualPipe, which overlaps its all-to-alls (the cost model's --ep-overlap)
    ep_overlap = ep > 1 and bool(re.search(r"moe[-_ ]a2a[-_ ]overlap|overlap[-_ ]moe[-_ ]expert|dualpipe", overlap_text))
    settings: dict[str, Any] = {"dp_overlap": dp_overlap}  # what the row says, over its trainer's
    if value(p.get("torch_compile")):
        settings["fused_kernels"] = True  # inductor's fused kernels (Training.fused_kernels)
        settings["compiled"] = True  # and what its partitioner keeps (Training.compiled)
        if trainer == "torchtitan" and (publication_month(_source_text(e)) or (9999, 1)) >= TORCHTITAN_COMPILED_LOSS:
            settings["compiled_loss"] = True
    if trainer == "torchtitan" and (publication_month(_source_text(e)) or (9999, 1)) >= TORCHTITAN_SDPA_CUDNN:
        settings["sdpa_cudnn"] = True
    year = publication_year(e) or 9999
    if trainer == "megatron" and year < MEGATRON_P2P_OVERLAP:
        settings["p2p_overlap"] = False
    if trainer == "megatron" and not _names(trainer_text, MEGATRON_FUSED_LOSS):
        settings["loss_bytes_per_logit"] = VOCAB_PARALLEL_CE_BYTES
    if trainer == "this" and not _names(trainer_text, NON_REENTRANT):
        settings["recompute_whole_forward"] = True  # a trainer not named: a reentrant checkpoint
    if trainer == "this":
        settings["tp_batch_first"] = False  # a trainer not named: Megatron-LM's sequence-first TP
    if _names(trainer_text, TRITON_ATTENTION):
        settings["attention_kernel"] = "triton"
    if precision == "fp8" and _names(precision_text, MEGATRON + FINE_GRAINED_FP8) or precision == "fp4":
        # Transformer Engine's FP8, whoever drives it; its NVFP4 (no other has one); a block-wise
        # recipe of one's own (DeepSeek-V3's), which like it runs every GEMM in FP8, the experts' too
        settings["fp8_recipe"] = "te"
    if shape.experts:
        settings.update(_expert_routing(e, model, f"{overlap_text} {trainer_text}"))
    zero, hsdp = _zero(p)
    deepspeed_pipeline = pp > 1 and "deepspeed" in f"{json.dumps(p, default=str)} {trainer_text}".lower()
    if deepspeed_pipeline:
        # DeepSpeed's PipelineEngine (Megatron-DeepSpeed's pipeline: BLOOM, MT-NLG) partitions what
        # crosses a cut over the TP ranks (Training.p2p_scatter_gather), as Megatron-LM does
        settings["p2p_scatter_gather"] = True
    if zero == 3 and "deepspeed" in f"{value(p.get('zero'))} {trainer_text}".lower():
        settings["zero3_gathers"] = "tensor" if year < DEEPSPEED_MODULE_GATHERS else "module"
    # Trainers that ran their data-parallel traffic where nothing hid it (Training.dp_overlap 0),
    # unless the row states its overlap: DeepSpeed's pipeline engine reduces the gradients after
    # the last micro-batch's backward (its TrainSchedule's ReduceGrads step, before OptimizerStep);
    # DeepSpeed's per-parameter ZeRO-3 gathers each synchronised the device (PR 1188); Megatron-LM's
    # DDP before --overlap-grad-reduce all-reduced the gradients after the backward.
    exposed = (deepspeed_pipeline or settings.get("zero3_gathers") == "tensor"
               or trainer == "megatron" and year < MEGATRON_GRAD_OVERLAP)
    if exposed and dp_overlap is None:
        settings["dp_overlap"] = 0.0
    if zero == 3 and pp > 1 and source == "torchtitan":
        # torchtitan's FSDP2 does not reshard after forward under a pipeline (to avoid a gather
        # per micro-batch): ZeRO-2 in the plan's terms (runtime/README.md, data parallel)
        zero = 2
        notes.append("FSDP2 no reshard under PP")
    recompute = _recompute(p, shape, notes, assumed)
    fixed = Fixed(
        tp=tp, pp=pp, dp=dp, cp=cp, ep=ep if shape.experts else None, micro_batch=micro, zero=zero if dp * cp > 1 else 0,
        schedule=schedule, virtual_stages=v, recompute=recompute,
        sequence_parallel=bool(sp) if sp is not None and tp > 1 else None,
        hsdp=hsdp if zero >= 2 and dp * cp > 1 else None,
        tp_overlap=tp_overlap or None, ep_overlap=ep_overlap or None,
    )
    if shape.arch != "gpt" and not (_published(e, "step_time_s") or _published(e, "tokens_per_s_per_gpu")):
        notes.append("step from model FLOP/s by PaLM's formula (sources count attention differently)")
    measured = e.get("measured") or {}
    peak = (value(measured.get("peak_memory_gib")) or 0) * GIB or (value(measured.get("peak_memory_gb")) or 0) * 1e9
    return Row(
        id=e["id"], source=source + ("_moe" if shape.experts else ""), shape=shape, gpu=gpu, num_gpus=gpus, gpus_per_node=per_node,
        precision=precision, global_batch=gb, fixed=fixed,
        measured_step_s=measured_step(e, shape, gb, gpus, recompute == "full", notes,
                                      catalogue[gpu.name].peak_flops["fp16" if "bf16" not in gpu.peak_flops else "bf16"] / 1e12),
        measured_peak_bytes=peak or None,
        notes=tuple(notes), assumed=tuple(assumed), trainer=trainer, settings=tuple(settings.items()),
    )


def load_rows(path: Path = REFERENCE, unread: list[tuple[str, str]] | None = None) -> list[Row]:
    """The rows of a reference file (this repository's copy by default). With `unread` (a list), an
    entry the reader cannot express (a GPU the catalogue lacks, a field it does not know) is left
    out and named there with the reason, so that one such row does not stop a run over a file of
    runs from elsewhere; without it, the reason is raised."""
    entries = yaml.safe_load(path.read_text())["entries"]
    groups = source_group(entries)
    said: dict[str, str] = {}
    for e in entries:
        said[publication(e)] = said.get(publication(e), "") + " " + _source_text(e)
    catalogue = load_catalogue()
    rows = []
    for e in entries:
        try:
            rows.append(make_row(e, groups[e["id"]], catalogue, said[publication(e)]))
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            if unread is None:
                raise
            unread.append((str(e.get("id", "?")), f"{type(exc).__name__}: {exc}"))
    return rows
