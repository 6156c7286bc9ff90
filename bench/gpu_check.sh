#!/usr/bin/env bash
# One-shot GPU checks, in priority order, each under its own time limit; results land in $OUT.
#
#   OUT=bench/results/gpu bash bench/gpu_check.sh
#
# 1. python -m bench.ghost --device cuda at T = 64 (engine vs naive vs floor, N = 16, 32, 64; one
#    process per variant, kernel counts and GPU kernel time per call), the engine in one pass and
#    in passes of 32 candidates;
# 2. tests/test_gpu.py (ghost engine under bf16 autocast, a bf16 train.py run);
# 3. bench.steptime on gpu-small, Muon: random vs OPUS step time in one interleaved run
#    (STEPTIME_LIMIT=0 skips it);
# 4. bench.ghost at T = 16 (the window the shipped OPUS configs score).
# Wheels under .whl/ (packages the machine lacks) are installed to /tmp/site first.
set -u
OUT=${OUT:-bench/results/gpu}
DATA=${DATA:-data/default}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; } > "$OUT/machine.txt"

ghost() {  # $1: score_len, $2: time limit, $3: engine candidates per pass (0: one pass)
  timeout "$2" python3 -m bench.ghost --device cuda --score-len "$1" --repeats 5 --rounds 1 --engine-chunk "$3" \
    --out "$OUT/ghost-cuda-len$1-chunk$3.json" > "$OUT/ghost-len$1-chunk$3.log" 2>&1
  echo "bench.ghost T=$1 chunk=$3 rc=$?" >> "$OUT/machine.txt"
}

ghost 64 "${GHOST_LIMIT:-170}" 0
ghost 64 "${GHOST_LIMIT:-170}" 32
timeout "${TEST_LIMIT:-100}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/machine.txt"
[ "${STEPTIME_LIMIT:-150}" -gt 0 ] && timeout "${STEPTIME_LIMIT:-150}" python3 -m bench.steptime --pool "$DATA/pool.jsonl" --target "$DATA/target.jsonl" \
  --val "$DATA/val.jsonl" --methods random,opus --steps "${STEPS:-100}" --evals 2 --repeats 1 --optimizer muon \
  --scale gpu-small --out /tmp/steptime > "$OUT/steptime.log" 2>&1
echo "steptime rc=$? (limit ${STEPTIME_LIMIT:-150})" >> "$OUT/machine.txt"
cp /tmp/steptime/steptime.md /tmp/steptime/steptime.json "$OUT/" 2>/dev/null
ghost 16 "${GHOST16_LIMIT:-110}" 0
