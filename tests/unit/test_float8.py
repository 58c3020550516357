"""FP8 plans (runtime.float8): torchao's Float8 Linears swapped in before the parallelisms, as
torchtitan runs them; which machines can run them. The training step itself runs here on the CPU
(torch's CPU _scaled_mm), in a one-rank gloo group under FSDP2, in a subprocess of its own:
`plan run` refuses FP8 on a machine without FP8 tensor cores, so this is where its code runs in CI."""

from __future__ import annotations

import pytest

from runtime.float8 import float8_blocker
from tests.conftest import EXAMPLES
from tests.unit.test_mixed_precision import run_on_small_gpt, small_gpt

pytest.importorskip("torchao.float8")

SCRIPT = f"""
import json, os, socket, sys
from dataclasses import replace
import torch, torch.distributed as dist
sys.path.insert(0, {str(EXAMPLES)!r})
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from planner.model_file import load_model_file
from planner.planning import PlanRequest, make_plan
from runtime.parallelize import parallelize

handle = load_model_file(sys.argv[1])
bf16 = make_plan(handle, PlanRequest(gpus=1, gpu="cpu", precision="bf16", global_batch=4))
fp8 = replace(bf16, training=replace(bf16.training, precision="fp8"))
mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
x, y = handle.sample_batch(4)
out = {{}}
for name, plan in (("bf16", bf16), ("fp8", fp8)):
    torch.manual_seed(0)
    model = handle.build_model().float()
    wrapped = parallelize(model, plan, plan.model.layers, mesh, torch.device("cpu"), {{}})
    logits = wrapped(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    from torchao.float8.float8_linear import Float8Linear
    kinds = {{"float8": sum(isinstance(m, Float8Linear) for m in model.modules()),
             "linear": sum(isinstance(m, torch.nn.Linear) for m in model.modules()),
             "head": isinstance(model.lm_head, Float8Linear),
             "compiled": sum(isinstance(m, Float8Linear) and "forward" in vars(m) for m in model.modules())}}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    out[name] = {{"loss": loss.item(), "kinds": kinds, "grads": len(grads), "dtype": str(logits.dtype),
                 "finite": all(bool(torch.isfinite(g.full_tensor() if hasattr(g, "full_tensor") else g).all()) for g in grads)}}
print(json.dumps(out))
"""


def test_an_fp8_plan_trains_with_float8_linears_under_fsdp2(tmp_path):
    """A small GPT (vocabulary 500: its head's features not a multiple of 16) planned in bf16 and
    run as the FP8 plan: its block Linears become Float8Linear, each one's forward compiled, the
    head stays a 16-bit Linear;
    FSDP2 wraps the result with bf16 mixed precision; the loss matches the bf16 run's to a few
    percent and every gradient is finite."""
    got = run_on_small_gpt(SCRIPT, tmp_path, vocab=500)
    bf16, fp8 = got["bf16"]["kinds"], got["fp8"]["kinds"]
    assert bf16["float8"] == 0 and fp8["float8"] == fp8["linear"] - 1 == bf16["linear"] - 1 > 0, got  # all but the head
    assert not fp8["head"]
    assert fp8["compiled"] == fp8["float8"]  # each Float8 Linear's forward compiled (its casts fused)
    # bf16 mixed precision around the FP8 matmuls, as the plan counts it (FSDP2's policy on one rank)
    assert got["fp8"]["dtype"] == got["bf16"]["dtype"] == "torch.bfloat16", got
    assert got["fp8"]["finite"] and got["fp8"]["grads"] == got["bf16"]["grads"] > 0
    assert got["fp8"]["loss"] == pytest.approx(got["bf16"]["loss"], rel=0.05), got


@pytest.mark.parametrize("capability, says", [
    (None, "runs on CUDA GPUs with FP8 tensor cores"),
    ((8, 0), "this GPU is 8.0"),
    ((8, 9), None),
    ((9, 0), None),
    ((10, 0), None),
])
def test_which_machines_run_an_fp8_plan(capability, says, monkeypatch):
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: True)  # a CUDA machine's torch
    blocker = float8_blocker(capability)
    assert (blocker is None) if says is None else (says in blocker), blocker


def test_an_fp8_plan_needs_triton_on_cuda_for_its_compiled_casts(monkeypatch):
    """Without Triton torch.compile cannot build the Float8 Linears' CUDA kernels, and eager casts
    ran FP8 slower than bf16 on an H200: one line before launching, not a failure in the first step."""
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: False)
    assert "Triton is not installed" in float8_blocker((9, 0))


TP_SCRIPT = f"""
import json, sys
from dataclasses import replace
import torch, torch.distributed as dist
sys.path.insert(0, {str(EXAMPLES)!r})
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from planner.model_file import load_model_file
from planner.planning import PlanRequest, make_plan
from planner.search.space import Fixed
from runtime.parallelize import parallelize

handle = load_model_file(sys.argv[1])
x, y = handle.sample_batch(4)
mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
out = {{}}
for sp in (False, True):
    bf16 = make_plan(handle, PlanRequest(gpus=2, gpu="h100-sxm-80gb", global_batch=4,
                                         fixed=Fixed(tp=2, dp=1, sequence_parallel=sp)))
    for name, plan in (("bf16", bf16), ("fp8", replace(bf16, training=replace(bf16.training, precision="fp8")))):
        torch.manual_seed(0)
        model = handle.build_model().float()
        logits = parallelize(model, plan, plan.model.layers, mesh, torch.device("cpu"), {{}})(x)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        out[f"{{name}} sp={{sp}}"] = loss.item()
if dist.get_rank() == 0:
    print(json.dumps(out))
"""


def test_an_fp8_plan_runs_under_tensor_parallelism(tmp_path):
    """tp 2, with and without sequence parallelism, two gloo processes: the Float8 Linears take
    torch's plain TP styles (their weights DTensor shards, each cast with the whole tensor's scale)
    and the loss matches the 16-bit run's."""
    import json
    import subprocess
    import sys

    model = small_gpt(tmp_path)
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(model)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for sp in (False, True):
        assert got[f"fp8 sp={sp}"] == pytest.approx(got[f"bf16 sp={sp}"], rel=0.01), got


def test_an_fp8_plan_computes_in_bf16_around_its_fp8_matmuls(tmp_path):
    """An FP8 plan is bf16 mixed precision whose Linear matmuls run in FP8: DDP (ZeRO-0/1 over
    dp > 1) runs its forward under bf16 autocast, FSDP2 casts its parameters to bf16, as a bf16
    plan's would."""
    from dataclasses import replace

    import torch

    from planner.model_file import load_model_file
    from planner.planning import PlanRequest, make_plan
    from planner.search.space import Fixed
    from runtime.data_parallel import autocast_dtype, mixed_precision

    handle = load_model_file(small_gpt(tmp_path))
    for zero, autocast in ((0, torch.bfloat16), (3, None)):
        bf16 = make_plan(handle, PlanRequest(gpus=2, gpu="h100-sxm-80gb", global_batch=4, fixed=Fixed(dp=2, zero=zero)))
        fp8 = replace(bf16, training=replace(bf16.training, precision="fp8"))
        assert autocast_dtype(fp8) == autocast_dtype(bf16) == autocast
        assert mixed_precision(fp8).param_dtype == torch.bfloat16

