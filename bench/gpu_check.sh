#!/usr/bin/env bash
# The issue's GPU check, as one prepared script. First what this GPU's kernels reach against the
# cost model's figures for it (bench/gpu_kernels.py: bf16 and FP8 matmuls by shape, fused attention
# by back end and sequence length, grouped GEMMs, HBM), then plan a GPT of about 1B parameters for
# one H200 (`--gpu h200 --gpus 1`), run it on CUDA, and print predicted against measured step time
# and peak memory (the allocator's reserved and allocated peaks), and each run's phases (its last
# step under torch.profiler: kernel time per phase) beside the prediction's. Run it once on a
# machine with an NVIDIA GPU, from the repository root:
#
#     bash bench/gpu_check.sh [STEPS]          # writes under $OUT (default /tmp/gpu_check)
#
# The device machine of this workplace has torch (CUDA) but not pulp/highspy: put their wheels for
# its Python in .whl/ first (bench/gpu_wheels.sh, run here) and carry .whl; they are installed into
# /tmp/site. Four plans run: the planner's own choice (the default global batch, 256 sequences;
# micro-batch 32 x 8, near the memory limit, so its memory prediction is tested there), a global
# batch of 8, the planner's choice again on the H200 as `plan calibrate` measured it (before and
# after calibration, side by side), and in FP8 (torchao's Float8 Linears, where torchao imports).
# Then what torch.compile keeps for backward on CUDA
# (the loss; a Llama block under save-matmuls recompute) against the profile's counts, which
# tests/unit/test_compiled_memory.py measures on the CPU's inductor. $OUT receives at most 8 files
# (what the device machine sends back): gpu_kernels.json, gpu_check.log (everything printed), the
# four run reports and the calibrated GPU file; the rest stays in a scratch folder.
# Last run: 2026-12-04 on an H200 (bench/measured/): 377 s in all.
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
echo "== kernels (bench/gpu_kernels.py)"
timeout 300 python3 bench/gpu_kernels.py --gpu h200 --out "$OUT" || status=1
echo "== plan calibrate (the H200 as this node runs it: matmul ceiling, causal SDPA, NCCL collectives, DTensor host time per TP Linear, optimizer step per parameter)"
$PLAN calibrate --gpu h200 -o "$OUT/h200_calibrated.yaml" --force || status=1
for name in default gb8 calibrated fp8; do
    extra=()
    gpu=h200
    [ "$name" = gb8 ] && extra=(--global-batch 8)
    [ "$name" = fp8 ] && extra=(--precision fp8)
    if [ "$name" = fp8 ] && ! python3 -c "import torchao.float8" 2>/dev/null; then
        echo "== fp8: skipped (torchao does not import here: bench/gpu_wheels.sh fetches it)"; continue
    fi
    [ "$name" = calibrated ] && gpu="$OUT/h200_calibrated.yaml"
    [ "$name" = calibrated ] && [ ! -f "$gpu" ] && continue
    echo "== plan ($name)"
    $PLAN examples/gpt_1b.py --gpu "$gpu" --gpus 1 "${extra[@]}" -o "$WORK/plan_$name.json" --force || { status=1; continue; }
    echo "== run ($name, $STEPS steps)"
    $PLAN run "$WORK/plan_$name.json" --steps "$STEPS" --force || status=1
    cp "$WORK/plan_$name.run.json" "$OUT/" 2>/dev/null
done
echo "== what torch.compile keeps on CUDA (the CPU-inductor measurements of tests/unit/test_compiled_memory.py)"
python3 bench/compiled_memory.py || status=1
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'plan':10} {'pred step':>10} {'meas step':>10} {'ratio':>6}  memory GB: {'predicted':>10} {'measured':>10} {'ratio':>6}")
for name in ("default", "gb8", "calibrated", "fp8"):
    path = out / f"plan_{name}.run.json"
    if not path.exists():
        print(f"{name:10} no run report ({path.name} missing: see its run above)")
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
