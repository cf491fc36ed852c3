#!/usr/bin/env bash
# The cold first step with and without fla's tuned kernel configs (issue 24; dflash/fla_configs.py), in one device
# call: run `autotune` starts with empty Triton and inductor caches and an empty config store (fla autotunes every
# kernel, then the run records its choices), run `store` starts with new empty caches and that store (fla compiles
# one config per kernel). The first step's split (target forward = fla's first calls) of each is printed last;
# each run's store is archived as $OUT/store-RUN.tgz. RUNS="seeded" (or "autotune seeded") times instead a fresh
# machine with what dflash ships: new empty caches and an empty store into which the configs of dflash/fla_seed for
# this GPU are merged first (`--fla-seed`, as `dflash train` does on a fresh host); RUNS="seeded store" then times
# new empty caches with the store the seeded run completed (for a seed that lacked some kernel's key).
# Usage on the GPU machine (repo root; fla / causal-conv1d wheels on PYTHONPATH, e.g. /tmp/site):
#   OUT=/some/dir bash bench/fla_cold_start.sh bench/h200-27b-like.yaml --vocab 248320 --compile-scope regional
#   RUNS=seeded OUT=/some/dir bash bench/fla_cold_start.sh bench/h200-27b-like.yaml --vocab 248320 --compile-scope regional
set -euo pipefail
cfg=${1:?usage: OUT=DIR bash bench/fla_cold_start.sh CONFIG [step_phases options]}
shift
OUT=${OUT:?set OUT to a directory for the logs}
work=$(mktemp -d /tmp/fla-cold.XXXXXX)
runs=(${RUNS:-autotune store})
for run in "${runs[@]}"; do
  store="$work/store" extra=()
  if [[ $run == seeded ]]; then store="$work/store-seeded" extra=(--fla-seed); fi
  echo "== $run: TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR empty, store $store"
  TRITON_CACHE_DIR="$work/triton-$run" TORCHINDUCTOR_CACHE_DIR="$work/inductor-$run" \
    python3 bench/step_phases.py "$cfg" --steps 2 --warmup 1 --profile-steps 0 --fla-configs "$store" "${extra[@]}" "$@" \
    --json "$OUT/cold-$run.json" > "$OUT/cold-$run.log" 2>&1 || { tail -30 "$OUT/cold-$run.log"; exit 1; }
  grep -E "first step|fla kernel configs|target built|host syncs" "$OUT/cold-$run.log" || true
  # the recorded store as soon as it exists (what dflash/fla_seed ships is copied from here), one archive per run (a
  # device call brings back a few files, not a store's many): a call cut short by its time limit still brings it back
  tar -C "$store" -czf "$OUT/store-$run.tgz" .
  # a later `store` run after `seeded` alone starts from what the seeded run completed (shipped + its own tuning)
  if [[ $run == seeded && ! -e "$work/store" ]]; then cp -r "$store" "$work/store"; fi
done
python3 - "$OUT" "${runs[@]}" <<'PY'
import json, sys
runs = {r: json.load(open(f"{sys.argv[1]}/cold-{r}.json")) for r in sys.argv[2:]}
for r, rep in runs.items():
    print(f"{r:9} first step {rep['first_step_s']:7.1f} s  split {rep['first_step_split_s']}")
if "autotune" in runs and len(runs) > 1:
    a = runs["autotune"]["first_step_split_s"]["target"]
    for r in runs.keys() - {"autotune"}:
        s = runs[r]["first_step_split_s"]["target"]
        print(f"target forward of the first step: autotune {a} s -> {r} {s} s ({a / max(s, 1e-9):.2f}x)")
PY
