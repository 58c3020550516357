"""The local CPU as a device, so plans for ``--gpu cpu`` can be run and checked on this machine.

One "device" is one core running one gloo process. A short microbenchmark (a few seconds) measures
what the catalogue files state for GPUs:

- matmul throughput: median of timed square matmuls (1024 and 2048, after a warm-up) with torch
  using all its threads, per dtype (fp32, bf16), divided by the cores -> peak FLOP/s per device;
- memory bandwidth: median time of a 64 MB tensor copy (read + write), divided by the cores;
- gloo all-reduce between 2 local processes on 127.0.0.1: bus bandwidth (the best per-size median
  over 1-64 MB) and small-message latency (median of 4-byte all-reduces), used for both the
  intra-node and inter-node links.

Results are cached as JSON in ``$XDG_CACHE_HOME/parallel-planner/local_cpu.json`` (default
``~/.cache``), one entry per key (host, CPU model, core count, torch version and torch threads); a
key without an entry measures and adds one, and ``refresh=True`` measures its key's again. What
``plan calibrate --gpu cpu`` measures (and ``--from-run`` refits) is kept beside it, in
``local_cpu_calibration.json``, keyed by the same but the threads. Memory is read fresh from
/proc/meminfo each time (MemAvailable, shared by the devices), never cached.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from planner.errors import PlanError
from planner.gpu_spec import COLLECTIVE_KINDS, GPUSpec

CACHE_VERSION = 1
MATMUL_SIZES = (1024, 2048)
ALLREDUCE_MB = (1, 4, 16, 64)
_REPEATS = 5


# -- identity of this machine ---------------------------------------------------------------------
def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def available_memory_bytes() -> int:
    """MemAvailable (else MemTotal) from /proc/meminfo; os.sysconf where there is none."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        for key in ("MemAvailable", "MemTotal"):
            if key in fields:
                return int(fields[key].split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_key() -> dict[str, Any]:
    return {
        "version": CACHE_VERSION,
        "host": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cores": num_cores(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "parallel-planner" / "local_cpu.json"


# -- the microbenchmarks --------------------------------------------------------------------------
def _median_time(fn: Callable[[], Any], repeats: int = _REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype) -> float:
    """Best per-size median FLOP/s of square matmuls in `dtype`, with all of torch's threads."""
    best = 0.0
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        seconds = _median_time(lambda: torch.mm(a, b))
        best = max(best, 2 * n**3 / seconds)
        if seconds > 0.5:  # a slow dtype on this CPU: one size is enough
            break
    return best


def copy_bandwidth_Bps(num_bytes: int = 64 * 2**20) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _median_time(lambda: dst.copy_(src))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    """One process of the gloo benchmark; rank 0 writes {latency_s, busbw_Bps per MB} to `out_path`."""
    import torch.distributed as dist

    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=dt.timedelta(seconds=60),
    )
    try:
        tiny = torch.zeros(1)
        for _ in range(10):
            dist.all_reduce(tiny)
        latency = _median_time(lambda: dist.all_reduce(tiny), repeats=50)
        busbw = {}
        for mb in ALLREDUCE_MB:
            t = torch.ones(mb * 2**20 // 4)
            seconds = _median_time(lambda: dist.all_reduce(t))
            # nccl-tests bus bandwidth: algbw * 2(n-1)/n, comparable to one link's per-direction rate
            busbw[str(mb)] = mb * 2**20 / seconds * 2 * (world_size - 1) / world_size
        if rank == 0:
            Path(out_path).write_text(json.dumps({"latency_s": latency, "busbw_Bps": busbw}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_allreduce(world_size: int = 2) -> dict[str, Any]:
    """Gloo all-reduce figures between `world_size` local processes (spawned, a few seconds)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        try:
            mp.spawn(_gloo_worker, args=(world_size, _free_port(), out), nprocs=world_size, join=True)
            return json.loads(Path(out).read_text())
        except Exception as exc:  # noqa: BLE001 - any failure here is one message for the user
            last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            raise PlanError(f"measuring gloo all-reduce on 127.0.0.1 failed: {last}") from exc


def run_benchmark() -> dict[str, Any]:
    """Measure this machine: whole-host figures, before dividing among the cores."""
    start = time.perf_counter()
    host_flops = {"fp32": matmul_flops(torch.float32), "bf16": matmul_flops(torch.bfloat16)}
    result = {
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "host_flops": host_flops,
        "host_copy_Bps": copy_bandwidth_Bps(),
        "gloo": gloo_allreduce(),
        "measured_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    result["benchmark_s"] = round(time.perf_counter() - start, 2)
    return result


# -- the cache and the spec -----------------------------------------------------------------------
CACHE_ENTRIES = 8
"""Figures kept per cache file: one entry per key (torch's thread count is part of it, so a plan
from a process with OMP_NUM_THREADS=1 measures beside the default-thread figures, not over them)."""


def _cache_entries() -> list[dict[str, Any]]:
    """Every entry of the cache file (a file from before entries: its one entry), or []."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("entries", [data]) if isinstance(data, dict) else []
    return [e for e in entries if isinstance(e, dict)]


def _read_cache(key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached figures for `key`, or None when absent, for another machine, or unreadable."""
    for data in _cache_entries():
        if data.get("key") == key:
            try:
                _spec_from(data)  # complete enough to use
                return data
            except (KeyError, TypeError, ValueError, AttributeError):
                return None
    return None


def _write_cache(data: dict[str, Any]) -> None:
    """Keep `data` as its key's entry, beside the other keys' (the newest CACHE_ENTRIES)."""
    path = cache_path()
    others = [e for e in _cache_entries() if e.get("key") != data["key"]]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"entries": (others + [data])[-CACHE_ENTRIES:]}, indent=2))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time


def _spec_from(data: dict[str, Any]) -> GPUSpec:
    key, cores = data["key"], data["key"]["cores"]
    gloo = data["gloo"]
    busbw = max(gloo["busbw_Bps"].values())
    when = f"measured on {key['host']} at {data['measured_at']} (load average {data.get('load_avg_1min', '?')})"
    sources = {
        "peak_flops": f"{when}: median torch.mm {'/'.join(map(str, MATMUL_SIZES))}^2 "
                      f"with {key['torch_threads']} threads, divided by {cores} cores",
        "memory_bytes": f"MemAvailable in /proc/meminfo now, divided by {cores} cores",
        "hbm_bandwidth_Bps": f"{when}: median 64 MB tensor copy, divided by {cores} cores",
        "intra_node_bandwidth_Bps": f"{when}: gloo all-reduce bus bandwidth, 2 processes, "
                                    f"best of the medians at {'/'.join(map(str, ALLREDUCE_MB))} MB",
        "intra_node_latency_s": f"{when}: median 4-byte gloo all-reduce, 2 processes",
        "gpus_per_node": f"{cores} cores (one gloo process per core)",
    }
    sources["inter_node_bandwidth_Bps"] = sources["intra_node_bandwidth_Bps"] + " (one host: same as intra-node)"
    sources["inter_node_latency_s"] = sources["intra_node_latency_s"] + " (one host: same as intra-node)"
    slowdown, collectives, optimizer_steps, loss_parallel, tp_host = (), (), (), (), {}
    stored = _read_calibration()
    calibration = stored.get("calibration")
    if calibration:
        counts = {int(n): c for n, c in calibration["counts"].items()}
        slowdown = tuple(sorted((n, float(c["slowdown"])) for n, c in counts.items()))
        collectives = tuple(sorted(
            (n, kind, float(f["latency_s"]), float(f["busbw_Bps"]))
            for n, c in counts.items() for kind, f in c.get("collectives", {}).items()
        ))
        at = f"plan calibrate on {key['host']} at {calibration['measured_at']}"
        sources["process_slowdown"] = (f"{at}: median seconds of a fixed training step in each of N processes sharing "
                                       f"the {cores} cores, over one process with all of them (N = {', '.join(map(str, counts))})")
        sources["collectives"] = (f"{at}: gloo all-reduce, all-gather, reduce-scatter and send/recv among N local "
                                  "processes, 4 KiB-16 MiB, latency and bus bandwidth fitted")
        optimizer_steps = tuple(sorted((n, name, float(v)) for n, c in counts.items()
                                       for name, v in c.get("optimizer_s_per_param", {}).items()))
        if optimizer_steps:
            sources["optimizer_steps"] = (f"{at}: median seconds of a torch.optim AdamW / SGD step over 4.2 M fp32 "
                                          "parameters, N processes stepping at once")
        loss_parallel = tuple(sorted((n, phase, float(v)) for n, c in counts.items()
                                     for phase, v in c.get("loss_parallel_s_per_element", {}).items()))
        if loss_parallel:
            sources["loss_parallel_steps"] = (f"{at}: loss_parallel's seconds per fp32 logit element beyond a fused "
                                              "cross-entropy, N processes at once (runtime.calibrate.loss_parallel_s)")
        for phase in ("forward", "backward"):
            if f"tp_{phase}_overhead_s" in calibration:
                tp_host[f"tp_{phase}_overhead_s"] = float(calibration[f"tp_{phase}_overhead_s"])
                sources[f"tp_{phase}_overhead_s"] = (f"{at}: DTensor's host seconds per tensor-parallel Linear {phase}, "
                                                     "one process (runtime.calibrate.tp_overhead_s)")
    factors = tuple((k, float(v)) for k, v in (stored.get("phase_factors") or {}).get("factors", {}).items())
    if factors:
        refit = stored["phase_factors"]
        sources["phase_factors"] = f"plan calibrate --from-run on {key['host']} at {refit['measured_at']}: {refit['note']}"
    return GPUSpec(
        name="cpu",
        display_name=f"local CPU core ({key['cpu_model']})",
        vendor="local",
        peak_flops={dtype: flops / cores for dtype, flops in data["host_flops"].items()},
        memory_bytes=available_memory_bytes() // cores,
        hbm_bandwidth_Bps=data["host_copy_Bps"] / cores,
        intra_node_bandwidth_Bps=busbw,
        intra_node_latency_s=gloo["latency_s"],
        inter_node_bandwidth_Bps=busbw,
        inter_node_latency_s=gloo["latency_s"],
        gpus_per_node=cores,
        tdp_w=None,
        sources=sources,
        origin="measured",
        process_slowdown=slowdown,
        collectives=collectives,
        optimizer_steps=optimizer_steps,
        loss_parallel_steps=loss_parallel,
        phase_factors=factors,
        **tp_host,
    )


def cached_local_cpu() -> GPUSpec | None:
    """The local CPU from the cache if it holds this machine's figures; never measures."""
    data = _read_cache(cache_key())
    return _spec_from(data) if data is not None else None


def measure_local_cpu(refresh: bool = False) -> GPUSpec:
    """The local CPU as a device: from the cache, else measured (a few seconds) and cached (a
    refresh keeps what `plan calibrate --gpu cpu` measured on this machine: another file)."""
    key = cache_key()
    data = None if refresh else _read_cache(key)
    if data is None:
        data = {"key": key, **run_benchmark()}
        _write_cache(data)
    return _spec_from(data)


def calibration_key() -> dict[str, Any]:
    """What `plan calibrate --gpu cpu`'s figures depend on: the machine and torch, not the threads
    of the process that plans (the runs set their own)."""
    return {k: v for k, v in cache_key().items() if k != "torch_threads"}


def calibration_path() -> Path:
    return cache_path().with_name("local_cpu_calibration.json")


def _read_calibration() -> dict[str, Any]:
    """This machine's calibration ({"calibration": ..., "phase_factors": ...}), or {}."""
    try:
        data = json.loads(calibration_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("key") == calibration_key() else {}


def _write_calibration(update: dict[str, Any], drop: tuple[str, ...] = ()) -> None:
    data = {**_read_calibration(), **update, "key": calibration_key()}
    for name in drop:
        data.pop(name, None)
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def store_phase_factors(factors: dict[str, float], note: str) -> GPUSpec:
    """Keep the phase factors `plan calibrate --from-run` refit (runtime.calibrate.refit) for this
    machine; the spec every later `--gpu cpu` plan gets."""
    _write_calibration({"phase_factors": {"factors": factors, "note": note,
                                          "measured_at": dt.datetime.now().astimezone().isoformat(timespec="seconds")}})
    return measure_local_cpu()


MIN_SLOWDOWN = 0.9
"""The least a process count's step may take over the one-process step: N processes sharing the
cores each step at least as slowly as one process alone, less a margin for noise. Below it,
`store_calibration` refuses the measurement."""


def store_calibration(results: list[dict[str, Any]]) -> GPUSpec:
    """Keep what `plan calibrate --gpu cpu` measured (runtime.calibrate: one result per process
    count, one process among them) with this machine's other figures; the spec every later
    `--gpu cpu` plan gets."""
    single = next((r for r in results if r["processes"] == 1), None)
    if single is None:
        raise PlanError("plan calibrate: the local CPU needs a measurement with one process")
    for r in results:
        # one process among N cannot step faster than one process alone with every core: where it
        # seems to, other load slowed the one-process launch (on this VM a neighbour's burst once
        # made it 0.34 s against its usual 0.04), and every plan would inherit the error
        if r["processes"] > 1 and r["step_s"] < MIN_SLOWDOWN * single["step_s"]:
            raise PlanError(
                f"plan calibrate: the machine was busy while measuring: one process's step took {single['step_s']:.3f} s, "
                f"each of {r['processes']} processes' {r['step_s']:.3f} s; nothing kept (the last calibration stays): "
                "calibrate again when the machine is idle")
    counts = {}
    for r in results:
        entry: dict[str, Any] = {"step_s": r["step_s"], "slowdown": r["step_s"] / single["step_s"], "collectives": {
            kind: {k: r[kind][k] for k in ("latency_s", "busbw_Bps")}
            for kind in COLLECTIVE_KINDS if kind in r
        }}
        for key in ("optimizer_s_per_param", "loss_parallel_s_per_element"):
            if key in r:
                entry[key] = r[key]
        counts[str(r["processes"])] = entry
    tp = {k: single[k] for k in ("tp_forward_overhead_s", "tp_backward_overhead_s") if k in single}
    # phase factors refit against the old figures are dropped: refit again from new runs
    _write_calibration({"calibration": {"measured_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                                        "counts": counts, **tp}}, drop=("phase_factors",))
    return measure_local_cpu()


def share_host(spec: GPUSpec, num_procs: int) -> GPUSpec:
    """The local CPU split among `num_procs` processes instead of one per core.

    Compute, memory and memory bandwidth are host totals shared evenly (a process gets
    cores/num_procs of a core's share: more than one when there are fewer processes than cores,
    provided it runs cores/num_procs threads). Host work of one thread (DTensor's per-Linear
    overhead) takes turns past one process per core: times num_procs/cores. The gloo links are
    left as measured.
    """
    assert spec.origin == "measured", f"share_host expects the measured CPU, got {spec.origin}"
    scale = spec.gpus_per_node / num_procs
    turns = max(1.0, 1 / scale)  # one thread's host work (DTensor's) waits its turn past one per core
    note = f" (x{spec.gpus_per_node}/{num_procs}: host shared by {num_procs} processes)"
    sources = dict(spec.sources)
    for field_name in ("peak_flops", "memory_bytes", "hbm_bandwidth_Bps"):
        sources[field_name] = sources.get(field_name, "") + note
    return replace(
        spec,
        peak_flops={dtype: flops * scale for dtype, flops in spec.peak_flops.items()},
        memory_bytes=int(spec.memory_bytes * scale),
        hbm_bandwidth_Bps=spec.hbm_bandwidth_Bps * scale,
        gpus_per_node=num_procs,
        tp_forward_overhead_s=spec.tp_forward_overhead_s * turns,
        tp_backward_overhead_s=spec.tp_backward_overhead_s * turns,
        sources=sources,
    )


if __name__ == "__main__":  # python -m planner.local_device: re-measure and show the figures
    spec = measure_local_cpu(refresh=True)
    peaks = ", ".join(f"{dtype} {flops / 1e9:,.1f}" for dtype, flops in spec.peak_flops.items())
    print(f"{spec.display_name}: {spec.gpus_per_node} devices, each: {peaks} GFLOP/s, "
          f"{spec.memory_bytes / 1e9:.1f} GB, memory {spec.hbm_bandwidth_Bps / 1e9:.1f} GB/s; "
          f"gloo {spec.intra_node_bandwidth_Bps / 1e9:.2f} GB/s, {spec.intra_node_latency_s * 1e6:.0f} us")
    print(f"cached in {cache_path()}")
