"""Where one training step's time goes, measured phase by phase, as the cost model predicts it.

One step of a run (the last; the step-time median leaves it out) runs under ``torch.profiler``;
every operator the profiler records on the training thread is put in one phase, and its *self*
time (its own, less the operators it calls) counted there, so the phases add up to the profiled
step:

- a collective or point-to-point operator (``c10d::*``, ``_c10d_functional::*``, gloo/NCCL's own
  events) is communication; which one comes from where it runs: inside FSDP's gather, copy-out or
  reduce-scatter, or a DDP all-reduce (``c10d::allreduce_`` outside a functional collective):
  data parallel; inside context parallelism's ring attention (``CP_SCOPE``): context parallel; a
  send or receive: pipeline; an all-to-all or a wait inside the experts' dispatch (``EP_SCOPE``):
  expert parallel; any other functional collective (DTensor's): tensor parallel where the plan
  has tp > 1 or no context parallelism, else context parallel. FSDP's copies around its collectives count as data-parallel communication, as the
  cost model counts them (planner.cost.stage_costs).
- the self time of the pipeline schedule's own scopes (``Forward i``, ``Backward i``, ``PP:...``)
  is the time a stage waits for its neighbour's activations or gradients: pipeline communication
  and bubble, which the runtime cannot tell apart (a receive waits for both).
- an operator inside ``OPTIMIZER_SCOPE`` is the optimizer step; inside ``RECOMPUTE_SCOPE``
  (a checkpointed layer's forward run again in backward: runtime.recompute) recompute; any other
  operator is forward or backward compute (``FORWARD_SCOPE``, ``BACKWARD_SCOPE``).
- the time of the step outside every operator and scope is, with a pipeline, the schedule's wait
  for its neighbours (pipeline communication and bubble, as above); without one, as the self time
  of the runtime's own scopes (Python and framework time between operators, and a wait the
  profiler does not record as an operator, such as DDP's for its last buckets), ``host``: on the CPU the cost model puts the per-operator host time in compute and DDP's exposed
  wait in dp_comm, so ``host`` is shown on its own line.

On CUDA the operators' self time is host time: there each phase adds the device time of the
kernels its operators launched (``self_device_time_total``), communication kernels counted whole
(they may overlap compute on their own stream: the phases can then add up to more than the step,
and a pipeline's bubble is in the receives' kernels), and ``host`` is the step's time beyond all
kernels (the device idle, waiting for the host). First run on a GPU (an H200, bench/gpu_check.sh) on
2026-12-04: the step's scope is also recorded as a device-side annotation there (the step was read
from it, and every phase measured 0); the host-side event is the step.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_SCOPE = "phase::step"
FORWARD_SCOPE = "phase::forward"
BACKWARD_SCOPE = "phase::backward"
RECOMPUTE_SCOPE = "phase::recompute"
OPTIMIZER_SCOPE = "phase::optimizer"
CP_SCOPE = "phase::cp"
"""Context parallelism's ring attention (runtime.context_parallel), forward and backward."""
EP_SCOPE = "phase::ep"
"""Expert parallelism's dispatch and return of the rows (runtime.expert_parallel)."""

PHASES = ("forward", "backward", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm", "optimizer", "host")
"""The measured phases, in the report's order (pp_comm includes the pipeline's bubble)."""

_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "_c10d_functional_autograd::", "gloo:",
                  "record_param_comms")  # and any name with "nccl" in it (_is_comm)
_FSDP_COMM = ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait",
              "FSDP::root_post_backward_callback")
_PIPELINE_SCOPES = ("Forward ", "Backward ", "PP:")


def scope(name: str) -> Any:
    """A profiler scope (``record_function``): costs about a microsecond when no profiler runs."""
    return record_function(name)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a checkpointed layer's recompute)."""
    return torch._C._current_graph_task_id() != -1


def _is_comm(name: str) -> bool:
    return name.startswith(_COMM_PREFIXES) or "nccl" in name.lower()


def _comm_kind(name: str, chain: list[str], functional: str) -> str:
    """The communication phase of a collective `name` whose enclosing scopes are `chain` (innermost
    first); `functional`: the phase of a functional collective nothing else places."""
    if any(s.startswith(_FSDP_COMM) for s in chain):
        return "dp_comm"
    if CP_SCOPE in chain:
        return "cp_comm"
    lowered = name.lower()
    if "send" in lowered or "recv" in lowered or any(s.startswith(_PIPELINE_SCOPES) for s in chain[:1]):
        return "pp_comm"
    if EP_SCOPE in chain or any(k in s.lower() for s in [name, *chain] for k in ("all_to_all", "alltoall", "all2all")):
        return "ep_comm"  # the experts' dispatch and return (and in backward, their reverse)
    if name.startswith(("_c10d_functional", "c10d_functional")) or any(
            s.startswith(("_c10d_functional", "c10d_functional")) for s in chain):
        return functional
    return "dp_comm"


