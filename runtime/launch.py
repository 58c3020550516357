"""Launch a plan's workers with torchrun and collect what they report.

``python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1 --master-port P
-m runtime.worker --plan plan.json ...`` runs as a subprocess in its own session, bounded by a
wall-clock timeout (torchrun and every rank are killed past it). Inside, the process-group timeout
bounds any collective waiting on a dead or stuck rank, and torchrun stops the other ranks as soon as
one exits non-zero. On failure the earliest per-rank error file names the failing rank; a rank
that hung is named rather than the ranks that timed out waiting for it (`waited_for`, and on the
launcher's own timeout each rank's Python stack, `_rank_stacks`). SIGTERM or SIGHUP to the launcher
stops the whole group too (`_StopOnSignals`): torchrun, in its own session, never receives them.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from planner.errors import BadInput, PlanError
from runtime.multinode import NodeSpec, torchrun_node_args
from runtime.report import RunReport
from runtime.worker import DEFAULT_PG_TIMEOUT_S, NODE_RANK_ENV

DEFAULT_TIMEOUT_S = 600.0
EXIT_RUN_FAILED = 1
STOP_GRACE_S = 5.0
"""How long each signal (SIGTERM, then SIGKILL) is given to stop torchrun's group."""


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
    node: NodeSpec | None = None,
) -> list[str]:
    """The launch command for one node hosting all `nproc` ranks; with `node`, this node's share
    of a multi-node run (`nproc` ranks a node, static rendezvous at node 0: runtime.multinode)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if node is None:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port if port is not None else free_port())]
    else:
        assert nproc == node.nproc_per_node, f"nproc({nproc}) != nproc per node({node.nproc_per_node})"
        cmd += torchrun_node_args(node)
    cmd += ["-m", "runtime.worker"]
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


def _errors(run_dir: Path) -> list[tuple[float, int, str]]:
    """(time, rank, one-line error) of every error a rank recorded, earliest first."""
    found = []
    for path in run_dir.glob("error.rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found.append((float(data.get("time", 0.0)), int(data["rank"]), str(data["error"])))
    return sorted(found)


def first_error(run_dir: Path) -> tuple[int, str] | None:
    """(rank, one-line error) of the earliest error a rank recorded, or None."""
    found = _errors(run_dir)
    if not found:
        return None
    _, rank, error = found[0]
    return rank, error


_WAIT_TIMED_OUT = re.compile(
    r"Timed out waiting \d+ ?ms for (?:send|recv) operation"  # gloo: a collective, send or recv
    r"|Timed out after \d+ seconds waiting for clients"  # TCPStore: a rank never joined
    r"|wait timeout after \d+ ?ms"  # a store wait (barrier, rendezvous)
    r"|collective operation timeout"  # the NCCL watchdog
    r"|failed to pass monitoredBarrier",
    re.I,
)
"""The errors of a rank that gave up waiting for another: named for what timed out, never a bare
"timeout", so a TimeoutError raised by the model's own code is not taken for one."""


def waited_for(run_dir: Path, nproc: int, first: int = 0) -> tuple[list[int], list[int], str] | None:
    """When the run failed because ranks timed out waiting for others: (the ranks that recorded no
    error, the ranks that timed out, the earliest timeout's error); None when any recorded error is
    something else. A rank that hangs (stuck in its own code, never joining the collective) records
    nothing: the ones waiting for it time out and exit, and torchrun then kills it with SIGTERM, so
    torchrun's "first observed failure" and the earliest error both name a rank that waited. The
    silent ranks are the ones that hung (with 3 or more ranks, also any that torchrun stopped before
    their own wait timed out). None silent: every rank timed out waiting, in a collective that not
    every rank called or not in the same order. `first`: the first of the `nproc` ranks this node
    runs (a multi-node run: the others' errors are on their nodes)."""
    found = _errors(run_dir)
    if not found or not all(_WAIT_TIMED_OUT.search(error) for _, _, error in found):
        return None
    timed_out = sorted({rank for _, rank, _ in found})
    return [r for r in range(first, first + nproc) if r not in timed_out], timed_out, found[0][2]


