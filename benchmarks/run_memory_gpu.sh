#!/usr/bin/env bash
# Every GPU check of the memory core, one command, results under $OUT
# (default benchmarks/results). Run from the repository root on the H200:
#   OUT=/path/to/out bash benchmarks/run_memory_gpu.sh
# Each step runs even if an earlier one fails; the exit status is the worst.
set -u
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
status=0
run() {
  local name="$1"; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc"
  [ "$rc" -gt "$status" ] && status=$rc
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/memory-gpu-device.txt" 2>&1
run memory-gpu-tests "$PY" -m pytest tests/memory/test_gpu.py -m gpu -v -p no:cacheprovider
run memory-h200 "$PY" benchmarks/memory.py --backend cuda --out "$OUT/memory-h200.json"
# where growth time goes: Python cost per page (null driver) and the per-call split
run grow-overhead-h200 "$PY" benchmarks/grow_overhead.py --backend cuda --out "$OUT/grow-overhead-h200.json"
run grow-overhead-h200-batched "$PY" benchmarks/grow_overhead.py --backend cuda --pages-per-take 32 --out "$OUT/grow-overhead-h200-batched.json"
run kv-layout-h200 "$PY" benchmarks/kv_layout.py --out "$OUT/kv-layout-h200.json"
exit $status
