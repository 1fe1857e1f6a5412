#!/usr/bin/env bash
# The checks only a machine with a GPU (and 16 cores) can show, in one run (issues 13, 15):
# the CUDA tests (tests/runtime/test_gpu.py), the NCCL tests (skipped with fewer than two GPUs),
# a one-rank CUDA run's peak memory against the plan's (gpu_memory.py), and the CPU pipeline
# benchmarks with a core per rank (schedules.py, prediction.py --only sleep). Writes its log and
# JSON under $OUT (default benchmarks/results/gpu). Each step has a time limit of its own so one
# slow step cannot eat the others' time.
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
# On the lent device machine (no pipeplan dependencies, no network) the dependencies travel as
# wheels in .whl/ (see the device tool's README) and are installed first, into its python3:
#   python3 -m pip install -q --no-index --no-deps .whl/*.whl; bash benchmarks/gpu_check.sh
# Runs on an H100: 2026-11-27 (an earlier set of steps, 416 s; results in benchmarks/results/h100/)
# and 2026-11-27 again (results/h100b/); figures in benchmarks/README.md.
set -u
OUT=${OUT:-benchmarks/results/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
step() { local t=$1; shift; echo "=== $(date +%T) [$t s] $*"; local s=$SECONDS
         timeout "$t" "$@"; echo "=== rc=$? in $((SECONDS - s)) s"; }
{
nvidia-smi -L; nproc; $PY -c 'import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0))'
step 100 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_gpu.py -s -rA
# several GPUs (skipped with fewer): NCCL point-to-point, replicas' all-reduce, clipping, save/resume
step 240 $PY -m pytest -q -p no:cacheprovider -s -rA \
  tests/runtime/test_nccl_protocol.py::test_nccl_two_stages_equals_single_device \
  tests/runtime/test_nccl_protocol.py::test_nccl_replicas_clipping_and_resume_equal_single_device
step 120 $PY benchmarks/gpu_memory.py -o "$OUT/gpu_memory.json"
step 130 $PY benchmarks/schedules.py --repeats 1 --steps 6 -o "$OUT/schedules_16core.json"
step 100 $PY benchmarks/prediction.py --steps 6 --only sleep --out "$OUT/prediction_16core.json"
} 2>&1 | tee "$OUT/gpu_check.log"
