"""The hardware catalogue: packaged files, user files, lookups and Cluster validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from planner import schema
from planner.errors import BadInput
from planner.hardware import Cluster, GPUSpec, get_gpu, load_catalogue, load_gpu_file, make_cluster

REQUIRED = ("a100-40gb", "a100-80gb", "h100-sxm-80gb", "h200", "b200", "v100-32gb", "l40s", "rtx4090", "mi300x")
NUMERIC = (
    "peak_flops", "memory_bytes", "hbm_bandwidth_Bps", "intra_node_bandwidth_Bps", "intra_node_latency_s",
    "inter_node_bandwidth_Bps", "inter_node_latency_s", "gpus_per_node", "tdp_w", "intra_node_peer_bandwidth_Bps",
)
MINIMAL = {
    "display_name": "Test GPU",
    "peak_tflops": {"bf16": 100, "fp32": 10},
    "memory_gb": 16,
    "hbm_bandwidth_GBps": 1000,
    "intra_node_bandwidth_GBps": 100,
    "inter_node_bandwidth_GBps": 10,
    "gpus_per_node": 4,
}


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    """Keep the developer's own ~/.config GPU files out of these tests."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("PLAN_GPU_DIR", raising=False)


@pytest.fixture
def gpu_dir(tmp_path, monkeypatch):
    directory = tmp_path / "gpus"
    directory.mkdir()
    monkeypatch.setenv("PLAN_GPU_DIR", str(directory))
    return directory


def write(directory: Path, name: str, data) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# -- packaged catalogue -------------------------------------------------------------------------
def test_catalogue_has_every_required_gpu():
    catalogue = load_catalogue()
    assert set(REQUIRED) <= set(catalogue)
    for name, spec in catalogue.items():
        assert spec.name == name and spec.origin == "packaged"
        assert spec.gpus_per_node >= 1 and spec.memory_bytes > 0


@pytest.mark.parametrize("name", REQUIRED)
def test_every_number_has_a_source(name):
    spec = get_gpu(name)
    for field in NUMERIC:
        if getattr(spec, field) is not None:
            assert spec.sources.get(field, "").strip(), f"{name}: no source for {field}"
    # what is marked uncertain says so in its source, and the other way round
    for field in spec.uncertain:
        text = spec.sources.get(field) or spec.sources[field.split(".")[0]]
        assert "uncertain" in text, f"{name}: {field} is marked uncertain but its source does not say why"
    for field, text in spec.sources.items():
        if text.startswith("uncertain"):
            assert field in spec.uncertain, f"{name}: source of {field} says uncertain but it is not listed"


def test_dense_peaks_not_sparse():
    h100 = get_gpu("h100-sxm-80gb")
    assert h100.peak("bf16") == 989.4e12  # dense; 1,979 is the 2:4-sparse headline
    assert h100.peak("torch.bfloat16") == h100.peak("bfloat16") == 989.4e12
    assert h100.peak("fp8") == 1978.9e12
    assert get_gpu("a100-80gb").peak("bf16") == 312e12
    assert get_gpu("mi300x").peak("bf16") == 1307.4e12
    assert get_gpu("rtx4090").peak("bf16") == 165.2e12  # fp32 accumulation, the training rate


def test_spot_values_in_si_units():
    h200, a100 = get_gpu("h200"), get_gpu("a100-40gb")
    assert h200.memory_bytes == pytest.approx(143771 * 2**20, rel=1e-5) and h200.hbm_bandwidth_Bps == 4800e9  # nvidia-smi MiB
    assert a100.intra_node_bandwidth_Bps == 300e9 and a100.inter_node_bandwidth_Bps == 25e9
    assert get_gpu("h100-sxm-80gb").inter_node_bandwidth_Bps == 50e9
    assert get_gpu("v100-32gb").intra_node_bandwidth_Bps == 150e9
    assert get_gpu("mi300x").intra_node_bandwidth_Bps == 448e9
    assert get_gpu("l40s").intra_node_bandwidth_Bps == 32e9
    assert get_gpu("h100-sxm-80gb").intra_node_latency_s == pytest.approx(8e-6)


