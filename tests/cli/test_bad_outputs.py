"""Output paths, plan files and numeric flags a user gets wrong: exit code 2 and ONE line on stderr
naming the path or the flag, before any planning, profiling or launch where it can be known then.
"""

import json
import os
import time

import pytest

from planner.cli import main
from planner.errors import EXIT_BAD_INPUT
from tests.conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.py")
MLP = str(EXAMPLES / "mlp.py")


def _one_line(capsys, code: int) -> str:
    out = capsys.readouterr()
    assert code == EXIT_BAD_INPUT, out.err
    err = out.err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def test_output_that_is_a_directory(capsys, tmp_path):
    started = time.perf_counter()
    err = _one_line(capsys, main([GPT, "--gpu", "cpu", "--gpus", "2", "-o", str(tmp_path)]))
    assert f"{tmp_path}: is a directory (-o)" in err
    assert time.perf_counter() - started < 2  # refused before profiling on the CPU (seconds)
    # --force does not make a directory a file
    err = _one_line(capsys, main([GPT, "--gpu", "cpu", "--gpus", "2", "-o", str(tmp_path), "--force"]))
    assert f"{tmp_path}: is a directory" in err


def test_output_into_a_missing_directory(capsys, tmp_path):
    missing = tmp_path / "no" / "such"
    err = _one_line(capsys, main([GPT, "--gpu", "cpu", "--gpus", "2", "-o", str(missing / "plan.json")]))
    assert f"{missing}: no such directory (-o)" in err
    assert not missing.exists()


def test_output_under_a_file(capsys, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    err = _one_line(capsys, main([MLP, "--gpus", "2", "-o", str(a_file / "plan.json")]))
    assert f"{a_file}: not a directory (-o)" in err
    assert a_file.read_text() == "mine"


def test_plan_output_is_written_whole(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main([MLP, "--gpus", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["schema"] == "planner.Plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left


def test_profile_output_that_is_a_directory(capsys, tmp_path):
    err = _one_line(capsys, main(["profile", MLP, "-o", str(tmp_path)]))
    assert f"{tmp_path}: is a directory (-o)" in err


@pytest.mark.parametrize("flag", ["--report", "--csv"])
def test_whatif_output_that_is_a_directory(capsys, tmp_path, flag):
    err = _one_line(capsys, main(["whatif", MLP, "--gpus", "2", flag, str(tmp_path), "--force"]))
    assert f"{tmp_path}: is a directory ({flag})" in err


def test_whatif_csv_and_report_are_written(capsys, tmp_path):
    csv, html = tmp_path / "r.csv", tmp_path / "r.html"
    assert main(["whatif", MLP, "--gpus", "1,2", "--gpu", "a100-80gb", "--csv", str(csv), "--report", str(html)]) == 0
    capsys.readouterr()
    assert csv.read_text().splitlines()[0].startswith("gpu,") and html.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv", "r.html"]


@pytest.fixture
def plan_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([MLP, "--gpu", "cpu", "--gpus", "2", "--dp", "2", "-o", str(out)]) == 0  # not the search's pick: this machine's calibration moves it
    capsys.readouterr()
    return out


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe\x00{", "not UTF-8 text (byte 0xff at offset 0)"),
        (b"plan: yes\n", ":1: not valid JSON"),
        (b"", ":1: not valid JSON"),
        (b'{"schema": "planner.Plan", "version": 2}', "parallel is missing"),
        (b'{"schema": "planner.Plan", "version": 1}', "version 1 was written by an older planner"),
    ],
)
def test_run_refuses_a_broken_plan_file(capsys, tmp_path, content, message):
    broken = tmp_path / "broken.json"
    broken.write_bytes(content)
    err = _one_line(capsys, main(["run", str(broken)]))
    assert f"{broken}" in err and message in err, err
    assert not (tmp_path / "broken.run.json").exists() and not (tmp_path / "broken.run.d").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["parallel"].update(dp="two"), 'parallel.dp: expected a whole number, got "two"'),
        (lambda d: d["parallel"].update(dp=4), "parallel: dp 4 x tp 1 x pp 1 = 4, not cluster.num_gpus 2"),
        (lambda d: d["parallel"].pop("dp"), "parallel.dp is missing"),
        (lambda d: d["parallel"].update(schedule="zigzag"), "parallel.schedule"),
    ],
)
def test_run_refuses_a_hand_edited_plan(capsys, plan_file, edit, message):
    data = json.loads(plan_file.read_text())
    edit(data)
    plan_file.write_text(json.dumps(data))
    err = _one_line(capsys, main(["run", str(plan_file)]))
    assert f"{plan_file}: {message}" in err, err
    assert not plan_file.with_name("plan.run.json").exists()


def test_run_report_path_that_is_a_directory(capsys, plan_file):
    """The run report goes next to the plan (plan.run.json): a directory there is refused before the launch."""
    plan_file.with_name("plan.run.json").mkdir()
    err = _one_line(capsys, main(["run", str(plan_file), "--force"]))
    assert "plan.run.json: is a directory" in err
    assert not plan_file.with_name("plan.run.d").exists()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["run", "{plan}", "--timeout-s", "nan"], "--timeout-s"),
        (["run", "{plan}", "--timeout-s", "inf"], "--timeout-s"),
        (["run", "{plan}", "--timeout-s", "0"], "--timeout-s"),
        ([GPT, "--gpus", "8", "--memory-limit", "nan"], "--memory-limit"),
        ([GPT, "--gpus", "8", "--memory-limit=-inf"], "--memory-limit"),
        ([GPT, "--gpus", "8", "--inter-node-gbps", "inf"], "--inter-node-gbps"),
        ([GPT, "--gpus", "8", "--inter-node-gbps", "0"], "--inter-node-gbps"),
        (["whatif", GPT, "--gpus", "8", "--memory-limit", "nan"], "--memory-limit"),
        (["whatif", GPT, "--gpus", "8", "--inter-node-gbps", "inf"], "--inter-node-gbps"),
    ],
)
def test_non_finite_numbers_are_refused(capsys, tmp_path, argv, flag):
    plan = tmp_path / "plan.json"  # never read: the flag is refused first
    argv = [a.replace("{plan}", str(plan)) for a in argv]
    err = _one_line(capsys, main(argv))
    assert f"{flag} must be positive and finite" in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_into_an_unwritable_directory(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        err = _one_line(capsys, main([MLP, "--gpus", "2", "-o", str(locked / "plan.json")]))
        assert f"{locked}: directory not writable (-o)" in err
    finally:
        locked.chmod(0o755)
