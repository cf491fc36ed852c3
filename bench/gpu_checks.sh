#!/usr/bin/env bash
# GPU checks on the H200 device machine: tests/gpu once without the fla / causal-conv1d wheels, then once with them.
# Usage there (repo root, wheels carried in .whl/): OUT=/some/dir bash bench/gpu_checks.sh
set -uo pipefail
OUT=${OUT:?set OUT to a directory for the logs}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rc=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, transformers, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/device.txt"
# The wheels go to /tmp/site but are not on the path for the first pass.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
echo "== pass 1: without fla / causal-conv1d =="
python3 -m pytest --noconftest -q -rA -k kernels_bound tests/gpu 2>&1 | tee "$OUT/gpu-nofla.log" || rc=1
echo "== pass 2: with fla + causal-conv1d =="
export PYTHONPATH="/tmp/site:$PYTHONPATH"
python3 -m pytest --noconftest -q -rA --durations=10 tests/gpu 2>&1 | tee "$OUT/gpu.log" || rc=1
exit $rc