def test_missing_dtype_is_a_clear_error():
    with pytest.raises(BadInput, match=r"v100-32gb .*no bf16 peak; it has: fp16, fp32"):
        get_gpu("v100-32gb").peak("bf16")


@pytest.mark.parametrize(
    "typo, expected",
    [("h100", "h100-sxm-80gb"), ("a100", "a100-40gb"), ("mi300", "mi300x"), ("rtx-4090", "rtx4090")],
)
def test_unknown_name_suggests_close_names(typo, expected):
    with pytest.raises(BadInput) as info:
        get_gpu(typo)
    message = str(info.value)
    assert f"unknown GPU {typo!r}" in message and "did you mean" in message and expected in message
    assert "\n" not in message


def test_lookup_ignores_case():
    assert get_gpu("H100-SXM-80GB").name == "h100-sxm-80gb"


# -- user files ---------------------------------------------------------------------------------
def test_user_dir_adds_a_gpu(gpu_dir):
    path = write(gpu_dir, "my-gpu", {**MINIMAL, "sources": {"memory_gb": "my datasheet"}})
    spec = get_gpu("my-gpu")
    assert spec.origin == str(path) and spec.display_name == "Test GPU"
    assert spec.peak("bf16") == 100e12 and spec.memory_bytes == 16e9 and spec.gpus_per_node == 4
    assert spec.sources["memory_bytes"] == "my datasheet"
    assert str(path) in spec.sources["hbm_bandwidth_Bps"]  # unsourced numbers name the file
    assert "intra_node_latency_s" in spec.uncertain  # defaulted latency is flagged as an estimate
    assert "my-gpu" in load_catalogue()


def test_user_file_replaces_packaged_gpu(gpu_dir):
    write(gpu_dir, "h100-sxm-80gb", {**MINIMAL, "inter_node_bandwidth_GBps": 25})
    spec = get_gpu("h100-sxm-80gb")
    assert spec.inter_node_bandwidth_Bps == 25e9 and spec.origin.endswith("h100-sxm-80gb.yaml")


def test_config_dir_is_searched(tmp_path):
    directory = tmp_path / "config" / "parallel-planner" / "gpus"
    directory.mkdir(parents=True)
    write(directory, "cfg-gpu", MINIMAL)
    assert get_gpu("cfg-gpu").origin == str(directory / "cfg-gpu.yaml")


def test_gpu_by_path(tmp_path):
    path = write(tmp_path, "Loose", MINIMAL)
    spec = get_gpu(str(path))
    assert spec.name == "loose" and spec.origin == str(path)


@pytest.mark.parametrize(
    "data, field",
    [
        ({k: v for k, v in MINIMAL.items() if k != "memory_gb"}, "memory_gb"),
        ({**MINIMAL, "hbm_bandwidth_GBps": -5}, "hbm_bandwidth_GBps"),
        ({**MINIMAL, "gpus_per_node": 2.5}, "gpus_per_node"),
        ({**MINIMAL, "inter_node_bandwidth_GBps": "fast"}, "inter_node_bandwidth_GBps"),
        ({**MINIMAL, "peak_tflops": {"bf16": 0}}, "peak_tflops.bf16"),
        ({**MINIMAL, "peak_tflops": {"int8": 10}}, "peak_tflops"),
        ({**MINIMAL, "memroy_gb": 16}, "memroy_gb"),
        ({**MINIMAL, "uncertain": ["nvlink"]}, "uncertain"),
        ({**MINIMAL, "name": "cpu"}, "name"),
        ({**MINIMAL, "attention_efficiency": 35}, "attention_efficiency"),
        ({**MINIMAL, "fp8_matmul_efficiency": 71}, "fp8_matmul_efficiency"),
        ({**MINIMAL, "gpus_per_host": 3}, "gpus_per_host"),
        ({**MINIMAL, "matmul_shapes": "sm_70"}, "matmul_shapes"),
        ({**MINIMAL, "matmul_shapes": 90}, "matmul_shapes"),
    ],
)
def test_malformed_user_file_names_file_and_field(gpu_dir, data, field):
    path = write(gpu_dir, "broken", data)
    with pytest.raises(BadInput) as info:
        get_gpu("broken")
    message = str(info.value)
    assert message.startswith(str(path)) and f"'{field}'" in message and "\n" not in message