def _ranks(ranks: Sequence[int]) -> str:
    """"rank 1", "ranks 0, 2"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _hang_message(silent: list[int], timed_out: list[int], error: str) -> str:
    if len(silent) == 1:
        return f"rank {silent[0]} hung: {_ranks(timed_out)} timed out waiting for it ({error}) and it recorded no error"
    if silent:
        return (f"one of {_ranks(silent)} hung: they recorded no error while {_ranks(timed_out)} "
                f"timed out waiting ({error})")
    return f"every rank timed out waiting for the others ({error}): a collective not every rank called, or in another order?"


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


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process, from /proc; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (command) ": the command may hold spaces
    return fields[0], int(fields[1]), int(fields[2])


def _dead(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is None or stat[0] in "ZXx"


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _run_groups(proc: subprocess.Popen) -> set[int]:
    """The process groups of a launch: torchrun's, and each of its descendants' (torchrun starts
    every rank in a session of its own, so signalling torchrun's group alone misses the ranks)."""
    groups = {proc.pid}
    if proc.poll() is None and os.path.isdir("/proc"):
        for pid in _descendants(proc.pid):
            stat = _proc_stat(pid)
            if stat is not None:
                groups.add(stat[2])
    return groups


def group_alive(pgids: set[int] | int) -> list[int]:
    """The live processes of the process groups. Zombies do not count: they are dead, only not yet
    reaped (where nothing reaps orphans, as in some containers, they stay listed for good)."""
    pgids = {pgids} if isinstance(pgids, int) else pgids
    if not os.path.isdir("/proc"):
        alive = []
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                alive.append(pgid)
            except ProcessLookupError:
                pass
        return alive
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[2] in pgids and stat[0] not in "ZXx":
                alive.append(int(entry))
    return sorted(alive)


def _kill_group(proc: subprocess.Popen) -> list[int]:
    """Stop the torchrun we started (its own session: a process group) and its ranks (each in a
    group of its own); the pids still alive afterwards (none, normally). SIGTERM first, to every
    group, the ranks' before torchrun's: the ranks die and torchrun, shutting down, reaps them (a
    rank that outlived torchrun would be re-parented, and left a zombie where nothing reaps
    orphans). Then SIGKILL for whatever is left after the grace period: waiting for torchrun alone
    would miss a rank that outlives it."""
    groups = _run_groups(proc)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        groups |= _run_groups(proc)  # while torchrun lives: any rank it started meanwhile
        for pgid in sorted(groups, key=lambda g: g == proc.pid):
            try:
                os.killpg(pgid, sig)
                os.killpg(pgid, signal.SIGCONT)  # a stopped process (see _rank_stacks) acts on it now
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(groups):
                return []
            time.sleep(0.05)
    proc.poll()
    return group_alive(groups)


def _rank_pids(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of the workers torchrun started (its children, RANK in their environment)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is None or stat[1] != torchrun_pid:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry)
    return found


def _rank_stacks(proc: subprocess.Popen, log_path: Path) -> dict[int, str]:
    """On the launcher's timeout, just before the group is killed: rank -> its Python stacks. Every
    rank runs with faulthandler on (PYTHONFAULTHANDLER=1), which on SIGABRT writes each thread's
    stack to stderr (the launch log) before the rank dies. torchrun is stopped (SIGSTOP) first, or
    it would stop the other ranks as soon as the first one dies; the ranks are then aborted one at a
    time, so what the log gains meanwhile is that rank's dump. Linux only ({} elsewhere, or when no
    rank has started); best effort: the group is killed whatever happens here."""
    stacks: dict[int, str] = {}
    if not os.path.isdir("/proc"):
        return stacks
    try:
        ranks = _rank_pids(proc.pid)
        if not ranks:
            return stacks
        os.kill(proc.pid, signal.SIGSTOP)
        for rank, pid in sorted(ranks.items()):
            offset = log_path.stat().st_size
            try:
                resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))  # no core file from this abort
            except (OSError, ValueError, AttributeError):
                pass
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 3.0
            while not _dead(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            with open(log_path, "rb") as f:
                f.seek(offset)
                stacks[rank] = f.read().decode(errors="replace")
    except (OSError, ValueError):
        pass
    return stacks


_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+.*\(most recent call first\):[ \t]*$", re.M)
_FRAME = re.compile(r'^[ \t]+File "([^"]*)", line (\d+) in (\S+)', re.M)
_WAITING_IN = re.compile(r"[/\\]torch[/\\](?:distributed|autograd|nn[/\\]parallel)[/\\]")
"""Where a rank's innermost Python frame is when it waits for the others: a collective
(torch.distributed, pipelining's send/recv), DDP (nn.parallel), or backward, where DDP and FSDP
wait for their gradient collectives."""


def where_stuck(dump: str) -> tuple[str, bool] | None:
    """From a rank's faulthandler dump: where its main thread was ("forward (model.py:24)"), and
    whether that is waiting for other ranks (`_WAITING_IN`); None without a recognisable stack."""
    threads = [_FRAME.findall(block) for block in _THREAD.split(dump)[1:]]
    threads = [frames for frames in threads if frames]
    if not threads:
        return None
    # The main thread runs runtime.worker; faulthandler lists the thread the signal landed on first.
    main = next((frames for frames in threads if any(Path(f).parts[-2:] == ("runtime", "worker.py") for f, _, _ in frames)),
                threads[0])
    path, line, func = main[0]  # most recent call first
    return f"{func} ({Path(path).name}:{line})", _WAITING_IN.search(path) is not None


def _timeout_message(timeout_s: float, stacks: dict[int, str], log_path: Path) -> str:
    """The launcher's timeout, naming the ranks that hung when their stacks tell: those not waiting
    for the others while some are."""
    head = f"the run did not finish in {timeout_s:g} s and was stopped"
    where = {}
    for rank in sorted(stacks):
        found = where_stuck(stacks[rank])
        if found is not None:
            where[rank] = found
    if not where:
        return f"{head} (log: {log_path})"
    stuck = [rank for rank, (_, waiting) in where.items() if not waiting]
    waiting = [rank for rank, (_, waiting) in where.items() if waiting]
    tail = f"(each rank's stack is in the log: {log_path})"
    if stuck and waiting:
        if len(stuck) == 1:
            hung = f"rank {stuck[0]} hung in {where[stuck[0]][0]} while {_ranks(waiting)} waited for it"
        else:
            places = ", ".join(f"rank {rank} in {where[rank][0]}" for rank in stuck)
            hung = f"{_ranks(stuck)} hung ({places}) while {_ranks(waiting)} waited for them"
        return f"{head}: {hung} {tail}"
    shown = ", ".join(f"rank {rank} in {w}" for rank, (w, _) in list(where.items())[:4]) + (", ..." if len(where) > 4 else "")
    what = "every rank was waiting for the others" if waiting else "no rank was waiting for another"
    return f"{head}: {what} ({shown}) {tail}"


class _Stopped(BaseException):
    """Raised in the main thread by `_StopOnSignals`' handler: the launcher was told to stop."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StopOnSignals:
    """While torchrun runs, SIGTERM or SIGHUP to this process stop torchrun and every rank: by
    default this process would die alone and leave them (in sessions of their own, out of reach of
    a signal to ours) running, re-parented, with nothing left to bound them. Only signals still at
    their default action are taken over (SIGINT too, where it is): an ignored SIGHUP (nohup) stays
    ignored, and Python's SIGINT handler or one the caller installed keeps raising what it raises,
    which stops the run as well (launch stops it on any exception). Handlers run in the main thread
    only, so elsewhere nothing is installed; the previous handlers come back on exit."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, name))

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        self.armed = False
        self.received: int | None = None

    def __enter__(self) -> "_StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is signal.SIG_DFL:
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        if self.armed:  # once: a second signal must not cut the stopping short
            self.armed = False
            raise _Stopped(signum)

    def arm(self) -> None:
        """From now, a signal raises _Stopped; one that came while torchrun was starting does so now."""
        if self.received is not None:
            raise _Stopped(self.received)
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def __exit__(self, *exc: object) -> None:
        self.armed = False
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _stopped_message(signum: int, nproc: int, survivors: list[int], pid: int, log_path: Path) -> str:
    name = signal.Signals(signum).name
    if survivors:
        return (f"plan run: stopped by {name}; torchrun (pid {pid}) and its ranks were sent SIGKILL but "
                f"{len(survivors)} of their processes are still running (pids {', '.join(map(str, survivors))}; log: {log_path})")
    return f"plan run: stopped by {name}; torchrun and its {nproc} rank{'s' if nproc != 1 else ''} were stopped (log: {log_path})"


_RDZV_FAILED = re.compile(
    r"Timed out after \d+ seconds waiting for clients\. (\d+)/(\d+) clients joined"  # node 0: the others never came
    r"|client socket has timed out after [^\n]*? while trying to connect to"  # another node: node 0's store never answered
)


def _check_rendezvous_log(log_path: Path, node: NodeSpec) -> None:
    """The nodes of a multi-node run that never met at the rendezvous (torchrun failed before
    starting a rank): one line naming the endpoint (BadInput)."""
    text = log_path.read_text(errors="replace")
    m = _RDZV_FAILED.search(text)
    if m is None or "in next_rendezvous" not in text:  # torchrun's agent, not a rank, failed to meet
        return
    if m.group(1) is not None:
        joined, total = int(m.group(1)), int(m.group(2))
        others = "--node-rank 1" if node.num_nodes == 2 else f"--node-rank 1 to {node.num_nodes - 1}"
        raise BadInput(
            f"plan run: node 0: only {joined} of {total} nodes joined the rendezvous at {node.endpoint} within "
            f"{node.rdzv_timeout_s:g} s: start the same `plan run ... --nnodes {node.num_nodes} --rdzv-endpoint "
            f"{node.endpoint}` with {others} on the other nodes (log: {log_path})"
        )
    raise BadInput(f"plan run: node {node.node_rank}: the rendezvous at {node.endpoint} was lost or never answered "
                   f"within {node.rdzv_timeout_s:g} s (log: {log_path})")


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
    node: NodeSpec | None = None,
) -> LaunchResult:
    """Run the plans (in turn, in one launch) on `nproc` local ranks; their RunReports.
    With `node`: this node's `nproc` ranks of a multi-node run; the reports come back on node 0
    only (its rank 0 gathers every rank's figures), () on the others.

    Raises RunFailed with the failing rank's error, or on timeout; BadInput when the nodes did not
    meet at the rendezvous."""
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="plan-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale(run_dir)
    cmd = torchrun_command(
        plan_paths, nproc, run_dir, model=model, steps=steps, pg_timeout_s=pg_timeout_s, save_params=save_params,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume, node=node,
    )
    log_path = run_dir / "launch.log"
    child_env = {**os.environ, **(env or {})}
    child_env.pop(NODE_RANK_ENV, None)
    if node is not None:
        child_env[NODE_RANK_ENV] = str(node.node_rank)  # the worker checks torchrun kept it (GROUP_RANK)
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Python stacks on a fatal signal: a rank crashing in native code shows where, and on the
    # timeout the stuck rank is found from them (_rank_stacks).
    child_env.setdefault("PYTHONFAULTHANDLER", "1")
    start = time.perf_counter()
    with open(log_path, "w") as log, _StopOnSignals() as stop:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        try:
            stop.arm()
            code = proc.wait(timeout=timeout_s)
            stop.disarm()
        except _Stopped as exc:
            survivors = _kill_group(proc)
            raise RunFailed(_stopped_message(exc.signum, nproc, survivors, proc.pid, log_path)) from None
        except subprocess.TimeoutExpired:
            stop.disarm()
            if node is not None and not _rank_pids(proc.pid):  # still at the rendezvous: no rank started
                _kill_group(proc)
                raise BadInput(f"plan run: node {node.node_rank}: the nodes did not all meet at the rendezvous at "
                               f"{node.endpoint} within {timeout_s:g} s (log: {log_path})") from None
            try:
                stacks = _rank_stacks(proc, log_path)
            finally:
                _kill_group(proc)
            raise RunFailed(_timeout_message(timeout_s, stacks, log_path)) from None
        except BaseException:  # KeyboardInterrupt, or whatever a caller's signal handler raises
            stop.disarm()
            _kill_group(proc)
            raise
    if stop.received is not None:  # came in the instant between torchrun's exit and disarm()
        raise RunFailed(f"plan run: stopped by {signal.Signals(stop.received).name} as the run ended (log: {log_path})")
    wall = time.perf_counter() - start
    if code != 0:
        if node is not None:
            _check_rendezvous_log(log_path, node)
        err = first_error(run_dir)
        died = root_cause(log_path.read_text(errors="replace"))
        if died is not None and (died[2] or err is None):
            rank, what, _ = died
            raise RunFailed(f"rank {rank} died: {what}, without recording an error (exit code {code}; log: {log_path})")
        hang = waited_for(run_dir, nproc, first=node.first_rank if node is not None else 0)
        if hang is not None:
            raise RunFailed(f"{_hang_message(*hang)} (exit code {code}; traceback and log in {run_dir})")
        if err is not None:
            rank, message = err
            raise RunFailed(f"rank {rank} failed: {message} (exit code {code}; traceback and log in {run_dir})")
        raise RunFailed(f"the run failed with exit code {code} and no rank recorded an error (log: {log_path})")
    if node is not None and node.node_rank != 0:
        return LaunchResult(run_dir, (), wall)
    reports = []
    for i in range(len(plan_paths)):
        path = run_dir / f"plan{i}" / "report.json"
        if not path.exists():
            raise RunFailed(f"the run finished but wrote no report for plan {i} (log: {log_path})")
        reports.append(RunReport.load(path))
    return LaunchResult(run_dir, tuple(reports), wall)
