"""The hardware catalogue: GPU specs read from YAML data files, and the Cluster a plan targets.

A GPU file (packaged ones live in ``profiles/``; ``profiles/README.md`` shows a full example)::

    name: h100-sxm-80gb               # catalogue key, the --gpu name (default: the file name)
    display_name: NVIDIA H100 SXM5 80GB
    vendor: NVIDIA
    peak_tflops:                      # DENSE TFLOP/s per dtype (no 2:4 sparsity); any of
      bf16: 989.4                     #   bf16, fp16, fp8, fp4, tf32, fp32 (fp32 = without tensor
      fp16: 989.4                     #   cores); leave a dtype out when the GPU lacks it
      fp32: 66.9
    memory_gb: 80                     # decimal GB, as datasheets give it
    hbm_bandwidth_GBps: 3350          # device memory bandwidth
    intra_node_bandwidth_GBps: 450    # per GPU, per direction (NVLink, xGMI or PCIe)
    intra_node_peer_bandwidth_GBps: 64  # optional: direct link between two GPUs (mesh parts)
    intra_node_latency_us: 8          # optional (default 10)
    inter_node_bandwidth_GBps: 50     # per GPU, per direction (its share of the node's NICs)
    inter_node_latency_us: 15         # optional (default 20)
    gpus_per_node: 8                  # GPUs that reach each other over NVLink (xGMI, PCIe)
    gpus_per_host: 4                  # optional: where that domain spans hosts (an NVL72 rack of
                                      #   4-GPU trays), the GPUs of one host; it is filled host by host
    tdp_w: 700                        # optional
    matmul_efficiency: 0.80           # optional (default 0.82): best measured matmul / dense peak
    fp8_matmul_efficiency: 0.71       # optional: the same for FP8 matmuls / the FP8 dense peak;
                                      #   default: the 16-bit share (FP4's share follows from
                                      #   the two: gpu_spec.low_precision_share)
    attention_efficiency: 0.35        # optional: fused attention (SDPA, fwd + bwd) / dense peak;
                                      #   default: the matmul rate
    cudnn_attention_efficiency: 0.54  # optional: the same for cuDNN's fused attention (Transformer
                                      #   Engine's); default: attention_efficiency
    compute_capability: "9.0"         # optional: NVIDIA's compute capability (which kernels torch's
                                      #   SDPA picks: constants.SDPA_CUDNN_ARCHS)
    matmul_shapes: sm_90              # optional: the measured matmul-by-shape table of its architecture
                                      #   (planner.cost.gemm_shapes); default: none, every GEMM at
                                      #   matmul_efficiency
    sources:                          # optional: field (or peak_tflops.<dtype>) -> where from
      memory_gb: NVIDIA H100 datasheet
    uncertain: [inter_node_latency_us]  # optional: fields that are estimates

Users add GPUs with files of their own, in ``$PLAN_GPU_DIR``, in
``~/.config/parallel-planner/gpus/`` (``$XDG_CONFIG_HOME`` respected), or by passing a file path
as the GPU name. A user file with a packaged name replaces the packaged entry. ``cpu`` is the
local CPU, measured by a microbenchmark (``planner.local_device``).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

import profiles
from planner.errors import BadInput
from planner.cost.gemm_shapes import TABLES as SHAPE_TABLES
from planner.gpu_spec import _DTYPE_ALIASES, DTYPES, GPUSpec  # noqa: F401 (re-exported)

DEFAULT_INTRA_LATENCY_US = 10.0
DEFAULT_INTER_LATENCY_US = 20.0
# A GPU file without `matmul_efficiency`: the middle of the measured NVIDIA parts (80-86% of the
# dense peak: S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS comparison table").
DEFAULT_MATMUL_EFFICIENCY = 0.82
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# YAML key -> (GPUSpec field, required). Units convert by the key's suffix: _gb/_GBps x 1e9, _us / 1e6.
_SCALARS: dict[str, tuple[str, bool]] = {
    "memory_gb": ("memory_bytes", True),
    "hbm_bandwidth_GBps": ("hbm_bandwidth_Bps", True),
    "intra_node_bandwidth_GBps": ("intra_node_bandwidth_Bps", True),
    "intra_node_peer_bandwidth_GBps": ("intra_node_peer_bandwidth_Bps", False),
    "intra_node_latency_us": ("intra_node_latency_s", False),
    "inter_node_bandwidth_GBps": ("inter_node_bandwidth_Bps", True),
    "inter_node_latency_us": ("inter_node_latency_s", False),
    "gpus_per_node": ("gpus_per_node", True),
    "gpus_per_host": ("gpus_per_host", False),
    "tdp_w": ("tdp_w", False),
    "matmul_efficiency": ("matmul_efficiency", False),
    "fp8_matmul_efficiency": ("fp8_matmul_efficiency", False),
    "attention_efficiency": ("attention_efficiency", False),
    "cudnn_attention_efficiency": ("cudnn_attention_efficiency", False),
    "tp_forward_overhead_us": ("tp_forward_overhead_s", False),
    "tp_backward_overhead_us": ("tp_backward_overhead_s", False),
}


def _to_si(key: str, value: float) -> float:
    if key.endswith(("_gb", "_GBps")):
        return float(value) * 1e9
    if key.endswith("_us"):
        return float(value) / 1e6
    return float(value)


_TEXTS = ("name", "display_name", "vendor", "matmul_shapes", "compute_capability")
PHASES = ("compute", "comm", "optimizer", "tp_compute", "zero_comm", "tp_comm")
OPTIMIZERS = ("adamw", "sgd")
KNOWN_KEYS = (*_TEXTS, "peak_tflops", *_SCALARS, "optimizer_ns_per_param", "loss_parallel_ns_per_element", "phase_factors",
              "sources", "uncertain")


@dataclass(frozen=True)
class Cluster:
    """`num_gpus` GPUs of one type in nodes of `gpus_per_node` (whole nodes only)."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        n, per = self.num_gpus, self.gpus_per_node
        assert 1 <= per <= n and n % per == 0, f"num_gpus({n}) is not whole nodes of {per}"

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node

    def spans_nodes(self, group_size: int) -> bool:
        """Whether a group of `group_size` consecutive ranks must leave its node."""
        return group_size > self.gpus_per_node

    def bandwidth_Bps(self, group_size: int, spans_nodes: bool, members_per_node: int = 1) -> float:
        """Per-GPU, per-direction bandwidth of the link a collective over `group_size` GPUs uses.

        Across nodes each GPU has its own network port (the catalogue's figure per GPU, as in
        DGX/HGX systems: one NIC per GPU, rail-aligned). A group with `members_per_node` GPUs in
        each node crosses the network on that many ports at once: NCCL runs one ring (channel)
        per port, each carrying its share, so the bus bandwidth is members x the per-GPU figure,
        up to the links inside the node (nccl-tests' busbw on multi-node DGX: ~8 x the NIC rate
        for all 8 GPUs of each node, the NIC rate for one GPU per node)."""
        assert group_size >= 1, f"group_size({group_size}) < 1"
        if spans_nodes or self.spans_nodes(group_size):
            ports = max(1, min(members_per_node, self.gpus_per_node))
            return min(self.gpu.inter_node_bandwidth_Bps * ports, self.gpu.intra_node_bandwidth_Bps)
        peer = self.gpu.intra_node_peer_bandwidth_Bps
        if peer is not None and group_size > 1:
            return min(self.gpu.intra_node_bandwidth_Bps, peer * (group_size - 1))
        return self.gpu.intra_node_bandwidth_Bps

    def latency_s(self, group_size: int, spans_nodes: bool) -> float:
        """Per-message latency of the link a collective over `group_size` GPUs uses."""
        if spans_nodes or self.spans_nodes(group_size):
            return self.gpu.inter_node_latency_s
        return self.gpu.intra_node_latency_s

    def describe(self) -> str:
        unit = "NVLink domain" if self.gpu.gpus_per_host else "node"  # a rack-scale domain spans hosts
        nodes = f"1 {unit}" if self.num_nodes == 1 else f"{self.num_nodes} {unit}s"
        return f"{self.num_gpus} x {self.gpu.display_name} ({nodes} of {self.gpus_per_node})"


