"""Faults around a launch: `plan run` stopped by a signal, and a rank that hangs.

SIGTERM or SIGHUP to `plan run` while its ranks train must stop torchrun and every rank (torchrun
runs in a session of its own and each rank in another, so nothing reaches them unless the launcher
passes it on) and end `plan run` with one line and exit code 1. A rank stuck in its own code while
the others wait for it in a collective is the one named: after the process-group timeout (from the
error files: the waiting ranks record a timeout, the stuck one nothing) and on the launcher's own
timeout (from each rank's Python stack). Four 2-rank launches of a tiny GPT on CPU/gloo, 10-30 s each
on two cores; the rest starts no torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from planner.model_file import load_model_file
from planner.planning import PlanRequest, make_plan, profile_for
from runtime import launch as launch_module
from runtime.launch import RunFailed, _StopOnSignals, group_alive, launch, run_dir_for, waited_for
from tests.conftest import ROOT
from tests.distributed.test_parity import CONFIGS, GLOBAL_BATCH, MODEL

# test_parity's GPT, with a rank that sleeps (for good) inside forward when told to.
HANG_MODEL = MODEL + """

class Hanging(MaybeFailing):
    def forward(self, idx):
        hang = os.environ.get("PLAN_TEST_HANG_RANK")
        if hang is not None and os.environ.get("RANK") == hang and not isinstance(idx, FakeTensor):
            import time
            time.sleep(3600)  # stuck in its own code: never reaches the gradient all-reduce
        return super().forward(idx)


def build_model():
    return Hanging(CFG)
"""


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A dp=2 DDP plan of the tiny GPT."""
    work = tmp_path_factory.mktemp("faults")
    (work / "model.py").write_text(HANG_MODEL)
    handle = load_model_file(work / "model.py")
    request = PlanRequest(gpus=2, gpu="cpu", global_batch=GLOBAL_BATCH, fixed=CONFIGS["ddp"][1], optimizer="sgd", precision="fp32")
    path = work / "ddp.json"
    path.write_text(make_plan(handle, request, profile_for(handle, request)).to_json())
    return path


