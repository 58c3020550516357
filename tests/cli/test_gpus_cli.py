"""`plan gpus` as a user runs it: the table, --json, user files, and errors."""

from __future__ import annotations

import json

import pytest
import yaml

from planner.cli import main

REQUIRED = ("a100-40gb", "a100-80gb", "h100-sxm-80gb", "h200", "b200", "v100-32gb", "l40s", "rtx4090", "mi300x")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PLAN_GPU_DIR", raising=False)


def test_table_lists_catalogue_without_measuring_cpu(capsys, tmp_path):
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    for name in (*REQUIRED, "cpu"):
        assert name in out
    assert "989.4" in out and "measured on first use" in out and "PLAN_GPU_DIR" in out
    assert not (tmp_path / "cache").exists()  # listing never runs the CPU benchmark


def test_json_lists_catalogue(capsys):
    assert main(["gpus", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {row["name"]: row for row in rows}
    assert set(REQUIRED) | {"cpu"} <= set(by_name)
    assert by_name["h100-sxm-80gb"]["peak_flops"]["bf16"] == 989.4e12
    assert "bf16" not in by_name["v100-32gb"]["peak_flops"]
    assert by_name["cpu"]["origin"] == "measured on first use"


def test_user_gpu_is_listed(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAN_GPU_DIR", str(tmp_path))
    data = {"peak_tflops": {"bf16": 50}, "memory_gb": 12, "hbm_bandwidth_GBps": 500,
            "intra_node_bandwidth_GBps": 16, "inter_node_bandwidth_GBps": 3, "gpus_per_node": 2}
    (tmp_path / "lab-gpu.yaml").write_text(yaml.safe_dump(data))
    assert main(["gpus", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "lab-gpu")
    assert row["origin"] == str(tmp_path / "lab-gpu.yaml")


def test_malformed_user_gpu_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAN_GPU_DIR", str(tmp_path))
    (tmp_path / "bad.yaml").write_text("peak_tflops: {bf16: 50}\nmemory_gb: -1\n")
    assert main(["gpus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "bad.yaml" in err and "'memory_gb'" in err and "\n" not in err


def test_the_console_script_hands_over_all_it_printed(tmp_path):
    """The script ends the process without tearing torch down (planner.cli.entry: os._exit after
    flushing): stdout to a pipe is block-buffered, so what is printed must still arrive (the usage
    fits in the buffer whole: nothing reaches the pipe unless flushed), with main()'s exit code."""
    import os
    import subprocess
    import sys

    from planner.cli import USAGE

    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    for name in ("PLAN_GPU_DIR", "PYTHONUNBUFFERED"):  # buffered, as a user's shell has it
        env.pop(name, None)
    usage = subprocess.run([sys.executable, "-m", "planner.cli", "--help"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert usage.returncode == 0 and usage.stdout == USAGE + "\n", usage.stderr
    (tmp_path / "bad.yaml").write_text("peak_tflops: {bf16: 50}\nmemory_gb: -1\n")
    bad = subprocess.run([sys.executable, "-m", "planner.cli", "gpus"], capture_output=True, text=True,
                         env=dict(env, PLAN_GPU_DIR=str(tmp_path)), timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "bad.yaml" in bad.stderr, bad.stderr
