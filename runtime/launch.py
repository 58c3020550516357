"""Launch a plan's workers with torchrun and collect what they report.

``python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1 --master-port P
-m runtime.worker --plan plan.json ...`` runs as a subprocess in its own session, bounded by a
wall-clock timeout (the whole process group is killed past it). Inside, the process-group timeout
bounds any collective waiting on a dead or stuck rank, and torchrun stops the other ranks as soon as
one exits non-zero. On failure the earliest per-rank error file names the failing rank.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from planner.errors import PlanError
from runtime.report import RunReport
from runtime.worker import DEFAULT_PG_TIMEOUT_S

DEFAULT_TIMEOUT_S = 600.0
EXIT_RUN_FAILED = 1


class RunFailed(PlanError):
    """A launched run failed or timed out: exit code 1, one line naming the rank."""

    exit_code = EXIT_RUN_FAILED


@dataclass(frozen=True)
class LaunchResult:
    run_dir: Path
    reports: tuple[RunReport, ...]
    """One per plan, in order."""
    wall_s: float


def run_dir_for(plan_path: str | Path) -> Path:
    """Where `plan run` keeps a run's scratch files: ``plan.json`` -> ``plan.run.d/``."""
    p = Path(plan_path)
    stem = p.name[: -len(".json")] if p.name.endswith(".json") else p.name
    return p.with_name(f"{stem}.run.d")


def _clear_stale(run_dir: Path) -> None:
    """Remove a previous run's error files and reports, so they are never read as this run's."""
    for path in [*run_dir.glob("error.rank*.json"), *run_dir.glob("plan*/report.json")]:
        path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(
    plan_paths: Sequence[str | Path],
    nproc: int,
    run_dir: str | Path,
    *,
    model: str | Path | None = None,
    steps: int = 5,
    port: int | None = None,
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    save_params: bool = False,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
) -> list[str]:
    """The launch command for one node hosting all `nproc` ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(port if port is not None else free_port()),
        "-m", "runtime.worker",
    ]
    for path in plan_paths:
        cmd += ["--plan", str(Path(path).resolve())]
    if model is not None:
        cmd += ["--model", str(Path(model).resolve())]
    cmd += ["--run-dir", str(Path(run_dir).resolve()), "--steps", str(steps), "--pg-timeout-s", f"{pg_timeout_s:g}"]
    if save_params:
        cmd.append("--save-params")
    if checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", str(Path(checkpoint_dir).resolve())]
        if checkpoint_every:
            cmd += ["--checkpoint-every", str(checkpoint_every)]
        if resume:
            cmd.append("--resume")
    return cmd


def format_command(cmd: Sequence[str]) -> str:
    return shlex.join(cmd)


def first_error(run_dir: Path) -> tuple[int, str] | None:
    """(rank, one-line error) of the earliest error a rank recorded, or None."""
    found = []
    for path in run_dir.glob("error.rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found.append((float(data.get("time", 0.0)), int(data["rank"]), str(data["error"])))
    if not found:
        return None
    _, rank, error = min(found)
    return rank, error


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*\n.*?traceback\s*:\s*([^\n]*)",
    re.S,
)


def root_cause(log_text: str) -> tuple[int, str, bool] | None:
    """(rank, what happened, killed by a signal) from torchrun's failure summary: its first
    observed failure. A rank killed by a signal (out of memory, a crash in native code) records no
    error itself, and the others then fail on a closed connection."""
    m = _ROOT_CAUSE.search(log_text)
    if m is None:
        return None
    rank, code, trace = int(m.group(1)), int(m.group(2)), m.group(3).strip()
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return rank, f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else ""), name != "SIGTERM"
    return rank, f"exited with code {code}" + (f": {trace}" if trace and trace != "<N/A>" else ""), False


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the torchrun we started and its workers (its own session: one process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(
    plan_paths: Sequence[str | Path],
    nproc: int,
    *,
    model: str | Path | None = None,
    steps: int = 5,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    run_dir: str | Path | None = None,
    save_params: bool = False,
    env: dict[str, str] | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
) -> LaunchResult:
    """Run the plans (in turn, in one launch) on `nproc` local ranks; their RunReports.

    Raises RunFailed with the failing rank's error, or on timeout."""
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="plan-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale(run_dir)
    cmd = torchrun_command(
        plan_paths, nproc, run_dir, model=model, steps=steps, pg_timeout_s=pg_timeout_s, save_params=save_params,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
    )
    log_path = run_dir / "launch.log"
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise RunFailed(f"the run did not finish in {timeout_s:g} s and was stopped (log: {log_path})") from None
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
    wall = time.perf_counter() - start
    if code != 0:
        err = first_error(run_dir)
        died = root_cause(log_path.read_text(errors="replace"))
        if died is not None and (died[2] or err is None):
            rank, what, _ = died
            raise RunFailed(f"rank {rank} died: {what}, without recording an error (exit code {code}; log: {log_path})")
        if err is not None:
            rank, message = err
            raise RunFailed(f"rank {rank} failed: {message} (exit code {code}; traceback and log in {run_dir})")
        raise RunFailed(f"the run failed with exit code {code} and no rank recorded an error (log: {log_path})")
    reports = []
    for i in range(len(plan_paths)):
        path = run_dir / f"plan{i}" / "report.json"
        if not path.exists():
            raise RunFailed(f"the run finished but wrote no report for plan {i} (log: {log_path})")
        reports.append(RunReport.load(path))
    return LaunchResult(run_dir, tuple(reports), wall)
