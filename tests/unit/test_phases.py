"""runtime.phases: a profiled step's operators put in the cost model's phases (hand-made event
trees, as torch.profiler's FunctionEvent nests them), and one real profiled step on one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from runtime.phases import (
    BACKWARD_SCOPE, CP_SCOPE, EP_SCOPE, FORWARD_SCOPE, OPTIMIZER_SCOPE, RECOMPUTE_SCOPE, STEP_SCOPE, classify,
    functional_phase, phase_times, profiled, scope,
)


class Ev:
    """A FunctionEvent's shape: a name, children, the time of its own and in all (microseconds)."""

    def __init__(self, name: str, own_us: float, *children: "Ev", device_type=DeviceType.CPU, device_us: float = 0.0,
                 thread: int = 1, start_us: float = 0.0):
        self.name, self.cpu_children, self.device_type, self.thread = name, list(children), device_type, thread
        self.self_cpu_time_total = own_us
        self.cpu_time_total = own_us + sum(c.cpu_time_total for c in children)
        self.self_device_time_total = device_us
        self.time_range = SimpleNamespace(start=start_us, end=start_us + self.cpu_time_total)
        self.cpu_parent = None
        for c in children:
            c.cpu_parent = self


def flat(root: Ev) -> list[Ev]:
    out = [root]
    for c in root.cpu_children:
        out += flat(c)
    return out


@pytest.mark.parametrize("name, chain, functional, phase", [
    ("aten::mm", [FORWARD_SCOPE], "tp_comm", "forward"),
    ("aten::mm", ["autograd::engine::evaluate_function: MmBackward0", BACKWARD_SCOPE], "tp_comm", "backward"),
    ("aten::mm", [RECOMPUTE_SCOPE, BACKWARD_SCOPE], "tp_comm", "recompute"),
    ("aten::_foreach_add_", ["Optimizer.step#AdamW.step", OPTIMIZER_SCOPE], "tp_comm", "optimizer"),
    ("_c10d_functional::wait_tensor", ["PythonSubclass", FORWARD_SCOPE], "tp_comm", "tp_comm"),
    ("_c10d_functional::all_gather_into_tensor", [CP_SCOPE, FORWARD_SCOPE], "tp_comm", "cp_comm"),  # the ring
    ("_c10d_functional::wait_tensor", [FORWARD_SCOPE], "cp_comm", "cp_comm"),  # no TP: the ring's (torch's, on CUDA)
    ("_c10d_functional::all_to_all_single", [FORWARD_SCOPE], "tp_comm", "ep_comm"),
    ("_c10d_functional::wait_tensor", [EP_SCOPE, FORWARD_SCOPE], "tp_comm", "ep_comm"),  # the dispatch's wait
    ("c10d::_allgather_base_", ["FSDP::all_gather (blocks.0)", "FSDP::pre_forward", FORWARD_SCOPE], "tp_comm", "dp_comm"),
    ("aten::copy_", ["FSDP::all_gather_copy_out (blocks.0)", FORWARD_SCOPE], "tp_comm", "dp_comm"),  # FSDP's copies
    ("aten::copy_", ["FSDP::pre_forward", FORWARD_SCOPE], "tp_comm", "forward"),
    ("c10d::allreduce_", [BACKWARD_SCOPE], "tp_comm", "dp_comm"),  # DDP's buckets
    ("c10d::recv_", ["Forward 1"], "tp_comm", "pp_comm"),
    ("Backward 3", [], "tp_comm", "pp_comm"),  # the schedule's own time: waiting for the next stage
    (FORWARD_SCOPE, ["Forward 1"], "tp_comm", "host"),
    ("aten::mm", [FORWARD_SCOPE, "Forward 1"], "tp_comm", "forward"),
    ("aten::mm", [BACKWARD_SCOPE, "Backward 1"], "tp_comm", "backward"),
])
def test_each_operator_goes_to_its_phase(name, chain, functional, phase):
    assert classify(name, chain, functional) == phase


def test_functional_collectives_are_tps_unless_the_plan_has_cp_without_tp():
    assert [functional_phase(SimpleNamespace(tp=t, cp=c)) for t, c in ((2, 1), (2, 2), (1, 2), (1, 1))] == [
        "tp_comm", "tp_comm", "cp_comm", "tp_comm"]