def _processes_mentioning(text: str) -> dict[int, tuple[int, bool]]:
    """pid -> (process group, whether it is a rank) of every live process whose command line holds
    `text` (zombies have none: they are dead)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if text.encode() in cmdline:
            found[int(entry)] = (int(stat[stat.rindex(")") + 2:].split()[2]), b"torch.distributed.run" not in cmdline)
    return found


def _kill_leftovers(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the run's processes in /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_signal_to_plan_run_stops_torchrun_and_every_rank(sig, plan_file, tmp_path):
    plan = tmp_path / "plan.json"  # a run directory of its own: tmp_path/plan.run.d
    shutil.copy(plan_file, plan)
    run_dir = str(run_dir_for(plan).resolve())
    cli = subprocess.Popen(
        [sys.executable, "-m", "planner.cli", "run", str(plan), "--steps", "100000", "--timeout-s", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen: dict[int, tuple[int, bool]] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and cli.poll() is None:
            seen.update(_processes_mentioning(run_dir))
            if sum(is_rank for _, is_rank in seen.values()) == 2 and (Path(run_dir) / "plan0").is_dir():  # both ranks up, building or training
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the ranks did not start in 120 s (plan run exit code {cli.poll()}; seen {seen})")
        time.sleep(1.0)
        seen.update(_processes_mentioning(run_dir))
        assert len(seen) == 3, f"expected torchrun and 2 ranks: {seen}"
        started = time.monotonic()
        cli.send_signal(getattr(signal, sig))
        out, err = cli.communicate(timeout=30)
        elapsed = time.monotonic() - started
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        leftovers = _processes_mentioning(run_dir)
        _kill_leftovers(leftovers)
    assert cli.returncode == 1, (cli.returncode, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: plan run: stopped by {sig}; torchrun and its 2 ranks were stopped"), err
    assert out == ""
    assert not leftovers, f"still running after plan run exited: {leftovers}"
    # torchrun's group, and each rank's: nothing alive. A rank torchrun did not reap before it died is
    # re-parented and stays a zombie until PID 1 reaps it, later on a loaded machine: dead all the same.
    groups = {pgid for pgid, _ in seen.values()}
    assert not group_alive(groups), f"alive in the run's process groups {groups}: {group_alive(groups)}"
    assert elapsed < 30, f"plan run took {elapsed:.0f} s to stop"


def test_hung_rank_named_after_the_process_group_timeout(plan_file, tmp_path):
    """The waiting rank gives up after the process-group timeout (5 s) and records it; the stuck one
    records nothing: it is the one named, not the one that timed out."""
    with pytest.raises(RunFailed) as info:
        launch([plan_file], 2, steps=50, timeout_s=120, pg_timeout_s=5, run_dir=tmp_path / "run",
               env={"PLAN_TEST_HANG_RANK": "1"})
    message = str(info.value)
    assert message.startswith("rank 1 hung: rank 0 timed out waiting for it (") and "\n" not in message, message
    assert "recorded no error" in message


def test_hung_rank_named_on_the_launch_timeout(plan_file, tmp_path):
    """The launcher's timeout comes first (the process-group one is longer): each rank's Python
    stack says which one is stuck in its own code and which waits in backward for its gradient
    all-reduce. Nothing of the run survives."""
    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed) as info:
        launch([plan_file], 2, steps=50, timeout_s=25, pg_timeout_s=300, run_dir=run_dir,
               env={"PLAN_TEST_HANG_RANK": "1"})
    message = str(info.value)
    assert message.startswith("the run did not finish in 25 s and was stopped: rank 1 hung in forward (model.py:"), message
    assert "while rank 0 waited for it" in message and "\n" not in message, message
    log = (run_dir / "launch.log").read_text()
    assert log.count("Fatal Python error: Aborted") == 2  # both ranks' stacks, for the reader
    leftovers = _processes_mentioning(str(run_dir.resolve()))
    _kill_leftovers(leftovers)
    assert not leftovers


def test_errors_other_than_a_wait_timing_out_name_no_hung_rank(tmp_path):
    """waited_for: only the errors of a rank that gave up waiting count; the model's own
    TimeoutError does not make the silent ranks hung ones."""
    def record(rank: int, error: str, when: float) -> None:
        (tmp_path / f"error.rank{rank}.json").write_text(json.dumps({"rank": rank, "time": when, "error": error}))

    gloo = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
    record(2, gloo, 2.0)
    record(0, gloo, 1.0)
    assert waited_for(tmp_path, 4) == ([1, 3], [0, 2], gloo)
    record(1, gloo, 3.0)
    record(3, gloo, 4.0)
    assert waited_for(tmp_path, 4) == ([], [0, 1, 2, 3], gloo)  # all waited: mismatched collectives
    record(3, "TimeoutError: the data server timed out", 0.5)
    assert waited_for(tmp_path, 4) is None


def test_stop_on_signals_takes_over_only_default_handlers():
    """nohup's ignored SIGHUP stays ignored and Python's SIGINT (KeyboardInterrupt) stays; SIGTERM is
    taken over while torchrun runs and given back after; off the main thread nothing changes."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with _StopOnSignals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
            assert callable(signal.getsignal(signal.SIGTERM))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        seen = []

        def elsewhere() -> None:
            with _StopOnSignals() as stop:
                seen.append(stop.previous)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        assert seen == [{}]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
    start_new_session=True, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes in /proc")
def test_kill_group_kills_what_ignores_sigterm_in_any_session(monkeypatch):
    """A "torchrun" and a "rank" in a session of its own, both ignoring SIGTERM: SIGKILL after the
    grace period reaches both (no torch: plain processes)."""
    monkeypatch.setattr(launch_module, "STOP_GRACE_S", 0.5)
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    try:
        assert group_alive({proc.pid, child}) == sorted([proc.pid, child])
        assert launch_module._kill_group(proc) == []
        assert proc.returncode == -signal.SIGKILL
        assert group_alive({proc.pid, child}) == []
    finally:
        _kill_leftovers([proc.pid, child])
