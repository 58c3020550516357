#!/usr/bin/env bash
# Wheels of what bench/gpu_check.sh needs and the device machine lacks (pulp, highspy, torchao), for its
# Python 3.12 on x86-64, into .whl/ (ignored by git). Run here, with network access to PyPI: the same versions as this machine has.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "pulp==$(python3 -c "import importlib.metadata as m; print(m.version('pulp'))")" "highspy==$(python3 -c "import importlib.metadata as m; print(m.version('highspy'))")"
# torchao for the FP8 run (no dependencies; pure-Python Float8 training): TORCHAO=VERSION picks the
# release made for the device's torch (2.11 there on 2026-12-04), else the newest
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "torchao${TORCHAO:+==$TORCHAO}"
ls -la .whl