def test_phase_times_add_up_to_the_profiled_step():
    """Self times per phase, and the step's time outside every event as host time."""
    step = Ev(STEP_SCOPE, 5.0,
              Ev(FORWARD_SCOPE, 10.0, Ev("aten::mm", 100.0), Ev("_c10d_functional::wait_tensor", 30.0)),
              Ev(BACKWARD_SCOPE, 20.0, Ev("aten::mm", 200.0, Ev("aten::empty", 1.0)),
                 Ev(RECOMPUTE_SCOPE, 2.0, Ev("aten::mm", 50.0)), Ev("c10d::allreduce_", 40.0)),
              Ev(OPTIMIZER_SCOPE, 3.0, Ev("aten::_foreach_add_", 60.0)))
    events = [Ev("aten::other_step", 999.0)] + flat(step)  # only the step's tree counts
    got = {k: round(v * 1e6, 6) for k, v in phase_times(events, SimpleNamespace(tp=2, pp=1)).items() if v}
    assert got == {"forward": 100.0, "backward": 201.0, "recompute": 52.0, "tp_comm": 30.0, "dp_comm": 40.0,
                   "optimizer": 63.0, "host": 35.0}
    assert sum(got.values()) == pytest.approx(step.cpu_time_total)
    assert phase_times([Ev("aten::mm", 1.0)]) == {}  # no profiled step: nothing
    # on CUDA the step's scope comes twice, the second a device-side annotation without children
    # (an H200's run measured every phase 0 when it was read as the step)
    annotation = Ev(STEP_SCOPE, 0.0, device_type=DeviceType.CUDA)
    assert phase_times(events + [annotation], SimpleNamespace(tp=2, pp=1)) == phase_times(events, SimpleNamespace(tp=2, pp=1))


def test_on_cuda_backward_on_the_autograd_engines_thread_counts_as_backward():
    """On CUDA each phase is its kernels' device time, and backward's operators run on the autograd
    engine's own thread, outside the step's tree: they are found there by time (an H200's run read
    them as host time); what another thread ran outside the step is not counted."""
    step = Ev(STEP_SCOPE, 900.0, Ev(FORWARD_SCOPE, 5.0, Ev("aten::mm", 10.0, device_us=300.0)),
              Ev(BACKWARD_SCOPE, 5.0), Ev(OPTIMIZER_SCOPE, 5.0, Ev("aten::_fused_adamw_", 5.0, device_us=50.0)))
    engine = Ev("autograd::engine::evaluate_function: MmBackward0", 5.0,
                Ev("MmBackward0", 5.0, Ev("aten::mm", 10.0, device_us=500.0)), thread=2, start_us=100.0)
    later = Ev("aten::mm", 1.0, device_us=7000.0, thread=2, start_us=5000.0)
    got = phase_times(flat(step) + flat(engine) + [later], cuda=True)
    assert got["forward"] == pytest.approx(300e-6) and got["backward"] == pytest.approx(500e-6)
    assert got["optimizer"] == pytest.approx(50e-6)
    assert got["host"] == pytest.approx(step.cpu_time_total * 1e-6 - 850e-6)
    assert phase_times(flat(step) + flat(engine), cuda=False)["backward"] == 0.0  # the CPU: backward is under the step


def test_a_real_profiled_step_splits_forward_backward_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    with profiled(torch.device("cpu"), True) as events:
        with scope(FORWARD_SCOPE):
            loss = model(x).square().mean()
        with scope(BACKWARD_SCOPE):
            loss.backward()
        with scope(OPTIMIZER_SCOPE):
            opt.step()
    phases = phase_times(events())
    assert all(phases[k] > 0 for k in ("forward", "backward", "optimizer"))
    assert all(phases[k] == 0 for k in ("tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm", "recompute"))
    with profiled(torch.device("cpu"), False) as events:
        pass
    assert events() is None


def test_a_pipeline_steps_time_outside_every_scope_is_its_wait_for_neighbours():
    step = Ev(STEP_SCOPE, 50.0, Ev(FORWARD_SCOPE, 10.0, Ev("aten::mm", 100.0)), Ev("Backward 0", 7.0))
    assert phase_times(flat(step), SimpleNamespace(pp=2))["pp_comm"] == pytest.approx(57e-6)
    assert phase_times(flat(step))["host"] == pytest.approx(60e-6)


