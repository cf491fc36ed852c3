#!/usr/bin/env bash
# GPU checks on the H200 device machine, in parts that each fit one 600-s device call (bench/gpu_checks_parts.py
# holds the parts, their checks and estimated seconds; issue 24).
# Usage there (repo root, wheels carried in .whl/):
#   OUT=/some/dir bash bench/gpu_checks.sh part1     # one part (part1 .. part9), <= 540 s on a fresh H200
#   OUT=/some/dir bash bench/gpu_checks.sh all       # every part in turn (longer than one device call)
#   bash bench/gpu_checks.sh --list                  # the parts, their checks and estimates
# Each check runs in its own pytest process (a crash or hang in one never hides the others), under the time left
# to the part (GPU_CHECKS_BUDGET_S, default 540 s); a check whose estimate no longer fits is reported "not started".
# The summary line "gpu_checks PART: ..." prints however the part ends; the exit status is 1 if any check failed,
# timed out, was skipped (on the GPU machine a skip means a missing wheel) or was not started, else 0.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ ${1:-} == --list || ${1:-} == -l ]]; then exec python3 "$here/gpu_checks_parts.py" --list; fi
part=${1:?usage: bash bench/gpu_checks.sh part1|part2|...|all|--list}
if [[ $part == all ]]; then
  rc=0
  for p in $(python3 "$here/gpu_checks_parts.py" --parts); do bash "$0" "$p" || rc=1; done
  exit $rc
fi
ids=$(python3 "$here/gpu_checks_parts.py" --ids "$part") || exit 2
OUT=${OUT:?set OUT to a directory for the logs}
budget=${GPU_CHECKS_BUDGET_S:-540}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
base_path=$PYTHONPATH
log="$OUT/gpu-$part.log"
start=$SECONDS
passed=() failed=() skipped=() timed_out=() not_started=()

summary() {
  local n=$(( ${#passed[@]} + ${#failed[@]} + ${#skipped[@]} + ${#timed_out[@]} + ${#not_started[@]} ))
  local line="gpu_checks $part: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped, ${#timed_out[@]} timed out, ${#not_started[@]} not started, of $n, in $(( SECONDS - start )) s"
  local x
  for x in "${failed[@]}"; do line+=$'\n'"  FAILED $x"; done
  for x in "${timed_out[@]}"; do line+=$'\n'"  TIMED OUT $x"; done
  for x in "${not_started[@]}"; do line+=$'\n'"  NOT STARTED $x"; done
  for x in "${skipped[@]}"; do line+=$'\n'"  SKIPPED $x"; done
  echo "$line" | tee -a "$log"
}
trap summary EXIT

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, transformers, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$log"
# The wheels go to /tmp/site; only checks marked fla get it on their path. GPU_CHECKS_WHEELS: another wheel dir.
wheels=${GPU_CHECKS_WHEELS:-.whl}
if ! ls "$wheels"/*.whl > /dev/null 2>&1; then
  echo "gpu_checks: no wheels in $wheels/ (carry the fla / causal-conv1d wheels as .whl, docs/gpu-checks.md)" | tee -a "$log"
elif ! python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl 2>&1 | tee -a "$log"; then
  echo "gpu_checks: installing $wheels/*.whl into /tmp/site failed" | tee -a "$log"
  exit 3
else
  # what the checks marked fla import (the wheels may bring their own transformers: bench/transformers_wheels.sh)
  PYTHONPATH="/tmp/site:$base_path" python3 -c 'import transformers, fla; print("with the wheels: transformers", transformers.__version__, "fla", fla.__version__)' 2>&1 | tail -1 | tee -a "$log"
fi

while read -r env est node; do
  [[ -z $node ]] && continue
  name=$node
  [[ $env == nofla ]] && name="$node (without fla)"
  left=$(( budget - (SECONDS - start) ))
  if (( est > left )); then not_started+=("$name (estimate ${est} s, ${left} s left)"); continue; fi
  path=$base_path
  [[ $env == fla ]] && path="/tmp/site:$base_path"
  echo "== $name (estimate ${est} s, ${left} s left) ==" | tee -a "$log"
  t0=$SECONDS
  out=$(PYTHONPATH=$path timeout -k 10 "$left" python3 -m pytest --noconftest -q -rA -p no:logging "$node" 2>&1)
  code=$?
  printf '%s\n' "$out" >> "$log"
  last=$(printf '%s\n' "$out" | grep -E '(passed|failed|skipped|error|no tests ran)' | tail -1)
  echo "   rc $code in $(( SECONDS - t0 )) s: $last" | tee -a "$log"
  if (( code == 124 || code == 137 )); then timed_out+=("$name (killed after $(( SECONDS - t0 )) s)")
  elif (( code != 0 )); then failed+=("$name (rc $code: $last)")
  elif [[ $last == *skipped* && $last != *passed* ]]; then skipped+=("$name ($last)")
  else passed+=("$name"); fi
done <<< "$ids"

# A skip on the GPU machine means something the check needs is missing (a wheel, CUDA): not a pass.
(( ${#failed[@]} + ${#timed_out[@]} + ${#not_started[@]} + ${#skipped[@]} == 0 ))
