"""`plan gpus`: the hardware catalogue as a terminal table or JSON. Never runs the CPU benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

import profiles
from planner import schema
from planner.hardware import GPUSpec, load_catalogue, user_gpu_dirs
from planner.local_device import cache_path, cached_local_cpu
from planner.report.units import make_console

CPU_NOT_MEASURED = "measured on first use"


def _num(value: float) -> str:
    """Three significant figures, no exponent: 1.55, 12.5, 448, 5,300."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def _half_precision(spec: GPUSpec) -> str:
    """Dense bf16 TFLOP/s, or fp16 marked '*' where the GPU has no bf16; '?' when an estimate."""
    for dtype, mark in (("bf16", ""), ("fp16", "*")):
        if dtype in spec.peak_flops:
            unsure = {"peak_flops", f"peak_flops.{dtype}"} & set(spec.uncertain)
            tflops = spec.peak_flops[dtype] / 1e12
            text = f"{tflops:,.1f}" if tflops >= 10 else f"{tflops:.3g}"
            return text + mark + ("?" if unsure else "")
    return "-"


def _row(spec: GPUSpec) -> list[str]:
    def cell(field_name: str, value: float) -> str:
        return _num(value) + ("?" if field_name in spec.uncertain else "")

    origin = spec.origin if spec.origin in ("packaged", "measured") else Path(spec.origin).name
    return [
        spec.name,
        spec.display_name,
        cell("memory_bytes", spec.memory_bytes / 1e9),
        _half_precision(spec),
        cell("hbm_bandwidth_Bps", spec.hbm_bandwidth_Bps / 1e12),
        cell("intra_node_bandwidth_Bps", spec.intra_node_bandwidth_Bps / 1e9),
        cell("inter_node_bandwidth_Bps", spec.inter_node_bandwidth_Bps / 1e9),
        cell("gpus_per_node", spec.gpus_per_node),
        origin,
    ]


def _cpu_placeholder() -> dict[str, Any]:
    names = [f.name for f in GPUSpec.__dataclass_fields__.values()]
    row: dict[str, Any] = dict.fromkeys(names)
    row.update(name="cpu", display_name="local CPU core", vendor="local", origin=CPU_NOT_MEASURED)
    return row


def render_gpus(as_json: bool = False) -> None:
    """Print the catalogue (packaged and user GPUs, plus the local CPU) to stdout."""
    specs = list(load_catalogue().values())
    cpu = cached_local_cpu()
    if as_json:
        rows = [schema.to_jsonable(s) for s in specs]
        rows.append(schema.to_jsonable(cpu) if cpu is not None else _cpu_placeholder())
        print(json.dumps(rows, indent=2))
        return

    console = make_console()
    wide = console.width >= 110  # the display name fits; in narrower terminals it is left out
    table = Table(
        title="GPU catalogue: dense peaks; bandwidths per GPU, per direction",
        box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False,
    )
    headers = ("--gpu", "GPU", "mem\nGB", "bf16\nTFLOP/s", "HBM\nTB/s", "intra\nGB/s", "inter\nGB/s",
               "GPUs\n/node", "origin")
    keep = [i for i, h in enumerate(headers) if wide or h != "GPU"]
    for i in keep:
        header = headers[i]
        text = header in ("GPU", "origin", "--gpu")
        table.add_column(header, justify="left" if text else "right", no_wrap=header != "origin")
    rows = [_row(spec) for spec in specs]
    rows.append(_row(cpu) if cpu is not None else ["cpu", "local CPU core", *["-"] * 6, CPU_NOT_MEASURED])
    for row in rows:
        table.add_row(*(row[i] for i in keep))

    console.print(table)
    dirs = ", ".join(str(d) for d in user_gpu_dirs()) or "none yet"
    packaged = Path(profiles.packaged_location("h100-sxm-80gb")).parent
    console.print(
        "? = estimate (the file's sources say why).  * = fp16: the GPU has no bf16.\n"
        f"Add a GPU: copy a file from {packaged} (format in its README.md) into $PLAN_GPU_DIR or "
        "~/.config/parallel-planner/gpus/, or pass --gpu path/to/gpu.yaml. "
        f"User GPU directories now: {dirs}.\n"
        f"'cpu' is this machine, one core per device, measured by a ~10 s benchmark on first use "
        f"and cached in {cache_path()}.",
        highlight=False,
        soft_wrap=False,
    )