# -- parsing ------------------------------------------------------------------------------------
def _fail(where: str, message: str) -> BadInput:
    return BadInput(f"{where}: {message}")


def _positive(where: str, key: str, value: Any, *, integer: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value <= 0 or (integer and value != int(value)):
        kind = "a positive whole number" if integer else "a positive number"
        raise _fail(where, f"field '{key}' must be {kind}, got {value!r}")
    return value


def parse_gpu(data: Any, *, where: str, default_name: str, origin: str) -> GPUSpec:
    """Validate one parsed GPU file and convert it to SI units; BadInput naming `where` and the field."""
    if data is None:
        raise _fail(where, "empty file; expected GPU fields (see profiles/README.md)")
    if not isinstance(data, dict):
        raise _fail(where, f"expected a mapping of fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(KNOWN_KEYS))
    if unknown:
        raise _fail(where, f"unknown field '{unknown[0]}'; fields are: {', '.join(KNOWN_KEYS)}")
    for key in _TEXTS:
        if key in data and not isinstance(data[key], str):
            raise _fail(where, f"field '{key}' must be text, got {data[key]!r}")
    name = data.get("name", default_name)
    if not _NAME_RE.match(name) or name == "cpu":
        why = "is reserved for the local CPU" if name == "cpu" else "must be lower-case letters, digits, '.', '-', '_'"
        field_name = "field 'name'" if "name" in data else "the name (from the file name)"
        raise _fail(where, f"{field_name}: {name!r} {why}")

    peaks = data.get("peak_tflops")
    if peaks is None:
        raise _fail(where, "missing field 'peak_tflops' (dense TFLOP/s per dtype)")
    if not isinstance(peaks, dict) or not peaks:
        raise _fail(where, f"field 'peak_tflops' must map dtypes ({', '.join(DTYPES)}) to TFLOP/s")
    peak_flops: dict[str, float] = {}
    for dtype, tflops in peaks.items():
        if dtype not in DTYPES:
            raise _fail(where, f"field 'peak_tflops': unknown dtype {dtype!r}; dtypes are: {', '.join(DTYPES)}")
        peak_flops[dtype] = float(_positive(where, f"peak_tflops.{dtype}", tflops)) * 1e12

    values: dict[str, Any] = {}
    for key, (attr, required) in _SCALARS.items():
        if data.get(key) is None:
            if required:
                raise _fail(where, f"missing field '{key}'")
            continue
        counts = key in ("gpus_per_node", "gpus_per_host")
        number = _positive(where, key, data[key], integer=counts)
        if key.endswith("_efficiency") and number > 1:
            raise _fail(where, f"field '{key}' is a share of the peak, at most 1, got {number!r}")
        values[attr] = int(number) if counts else _to_si(key, number)
    values["memory_bytes"] = int(round(values["memory_bytes"]))
    host = values.get("gpus_per_host")
    if host is not None and values["gpus_per_node"] % host:
        raise _fail(where, f"field 'gpus_per_host' ({host}) must divide 'gpus_per_node' ({values['gpus_per_node']})")

    factors = data.get("phase_factors") or {}
    if not isinstance(factors, dict) or any(k not in PHASES for k in factors):
        raise _fail(where, f"field 'phase_factors' must map phases ({', '.join(PHASES)}) to factors")
    values["phase_factors"] = tuple((k, float(_positive(where, f"phase_factors.{k}", v))) for k, v in factors.items())
    steps = data.get("optimizer_ns_per_param") or {}
    if not isinstance(steps, dict) or any(k not in OPTIMIZERS for k in steps):
        raise _fail(where, f"field 'optimizer_ns_per_param' must map optimizers ({', '.join(OPTIMIZERS)}) to nanoseconds")
    values["optimizer_steps"] = tuple((1, k, float(_positive(where, f"optimizer_ns_per_param.{k}", v)) / 1e9)
                                      for k, v in steps.items())
    lp = data.get("loss_parallel_ns_per_element") or {}
    if not isinstance(lp, dict) or any(k not in ("forward", "backward") or isinstance(v, bool) or not isinstance(v, (int, float))
                                       for k, v in lp.items()):
        raise _fail(where, "field 'loss_parallel_ns_per_element' must map forward and backward to nanoseconds")
    values["loss_parallel_steps"] = tuple((1, k, float(v) / 1e9) for k, v in lp.items())
    sources, uncertain = _parse_sources(data, where, origin)
    defaults = {"intra_node_latency_us": DEFAULT_INTRA_LATENCY_US, "inter_node_latency_us": DEFAULT_INTER_LATENCY_US}
    for key, default_us in defaults.items():
        attr = _SCALARS[key][0]
        if attr not in values:
            values[attr] = _to_si(key, default_us)
            sources[attr] = f"default {default_us:g} us (not in the file), rule of thumb"
            uncertain.append(attr)
    if "matmul_efficiency" not in values:
        values["matmul_efficiency"] = DEFAULT_MATMUL_EFFICIENCY
        sources["matmul_efficiency"] = f"uncertain: default {DEFAULT_MATMUL_EFFICIENCY:g} (not in the file); measured NVIDIA parts reach 80-86%"
        uncertain.append("matmul_efficiency")
    shapes = data.get("matmul_shapes")
    if shapes is not None and shapes not in SHAPE_TABLES:
        raise _fail(where, f"field 'matmul_shapes': no table for {shapes!r}; tables: {', '.join(SHAPE_TABLES)}")
    capability = data.get("compute_capability")
    if capability is not None and not re.fullmatch(r"\d+\.\d+", capability):
        raise _fail(where, f"field 'compute_capability': {capability!r} is not major.minor (\"9.0\")")
    return GPUSpec(
        name=name,
        display_name=data.get("display_name", name),
        vendor=data.get("vendor", "unknown"),
        matmul_shapes=shapes,
        compute_capability=capability,
        peak_flops=peak_flops,
        tdp_w=values.pop("tdp_w", None),
        sources=sources,
        origin=origin,
        uncertain=tuple(uncertain),
        **values,
    )


def _spec_key(where: str, key: str, context: str = "sources") -> str:
    """A YAML field name (``memory_gb``, ``peak_tflops.tf32``) -> the GPUSpec field it sets."""
    head, _, dtype = key.partition(".")
    if head == "peak_tflops" and (not dtype or dtype in DTYPES):
        return "peak_flops" + (f".{dtype}" if dtype else "")
    if head in _SCALARS and not dtype:
        return _SCALARS[head][0]
    if head in ("phase_factors", "compute_capability", "matmul_shapes") and not dtype:
        return head
    if head == "optimizer_ns_per_param" and not dtype:
        return "optimizer_steps"
    if head == "loss_parallel_ns_per_element" and not dtype:
        return "loss_parallel_steps"
    raise _fail(where, f"field '{context}' names unknown field {key!r}")


def _parse_sources(data: dict, where: str, origin: str) -> tuple[dict[str, str], list[str]]:
    raw = data.get("sources") or {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise _fail(where, "field 'sources' must map field names to text")
    sources = {_spec_key(where, str(k)): v for k, v in raw.items()}
    if origin != "packaged":  # packaged files must cite every number (a test checks)
        for key in ("peak_tflops", *_SCALARS):
            if data.get(key) is not None:
                sources.setdefault(_spec_key(where, key), f"user file {origin}")
    listed = data.get("uncertain") or []
    if not isinstance(listed, list):
        raise _fail(where, "field 'uncertain' must be a list of field names")
    return sources, [_spec_key(where, str(k), "uncertain") for k in listed]


def load_gpu_file(path: str | Path) -> GPUSpec:
    """Read one user GPU file (the format in this module's docstring)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path}: no such GPU file") from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror}") from None
    return parse_gpu(_load_yaml(text, str(path)), where=str(path), default_name=path.stem.lower(), origin=str(path))


def _load_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise BadInput(f"{where}{line}: not valid YAML: {problem}") from None


# -- the catalogue ------------------------------------------------------------------------------
def user_gpu_dirs() -> list[Path]:
    """Directories searched for user GPU files, later ones winning: config dir, then $PLAN_GPU_DIR."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    dirs = [config / "parallel-planner" / "gpus"]
    env = os.environ.get("PLAN_GPU_DIR")
    if env:
        if not Path(env).expanduser().is_dir():
            raise BadInput(f"PLAN_GPU_DIR={env}: no such directory")
        dirs.append(Path(env).expanduser())
    return [d for d in dirs if d.is_dir()]


_PACKAGED: dict[str, GPUSpec] = {}


def _packaged() -> dict[str, GPUSpec]:
    if not _PACKAGED:
        for key in profiles.packaged_names():
            where = f"profiles/{key}{profiles.SUFFIX}"
            data = _load_yaml(profiles.read_packaged(key), where)
            _PACKAGED[key] = parse_gpu(data, where=where, default_name=key, origin="packaged")
    return dict(_PACKAGED)


def load_catalogue() -> dict[str, GPUSpec]:
    """Packaged GPUs, then user files (a user file replaces a packaged GPU of the same name)."""
    catalogue = _packaged()
    for directory in user_gpu_dirs():
        seen: dict[str, Path] = {}
        for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")]):
            spec = load_gpu_file(path)
            if spec.name in seen:
                raise BadInput(f"{path}: GPU {spec.name!r} is already defined in {seen[spec.name]}")
            seen[spec.name] = path
            catalogue[spec.name] = spec
    return dict(sorted(catalogue.items()))


def _suggest(name: str, names: list[str]) -> list[str]:
    """Names that contain `name` (ignoring dashes), else the closest by difflib."""
    bare = name.replace("-", "").replace("_", "")
    partial = [n for n in names if bare and bare in n.replace("-", "")]
    return partial[:4] or difflib.get_close_matches(name, names, n=3, cutoff=0.5)


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """A GPU by catalogue name, ``cpu`` (the measured local CPU), or a path to a GPU ``.yaml`` file."""
    if isinstance(name, GPUSpec):
        return name
    key = str(name).strip()
    if key.lower() == "cpu":
        from planner.local_device import measure_local_cpu

        return measure_local_cpu()
    if key.endswith((".yaml", ".yml")) or os.sep in key:
        return load_gpu_file(key)
    catalogue = load_catalogue()
    if key.lower() in catalogue:
        return catalogue[key.lower()]
    names = [*catalogue, "cpu"]
    hint = _suggest(key.lower(), names)
    did_you_mean = f"did you mean {' or '.join(hint)}? " if hint else ""
    raise BadInput(
        f"unknown GPU {key!r}; {did_you_mean}known: {', '.join(names)} "
        f"(`plan gpus` lists them; add your own as a YAML file in $PLAN_GPU_DIR)"
    )


def make_cluster(gpu: str | GPUSpec, num_gpus: int, gpus_per_node: int | None = None,
                 inter_node_gbps: float | None = None) -> Cluster:
    """`num_gpus` of `gpu` in whole nodes; `gpus_per_node` defaults to the GPU's typical node;
    `inter_node_gbps`: the network between nodes, Gb/s per GPU per direction (the NIC rate: 400 for
    one NDR port per GPU), instead of the catalogue's.

    Fewer GPUs than a node holds make one partial node. The measured local CPU is one host: its
    cores are shared by the `num_gpus` processes (``planner.local_device.share_host``).
    """
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if inter_node_gbps is not None:
        if not inter_node_gbps > 0:
            raise BadInput(f"--inter-node-gbps must be positive, got {inter_node_gbps:g}")
        spec = replace(spec, inter_node_bandwidth_Bps=inter_node_gbps * 1e9 / 8,
                       sources={**spec.sources, "inter_node_bandwidth_Bps": f"--inter-node-gbps {inter_node_gbps:g}"})
    for label, value in (("number of GPUs", num_gpus), ("GPUs per node", gpus_per_node)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadInput(f"{label} must be a whole number of at least 1, got {value!r}")
    if spec.origin == "measured":
        from planner.local_device import share_host

        spec = share_host(spec, num_gpus)
        gpus_per_node = gpus_per_node or num_gpus
    per_node = min(gpus_per_node or spec.gpus_per_node, num_gpus)
    if num_gpus % per_node and gpus_per_node is None and spec.gpus_per_host:
        # a rack-scale NVLink domain the cluster does not fill: equal parts of racks, whole hosts each
        per_node = max((d for d in range(spec.gpus_per_host, per_node + 1, spec.gpus_per_host) if num_gpus % d == 0),
                       default=per_node)
    if num_gpus % per_node:
        raise BadInput(
            f"{num_gpus} GPUs do not fill whole nodes of {per_node} ({spec.name}); "
            f"use a multiple of {per_node} or set the GPUs per node"
        )
    return Cluster(gpu=spec, num_gpus=num_gpus, gpus_per_node=per_node)


__all__ = [
    "DTYPES", "GPUSpec", "Cluster", "load_catalogue", "load_gpu_file", "get_gpu", "make_cluster",
    "parse_gpu", "user_gpu_dirs",
]
