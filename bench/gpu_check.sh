#!/usr/bin/env bash
# The issue's GPU check, as one prepared script: plan a GPT of about 1B parameters for one H200
# (`--gpu h200 --gpus 1`), run it on CUDA, and print predicted against measured step time and peak
# memory, and each run's phases (its last step under torch.profiler: kernel time per phase) beside
# the prediction's. Run it once on a machine with an NVIDIA GPU, from the repository root:
#
#     bash bench/gpu_check.sh [STEPS]          # writes under $OUT (default /tmp/gpu_check)
#
# The device machine of this workplace has torch (CUDA) but not pulp/highspy: put their wheels for
# its Python in .whl/ first (bench/gpu_wheels.sh, run here) and carry .whl; they are installed into
# /tmp/site. Three plans run: the planner's own choice (the default global batch, 256 sequences;
# micro-batch 32 x 8, near the memory limit, so its memory prediction is tested there), a global
# batch of 8, and the planner's choice again on the H200 as `plan calibrate` measured it (before
# and after calibration, side by side). Then what torch.compile keeps for backward on CUDA
# (the loss; a Llama block under save-matmuls recompute) against the profile's counts, which
# tests/unit/test_compiled_memory.py measures on the CPU's inductor.
set -uo pipefail
STEPS=${1:-8}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PLAN="python3 -m planner.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
status=0
echo "== plan calibrate (the H200 as this node runs it: matmul ceiling, causal SDPA, NCCL collectives, DTensor host time per TP Linear, optimizer step per parameter)"
$PLAN calibrate --gpu h200 -o "$OUT/h200_calibrated.yaml" --force 2>&1 | tee "$OUT/calibrate.txt" || status=1
for name in default gb8 calibrated; do
    extra=()
    gpu=h200
    [ "$name" = gb8 ] && extra=(--global-batch 8)
    [ "$name" = calibrated ] && gpu="$OUT/h200_calibrated.yaml"
    [ "$name" = calibrated ] && [ ! -f "$gpu" ] && continue
    echo "== plan ($name)"
    $PLAN examples/gpt_1b.py --gpu "$gpu" --gpus 1 "${extra[@]}" -o "$OUT/plan_$name.json" --force 2>&1 | tee "$OUT/plan_$name.txt" || { status=1; continue; }
    echo "== run ($name, $STEPS steps)"
    $PLAN run "$OUT/plan_$name.json" --steps "$STEPS" --force 2>&1 | tee "$OUT/run_$name.txt" || status=1
done
echo "== what torch.compile keeps on CUDA (the CPU-inductor measurements of tests/unit/test_compiled_memory.py)"
python3 bench/compiled_memory.py 2>&1 | tee "$OUT/compiled_memory.txt" || status=1
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'plan':8} {'pred step':>10} {'meas step':>10} {'ratio':>6} {'pred mem GB':>12} {'meas mem GB':>12} {'ratio':>6}")
for name in ("default", "gb8", "calibrated"):
    path = out / f"plan_{name}.run.json"
    if not path.exists():
        print(f"{name:8} no run report ({path.name} missing: see run_{name}.txt)")
        continue
    r = json.loads(path.read_text())
    p, m = r["predicted"], r["measured"]
    pm, mm = max(p["peak_memory_bytes"]) if isinstance(p["peak_memory_bytes"], list) else p["peak_memory_bytes"], max(m["peak_memory_bytes"])
    print(f"{name:8} {p['step_time_s']:10.3f} {m['step_time_s']:10.3f} {m['step_time_s'] / p['step_time_s']:6.2f} "
          f"{pm / 1e9:12.2f} {mm / 1e9:12.2f} {mm / pm:6.2f}")
    for ph in r.get("phases", []):  # the profiled step's phases (kernel time on CUDA) beside the prediction
        ratio = f"{ph['measured_s'] / ph['predicted_s']:6.2f}" if ph["predicted_s"] > 0 else "     -"
        print(f"    {ph['name']:40} {ph['predicted_s']:10.4f} {ph['measured_s']:10.4f} {ratio}")
PY
exit $status