def test_bad_yaml_names_file_and_line(gpu_dir):
    path = write(gpu_dir, "broken", "name: x\npeak_tflops: {bf16: 1\nmemory_gb: [\n")
    with pytest.raises(BadInput, match=rf"^{path}:\d+: not valid YAML"):
        load_catalogue()


def test_empty_and_missing_files(tmp_path, monkeypatch):
    with pytest.raises(BadInput, match="empty file"):
        load_gpu_file(write(tmp_path, "empty", ""))
    with pytest.raises(BadInput, match="no such GPU file"):
        get_gpu(str(tmp_path / "nope.yaml"))
    monkeypatch.setenv("PLAN_GPU_DIR", str(tmp_path / "missing"))
    with pytest.raises(BadInput, match="PLAN_GPU_DIR=.*no such directory"):
        load_catalogue()


# -- Cluster ------------------------------------------------------------------------------------
def test_cluster_nodes_and_links():
    cluster = make_cluster("h100-sxm-80gb", 32)
    assert (cluster.num_nodes, cluster.gpus_per_node) == (4, 8)
    assert cluster.bandwidth_Bps(8, spans_nodes=False) == 450e9
    assert cluster.bandwidth_Bps(16, spans_nodes=False) == 50e9  # bigger than a node: must leave it
    assert cluster.bandwidth_Bps(4, spans_nodes=True) == 50e9
    assert cluster.latency_s(2, spans_nodes=True) == cluster.gpu.inter_node_latency_s
    assert cluster.describe() == "32 x NVIDIA H100 SXM5 80GB (4 nodes of 8)"


def test_mesh_peer_links_scale_with_group():
    cluster = make_cluster("mi300x", 8)
    assert cluster.bandwidth_Bps(2, spans_nodes=False) == 64e9  # one xGMI link
    assert cluster.bandwidth_Bps(8, spans_nodes=False) == 448e9  # all seven


def test_cluster_partial_node_and_explicit_node_size():
    assert make_cluster("a100-80gb", 4).gpus_per_node == 4
    cluster = make_cluster(get_gpu("rtx4090"), 8, gpus_per_node=4)
    assert (cluster.num_nodes, cluster.gpus_per_node) == (2, 4)


def test_a_rack_scale_nvlink_domain_is_filled_host_by_host():
    """GB200 NVL72: 72 GPUs per NVLink domain, 4 per host (compute tray). A cluster that does not
    fill whole racks takes equal parts of racks, whole trays each; a node size given is kept."""
    assert make_cluster("gb200", 8).gpus_per_node == 8
    assert make_cluster("gb200", 144).describe() == "144 x NVIDIA GB200 NVL72 186GB (2 NVLink domains of 72)"
    assert (make_cluster("gb200", 256).num_nodes, make_cluster("gb200", 256).gpus_per_node) == (4, 64)
    assert make_cluster("gb200", 96).gpus_per_node == 48
    assert make_cluster("gb200", 256, gpus_per_node=4).gpus_per_node == 4
    with pytest.raises(BadInput, match="do not fill whole nodes of 72"):
        make_cluster("gb200", 74)  # no whole-tray divisor of 74 up to 72


@pytest.mark.parametrize(
    "num_gpus, per_node, pattern",
    [(12, None, "12 GPUs do not fill whole nodes of 8"), (0, None, "number of GPUs must be"),
     (8, 0, "GPUs per node must be"), (True, None, "number of GPUs must be"), (16, 3, "nodes of 3")],
)
def test_cluster_validation(num_gpus, per_node, pattern):
    with pytest.raises(BadInput, match=pattern):
        make_cluster("h100-sxm-80gb", num_gpus, per_node)


def test_cluster_json_round_trip():
    cluster = make_cluster("v100-32gb", 16)
    data = schema.to_jsonable(cluster)
    assert schema._build(Cluster, data) == cluster
    assert dataclasses.is_dataclass(GPUSpec) and isinstance(data["gpu"]["peak_flops"], dict)