def functional_phase(parallel: Any) -> str:
    """Where a functional collective outside every scope that places one goes, by the plan's
    degrees (`parallel`: tp, cp): DTensor's under TP; else torch's ring attention (on CUDA it runs
    outside CP_SCOPE)."""
    return "tp_comm" if getattr(parallel, "tp", 1) > 1 or getattr(parallel, "cp", 1) == 1 else "cp_comm"


def classify(name: str, chain: list[str], functional: str = "tp_comm") -> str:
    """The phase of an operator (or scope) `name`'s self time; `chain`: its enclosing events'
    names, innermost first; `functional`: functional_phase of the plan."""
    if _is_comm(name) or name.startswith(_FSDP_COMM):
        return _comm_kind(name, chain, functional)
    if any(s.startswith(_FSDP_COMM) for s in chain):
        return "dp_comm"  # FSDP's copies into and out of its collectives' buffers
    if name.startswith(_PIPELINE_SCOPES):
        return "pp_comm"  # the schedule's wait for a neighbour (a receive), outside any operator
    for s in [name, *chain]:
        if s == OPTIMIZER_SCOPE:
            return "optimizer"
        if s == RECOMPUTE_SCOPE:
            return "recompute"
    if name.startswith("phase::") or "#" in name:
        return "host"  # a scope's own time: Python between its operators
    for s in chain:
        if s == BACKWARD_SCOPE or s.startswith("Backward "):
            return "backward"
        if s == FORWARD_SCOPE or s.startswith("Forward "):
            return "forward"
    return "backward" if name.startswith("autograd::") or "Backward" in name else "forward"


def phase_times(events: Any, parallel: Any = None, cuda: bool = False) -> dict[str, float]:
    """Seconds per phase (PHASES) of the step the profiler's `events` recorded: the self time of
    every event under ``STEP_SCOPE`` on its thread (on CUDA, with backward's on the autograd
    engine's thread during the step), and the step's time outside any event: host
    time, or with a pipeline (`parallel`, the plan's degrees: pp > 1) the schedule's waits for its
    neighbours (torch's 1F1B waits for its receives outside any scope of its own)."""
    functional, pp = functional_phase(parallel), getattr(parallel, "pp", 1)
    # on CUDA the step's scope is recorded twice: on the host (its operators beneath it) and as a
    # kernel-stream annotation of the same name (no children, no host time); the host one is the step
    roots = [e for e in events if e.name == STEP_SCOPE and getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU]
    if not roots:
        return {}
    root = roots[-1]
    out = dict.fromkeys(PHASES, 0.0)
    counted = 0.0

    def walk(event: Any, chain: list[str]) -> None:
        nonlocal counted
        for child in event.cpu_children:
            walk(child, [event.name, *chain])
        if event is root:
            return
        phase = classify(event.name, chain, functional)
        if cuda:  # the kernels' time on the device, not the host's in launching them
            out[phase] += 0.0 if phase == "host" else event.self_device_time_total / 1e6
        else:
            counted += event.self_cpu_time_total / 1e6
            out[phase] += event.self_cpu_time_total / 1e6

    walk(root, [])
    if cuda:
        # backward's operators run on the autograd engine's thread for the device, not under the step
        for event in _other_threads_within(events, root):
            walk(event, [BACKWARD_SCOPE])
        # the step's time the device ran none of its kernels (its wall: the step synchronises)
        out["host"] = max(0.0, root.cpu_time_total / 1e6 - sum(out.values()))
    else:
        out["pp_comm" if pp > 1 else "host"] += max(0.0, root.cpu_time_total / 1e6 - counted)
    return out


def _other_threads_within(events: Any, root: Any) -> list[Any]:
    """The outermost operators recorded on other threads than `root`'s during its time: on CUDA,
    the autograd engine runs backward on a thread of its own per device (on the CPU, on the thread
    that calls backward: under the step). An H200's runs (bench/measured/h200_fp8_eager_2026-12-04.txt)
    counted backward's kernels as host time before they were looked for there."""
    span = getattr(root, "time_range", None)
    if span is None:
        return []
    return [e for e in events
            if getattr(e, "thread", root.thread) != root.thread and getattr(e, "cpu_parent", None) is None
            and getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU
            and span.start <= e.time_range.start and e.time_range.end <= span.end]


@contextmanager
def profiled(device: torch.device, on: bool) -> Iterator[Callable[[], Optional[Any]]]:
    """Run the block under the profiler when `on` (the events, after the block, from the yielded
    callable; None when off)."""
    if not on:
        yield lambda: None
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def events() -> Any:
        # torch's parsing of the profiler's results once died by SIGSEGV when the cyclic garbage
        # collector ran inside it (a CI run, torch 2.13, runtime/phases.py under ep 2): parse with
        # the collector paused
        enabled = gc.isenabled()
        gc.disable()
        try:
            return prof.events()
        finally:
            if enabled:
                gc.enable()

    collect = gc.isenabled()
    try:
        with profile(activities=activities) as prof:
            with scope(STEP_SCOPE):
                yield events
            # and stopping the profiler once died by SIGSEGV too, inside torch's _disable_profiler (a
            # CI run, torch 2.13, a 4-rank gloo TP x DP plan): the collector is paused across it as well
            gc.disable()
    finally:
        if collect:
            gc.enable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
