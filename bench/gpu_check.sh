#!/usr/bin/env bash
# The issue's GPU check, as one prepared script. First what this GPU's kernels reach against the
# cost model's figures for it (bench/gpu_kernels.py: bf16 and FP8 matmuls by shape, fused attention
# by back end and sequence length, grouped GEMMs, HBM, and a grid of GEMM shapes in bf16 and FP8
# for a Hopper FP8 shape table), then plan a GPT of about 1B parameters for
# one H200 (`--gpu h200 --gpus 1`) and others, run them on CUDA, and print predicted against measured step time
# and peak memory (the allocator's reserved and allocated peaks), and each run's phases (its last
# step under torch.profiler: kernel time per phase) beside the prediction's. Run it once on a
# machine with an NVIDIA GPU, from the repository root:
#
#     bash bench/gpu_check.sh [STEPS]          # writes under $OUT (default /tmp/gpu_check)
#
# The device machine of this workplace has torch (CUDA) but not pulp/highspy: put their wheels for
# its Python in .whl/ first (bench/gpu_wheels.sh, run here) and carry .whl; they are installed into
# /tmp/site. CHECKS (default: all, in this order) names what runs:
#   kernels     bench/gpu_kernels.py
#   calibrate   `plan calibrate` of this GPU (also run for `calibrated`)
#   default     gpt_1b, the planner's own choice (the default global batch, 256 sequences;
#               micro-batch 32 x 8, near the memory limit, so its memory prediction is tested there)
#   gb8         gpt_1b at a global batch of 8
#   calibrated  gpt_1b planned on the GPU as `plan calibrate` measured it
#   fp8         gpt_1b in FP8 (torchao's Float8 Linears, compiled; where torchao imports)
#   llama8, llama8_fp8  four layers of Llama 3 8B (bench/gpu_models/llama3_8b_slice.py) in bf16
#               and FP8: FP8's speed-up at 8B's widths
#   moe         a 2B mixture of experts whose experts run in a Python loop (bench/gpu_models/moe_2b.py)
#   moe_profile one of its layers under torch.profiler: its top kernels, device time against wall
#               (bench/gpu_moe_profile.py; the moe run measured 2.96x its plan on 2026-12-04)
#   compiled    what torch.compile keeps for backward on CUDA (the loss; a Llama block under
#               save-matmuls recompute) against the profile's counts, which
#               tests/unit/test_compiled_memory.py measures on the CPU's inductor
# Each run is limited to RUN_TIMEOUT seconds (default 900). $OUT receives what the device machine
# sends back (at most 8 files: choose CHECKS to fit): gpu_kernels.json, gpu_check.log (everything
# printed), a run report per plan and the calibrated GPU file; the rest stays in a scratch folder.
# Runs (bench/measured/): 2026-12-04 on an H200, the first six (377 s); again, fp8 and the
# llama8/moe runs, twice (FP8 eager, then compiled with the fused optimizer: 367 s).
set -uo pipefail
STEPS=${1:-8}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
WORK=$(mktemp -d)
exec > >(tee "$OUT/gpu_check.log") 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PLAN="python3 -m planner.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
status=0
CHECKS=${CHECKS:-kernels calibrate default gb8 calibrated fp8 llama8 llama8_fp8 moe moe_profile compiled}
want() { [[ " $CHECKS " == *" $1 "* ]]; }
if want kernels; then
    echo "== kernels (bench/gpu_kernels.py)"
    timeout 300 python3 bench/gpu_kernels.py --gpu h200 --out "$OUT" || status=1
fi
if want calibrate || want calibrated; then
    echo "== plan calibrate (the H200 as this node runs it: matmul ceiling, causal SDPA, NCCL collectives, DTensor host time per TP Linear, optimizer step per parameter)"
    $PLAN calibrate --gpu h200 -o "$OUT/h200_calibrated.yaml" --force || status=1
fi
# name: model file and flags (the GPU and --gpus 1 added)
declare -A RUN=(
    [default]="examples/gpt_1b.py"
    [gb8]="examples/gpt_1b.py --global-batch 8"
    [calibrated]="examples/gpt_1b.py"
    [fp8]="examples/gpt_1b.py --precision fp8"
    [llama8]="bench/gpu_models/llama3_8b_slice.py --global-batch 16"
    [llama8_fp8]="bench/gpu_models/llama3_8b_slice.py --global-batch 16 --precision fp8"
    [moe]="bench/gpu_models/moe_2b.py --global-batch 16"
)
NAMES=""
for name in $CHECKS; do  # in the order CHECKS names them
    [ -n "${RUN[$name]:-}" ] || continue
    NAMES="$NAMES $name"
    gpu=h200
    if [[ "${RUN[$name]}" == *fp8* ]] && ! python3 -c "import torchao.float8" 2>/dev/null; then
        echo "== $name: skipped (torchao does not import here: bench/gpu_wheels.sh fetches it)"; continue
    fi
    [ "$name" = calibrated ] && gpu="$OUT/h200_calibrated.yaml"
    [ "$name" = calibrated ] && [ ! -f "$gpu" ] && continue
    echo "== plan ($name: ${RUN[$name]})"
    # shellcheck disable=SC2086
    $PLAN ${RUN[$name]} --gpu "$gpu" --gpus 1 -o "$WORK/plan_$name.json" --force || { status=1; continue; }
    echo "== run ($name, $STEPS steps)"
    timeout "${RUN_TIMEOUT:-900}" $PLAN run "$WORK/plan_$name.json" --steps "$STEPS" --force || status=1
    cp "$WORK/plan_$name.run.json" "$OUT/" 2>/dev/null
done
if want moe_profile; then
    echo "== one MoE layer's kernels (bench/gpu_moe_profile.py)"
    timeout 300 python3 bench/gpu_moe_profile.py || status=1
fi
if want compiled; then
    echo "== what torch.compile keeps on CUDA (the CPU-inductor measurements of tests/unit/test_compiled_memory.py)"
    python3 bench/compiled_memory.py || status=1
fi
python3 - "$OUT" $NAMES <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'plan':10} {'pred step':>10} {'meas step':>10} {'ratio':>6}  memory GB: {'predicted':>10} {'measured':>10} {'ratio':>6}")
for name in sys.argv[2:]:
    path = out / f"plan_{name}.run.json"
    if not path.exists():
        print(f"{name:10} no run report ({path.name}: not run, or see its run above)")
        continue
    r = json.loads(path.read_text())
    p, m = r["predicted"], r["measured"]
    print(f"{name:10} {p['step_time_s']:10.3f} {m['step_time_s']:10.3f} {m['step_time_s'] / p['step_time_s']:6.2f}")
    rows = [("plan's peak", p["peak_memory_bytes"], max(m["peak_memory_bytes"]))]
    if m.get("peak_allocated_bytes") and p.get("allocator_bytes"):  # CUDA: the allocator's reserved and allocated peaks
        rows = [("reserved", p["allocator_bytes"], max(m["peak_memory_bytes"])),
                ("tensors", p["tensor_bytes"], max(m["peak_allocated_bytes"]))]
    for label, pred, meas in rows:
        print(f"{'':10} {label:>32}  {pred / 1e9:10.2f} {meas / 1e9:10.2f} {meas / pred:6.2f}")
    for ph in r.get("phases", []):  # the profiled step's phases (kernel time on CUDA) beside the prediction
        ratio = f"{ph['measured_s'] / ph['predicted_s']:6.2f}" if ph["predicted_s"] > 0 else "     -"
        print(f"    {ph['name']:40} {ph['predicted_s']:10.4f} {ph['measured_s']:10.4f} {ratio}")
PY
exit $status
