#!/usr/bin/env bash
# issue 13 on 16 cores: ZB-H1 / 1F1B with gloo receives polled (PIPEPLAN_P2P_SPIN_MS) and
# with the model's waits busy (PIPEPLAN_SLEEP_SPIN_MS) instead of sleeping
set -u
PY=${PY:-python3}
OUT=${OUT:-/tmp/spin}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
step() { local name=$1 t=$2; shift 2; echo "=== $(date +%T) $name [$t s]"; local s=$SECONDS
         env $(printf "%s\n" "$@" | grep "=") timeout "$t" $PY benchmarks/schedules.py --repeats 1 --steps 6 $(printf "%s\n" "$@" | grep -v "=") -o "$OUT/$name.json" 2>&1 | grep -v "^|---"
         echo "=== rc=$? in $((SECONDS - s)) s"; }
{
nproc
step A_sleep_block 60 PIPEPLAN_P2P_SPIN_MS=0 --no-torch
step B_sleep_poll 60 PIPEPLAN_P2P_SPIN_MS=5 --no-torch
step C_busy_poll 90 PIPEPLAN_P2P_SPIN_MS=5 PIPEPLAN_SLEEP_SPIN_MS=100000
step D_busy_block 60 PIPEPLAN_P2P_SPIN_MS=0 PIPEPLAN_SLEEP_SPIN_MS=100000 --no-torch
} 2>&1 | tee "$OUT/spin_check.log"
