#!/usr/bin/env bash
# Device run: the 1-GPU colocated throughput baseline at a Qwen3.5-4B-like shape, launched and followed by opsctl.
# On the device machine (carry .whl: fla + causal-conv1d wheels, and opsctl's own deps in .whl/ops):
#   bash bench/h200_colocated.sh [CONFIG]      -> $OUT/{launch.log,stream.jsonl,events.jsonl,summary.txt}
#   MAX_STEPS=240 bash bench/h200_colocated.sh  (issue 11: GPU utilisation and 0 recompiles over >= 200 steps)
set -uo pipefail
export PYTHONUNBUFFERED=1
CONFIG=${1:-configs/h200-4b-like.yaml}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/ops/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
RUN=${BENCH_RUN:-/tmp/bench-run}
hosts=/tmp/bench-hosts.yaml
cat > "$hosts" <<YAML
hosts:
  local:
    local: true
    runs:
      bench:
        workdir: $PWD
        command: ["{python}", -m, dflash, train, --config, $CONFIG, --out, $RUN, --fresh${MAX_STEPS:+, --max-steps, '$MAX_STEPS'}]
        log: $RUN/train.log
        events: $RUN/events.jsonl
        tmux_session: dflash-bench
        ready_timeout: 540
YAML
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader || true
(python3 -m opsctl --hosts "$hosts" launch local bench --follow > "$OUT/launch.log" 2>&1
 echo "launch --follow rc=$?" >> "$OUT/launch.log") &
launch=$!
sleep 2  # the recorder reads from byte 0, so starting after the launch loses nothing
python3 scripts/record_stream.py --hosts "$hosts" --until-exit local bench "$OUT/stream.jsonl" --seconds 560
wait "$launch"
tail -1 "$OUT/launch.log"
cp "$RUN/events.jsonl" "$OUT/events.jsonl"
grep -E "start on|target:|target\.(cuda_graph|fused_elementwise)|drafter:|first compiled|READY|step +(1|2|3|10|20|30|40)\/|run_end" \
  "$OUT/launch.log" | cut -c1-220
python3 bench/train_throughput.py "$OUT/events.jsonl" --stream "$OUT/stream.jsonl" | tee "$OUT/summary.txt"