# -- the local CPU ------------------------------------------------------------------------------
def test_local_cpu_measured_then_cached(tmp_path, monkeypatch):
    from planner import local_device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert local_device.cached_local_cpu() is None
    spec = get_gpu("cpu")
    assert spec.name == "cpu" and spec.origin == "measured"
    assert spec.peak("fp32") > 0 and spec.peak("bf16") > 0 and spec.memory_bytes > 0
    assert spec.hbm_bandwidth_Bps > 0 and spec.intra_node_bandwidth_Bps > 0 and spec.intra_node_latency_s > 0
    assert spec.gpus_per_node == local_device.num_cores()
    assert spec.sources["peak_flops"].startswith("measured on")
    assert local_device.cache_path().is_file()

    def no_benchmark():
        raise AssertionError("the cached figures should have been used")

    monkeypatch.setattr(local_device, "run_benchmark", no_benchmark)
    again = local_device.measure_local_cpu()
    assert again.peak_flops == spec.peak_flops and again.intra_node_bandwidth_Bps == spec.intra_node_bandwidth_Bps

    # one host shared by 4 processes: each gets cores/4 of the compute and memory
    cluster = make_cluster(spec, 4)
    cores = spec.gpus_per_node
    assert (cluster.num_nodes, cluster.gpus_per_node) == (1, 4)
    assert cluster.gpu.peak("fp32") == pytest.approx(spec.peak("fp32") * cores / 4)
    assert cluster.gpu.memory_bytes == pytest.approx(spec.memory_bytes * cores / 4, rel=1e-6)


def test_local_cpu_cache_for_another_machine_is_ignored(tmp_path, monkeypatch):
    from planner import local_device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    local_device.cache_path().parent.mkdir(parents=True)
    local_device.cache_path().write_text('{"key": {"host": "elsewhere"}}')
    assert local_device.cached_local_cpu() is None
    local_device.cache_path().write_text("not json")
    assert local_device.cached_local_cpu() is None


def test_local_cpu_cache_keeps_one_entry_per_thread_count(tmp_path, monkeypatch):
    """A process planning with another torch thread count (OMP_NUM_THREADS=1) measures its own
    figures beside the default ones instead of replacing them; a file of the one-entry format
    from before is still read."""
    import json

    import torch

    from planner import local_device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []

    def fake_benchmark():
        measured.append(torch.get_num_threads())
        return json.loads(json.dumps(first))  # the figures of the first measurement, copied

    threads = torch.get_num_threads()
    local_device.measure_local_cpu()
    first = {k: v for k, v in local_device._cache_entries()[0].items() if k != "key"}
    monkeypatch.setattr(local_device, "run_benchmark", fake_benchmark)
    try:
        torch.set_num_threads(threads + 1)
        local_device.measure_local_cpu()
        assert measured == [threads + 1] and len(local_device._cache_entries()) == 2
        torch.set_num_threads(threads)
        local_device.measure_local_cpu()  # its entry is still there: nothing measured
        assert measured == [threads + 1]
    finally:
        torch.set_num_threads(threads)
    only = local_device._cache_entries()[0]
    local_device.cache_path().write_text(json.dumps(only))  # the format before entries
    assert local_device.cached_local_cpu() is not None and measured == [threads + 1]


def test_a_power_limit_scales_the_peaks_by_its_cube_root():
    """Clocks (and so peaks) under a power limit fall as the cube root of the power; memory
    bandwidth stays; at or above the TDP, or without one, nothing changes."""
    h100 = get_gpu("h100-sxm-80gb")
    capped = h100.power_capped(500)
    for dtype in ("bf16", "fp8", "fp32"):
        assert capped.peak(dtype) == pytest.approx(h100.peak(dtype) * (500 / 700) ** (1 / 3))
    assert capped.hbm_bandwidth_Bps == h100.hbm_bandwidth_Bps and "500 W" in capped.sources["peak_flops"]
    # the H100 NVL, the same die sold at 350-400 W, is rated 835 dense bf16 TFLOP/s: the law is a few percent low
    assert h100.power_capped(400).peak("bf16") == pytest.approx(835e12, rel=0.05)
    assert h100.power_capped(700) is h100 and dataclasses.replace(h100, tdp_w=None).power_capped(300).peak("bf16") == h100.peak("bf16")

