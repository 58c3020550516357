"""16-bit plans run as the cost model counts them: FSDP2's MixedPrecisionPolicy casts the fp32
parameters, so what the forward saves is the profile's 16-bit activation figure (not autocast's
fp32 residual stream). One process, a one-rank gloo group, in a subprocess of its own."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import EXAMPLES

SCRIPT = f"""
import json, os, socket, sys
import torch, torch.distributed as dist
sys.path.insert(0, {str(EXAMPLES)!r})
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from planner.model_file import load_model_file
from planner.planning import PlanRequest, make_plan
from planner.profile import profile_model
from runtime.data_parallel import apply_dp, autocast_dtype

path = sys.argv[1]
handle = load_model_file(path)
plan = make_plan(handle, PlanRequest(gpus=1, gpu="cpu", precision="bf16", global_batch=4))
profile = profile_model(handle, batch_size=4, dtype="bf16", force_meta=True, measure=False)
torch.manual_seed(0)
model = handle.build_model().float()
wrapped = apply_dp(model, plan, plan.model.layers, init_device_mesh("cpu", (1,)), torch.device("cpu"))
params = set()
for p in model.parameters():
    params.add(p.to_local().untyped_storage().data_ptr() if hasattr(p, "to_local") else p.untyped_storage().data_ptr())
seen = {{}}
def pack(t):
    st = t.untyped_storage()
    seen.setdefault(st.data_ptr(), (st.nbytes(), str(t.dtype)))
    return t
x, y = handle.sample_batch(4)
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    out = wrapped(x)
kept = {{k: v for k, v in seen.items() if k not in params}}
print(json.dumps({{
    "autocast": str(autocast_dtype(plan)), "fsdp": type(wrapped).__name__, "out": str(out.dtype),
    "saved": sum(n for n, _ in kept.values()), "fp32_saved": sum(n for n, d in kept.values() if d == "torch.float32"),
    "predicted": sum(l.activation_bytes for l in profile.layers),
    "param_dtype": str(next(model.parameters()).dtype),
}}))
"""


def small_gpt(tmp_path, vocab: int = 512):
    """A 2-block GPT's model file in `tmp_path`."""
    model = tmp_path / "small_gpt.py"
    model.write_text(
        f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom gpt import GPT, GPTConfig, gpt_batch\n"
        f"CFG = GPTConfig(vocab={vocab}, seq_len=64, n_layer=2, n_head=4, n_embd=64)\n"
        "def build_model():\n    return GPT(CFG)\n"
        "def sample_batch(n):\n    return gpt_batch(CFG, n)\n"
    )
    return model


def run_on_small_gpt(script: str, tmp_path, vocab: int = 512) -> dict:
    """`script` run in a subprocess on a 2-block GPT's model file (its argv[1]): its last line's JSON."""
    model = small_gpt(tmp_path, vocab)
    done = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bf16_plan_saves_the_profiles_16bit_activations(tmp_path):
    got = run_on_small_gpt(SCRIPT, tmp_path)
    assert got["fsdp"].startswith("FSDP") and got["autocast"] == "None" and got["out"] == "torch.bfloat16" and got["param_dtype"] == "torch.float32"
    # what the forward saves is the 16-bit figure the plan counts (the fp32 part: softmax statistics)
    assert got["saved"] <= 1.1 * got["predicted"], got
    assert got["fp32_saved"] <= 0.1 * got["saved"], got