def test_the_report_puts_each_phase_beside_its_prediction_and_names_the_largest_departures():
    from runtime.report import HOST_ROW, PredictedRun, ProfiledStep, _phase_notes, _phases

    predicted = PredictedRun(2.0, 1, {"compute": 1.0, "recompute": 0.2, "tp_comm": 0.1, "pp_comm": 0.05, "bubble": 0.25,
                                      "dp_comm": 0.1, "optimizer": 0.3})
    measured = {"forward": 0.4, "backward": 0.6, "host": 0.1, "recompute": 0.21, "tp_comm": 0.35, "pp_comm": 0.3,
                "dp_comm": 0.0, "optimizer": 0.29, "cp_comm": 0.0, "ep_comm": 0.0}
    rows = {r.name: (r.predicted_s, r.measured_s) for r in _phases(predicted, 2.4, 0.31, ProfiledStep(1, 2.35, measured))}
    assert rows == {
        "forward and backward compute": (1.0, pytest.approx(1.1)),  # the host time between its operators in it
        HOST_ROW: (0.0, 0.1), "recompute": (0.2, 0.21), "TP communication": (0.1, 0.35),
        "DP communication (exposed)": (0.1, 0.0), "pipeline communication and bubble": (pytest.approx(0.3), 0.3),
        "optimizer step": (0.3, 0.29),  # the profiled step's, as the other rows
    }
    notes = _phase_notes(_phases(predicted, 2.4, 0.31, ProfiledStep(1, 2.35, measured)))
    assert notes == ["the largest departures: TP communication, 350.00 ms measured against 100.00 ms predicted (3.50x); "
                     "DP communication (exposed), 0 us measured against 100.00 ms predicted (0.00x)"]
    # a run too short to profile a step: the optimizer step and the rest
    assert [r.name for r in _phases(predicted, 2.4, 0.31, None)] == ["forward, backward, communication, bubble",
                                                                     "optimizer step"]


def test_the_step_time_is_the_later_half_of_the_steps_after_the_first_without_the_profiled_one():
    from runtime.train import median_step_time, timed_steps

    assert [list(timed_steps(n)) for n in (1, 2, 4, 8)] == [[0], [1], [2, 3], [4, 5, 6, 7]]
    assert [list(timed_steps(n, profiled=True)) for n in (3, 5, 8)] == [[1], [2, 3], [4, 5, 6]]
    # a CPU run warming up over its first steps, the profiled last one slowed by the profiler
    assert median_step_time((2.3, 1.85, 1.62, 1.33, 1.46, 1.35, 1.36, 1.86), profiled=True) == 1.36


def test_a_ring_attentions_own_python_time_is_host_time_and_its_kernel_the_phase_it_runs_in():
    assert classify(CP_SCOPE, [FORWARD_SCOPE]) == "host"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu", [CP_SCOPE, FORWARD_SCOPE]) == "forward"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                    [CP_SCOPE, "autograd::engine::evaluate_function: X", BACKWARD_SCOPE]) == "backward"


def test_a_cuda_runs_memory_is_compared_as_the_allocator_holds_it():
    """On CUDA the plan's tensors with fragmentation go against max_memory_reserved, its tensors
    against max_memory_allocated (an H200 run compared the plan's whole peak, reserve included,
    against the allocated peak: 0.86x where the tensors matched); on CPU the whole peak against RSS."""
    from planner.model_file import load_model_file
    from planner.planning import PlanRequest, make_plan
    from runtime.report import build_report, render_report
    from tests.conftest import EXAMPLES

    plan = make_plan(load_model_file(EXAMPLES / "mlp.py"), PlanRequest(gpus=1, gpu="h200", global_batch=8))
    m = plan.stages[0].memory_bytes
    tensors = m.weights + m.grads + m.optimizer + m.activations
    frag = plan.predicted.fragmentation
    assert frag > 0 and plan.predicted.peak_memory_bytes > tensors * (1 + frag)  # the rest: context, buffers

    def report(held, allocated=()):
        return build_report(plan, "p.json", "cuda" if allocated else "cpu", 4, step_time_s=1.0, step_times_s=(1.0,) * 4,
                            peak_memory_bytes=held, losses=(1.0,) * 4, peak_allocated_bytes=allocated)

    cuda = report([int(tensors * (1 + frag) * 1.05)], [tensors])
    assert cuda.predicted.tensor_bytes == tensors and cuda.ratios.memory == pytest.approx(1.05, rel=1e-6)
    cpu = report([plan.predicted.peak_memory_bytes * 2])
    assert cpu.ratios.memory == pytest.approx(2.0)
    from rich.console import Console
    console = Console(record=True, width=200)
    render_report(cuda, console)
    text = console.export_text()
    assert "allocator reserved" in text and "of which tensors (allocated)" in text and "1.00x" in text
