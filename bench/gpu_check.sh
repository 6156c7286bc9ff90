#!/usr/bin/env bash
# One-shot GPU checks, in priority order, each under its own time limit; results land in $OUT.
#
#   OUT=bench/results/gpu bash bench/gpu_check.sh
#
# 1. tests/test_gpu.py (ghost engine under bf16 autocast, a bf16 train.py run);
# 2. python -m bench.ghost --device cuda (engine vs naive vs floor, N = 16, 32, 64);
# 3. a paired gpu-small comparison (Muon, ratio 0.5, STEPS steps per run), seed by seed so a
#    cut-off run still leaves a paired result for the seeds that finished.
# Wheels under .whl/ (packages the machine lacks) are installed to /tmp/site first.
set -u
OUT=${OUT:-bench/results/gpu}
STEPS=${STEPS:-500}
METHODS=${METHODS:-random,oracle,opus}
SCALE=${SCALE:-gpu-small}
DATA=${DATA:-data/default}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; } > "$OUT/machine.txt"

timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/machine.txt"

# one timing round (a dedicated GPU is quiet) and one pass over all rows (chunking multiplies kernel
# launches, which dominate there; the flat-memory check is the CPU run's)
timeout "${GHOST_LIMIT:-150}" python3 -m bench.ghost --device cuda --repeats 5 --rounds 1 --engine-chunk 0 \
  --out "$OUT/ghost-cuda.json" > "$OUT/ghost.log" 2>&1
echo "bench.ghost rc=$?" >> "$OUT/machine.txt"

tokens=$(python3 -c "import yaml; d=yaml.safe_load(open('configs/scale/$SCALE.yaml'))['data']; print(d['batch_size']*d['seq_len']*$STEPS)")
deadline=$(( $(date +%s) + ${COMPARE_LIMIT:-300} ))
for seeds in 0, 0,1 0,1,2; do
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 20 ] || break
  timeout "$left" python3 -m bench.compare --pool "$DATA/pool.jsonl" --target "$DATA/target.jsonl" --val "$DATA/val.jsonl" \
    --methods "$METHODS" --seeds "$seeds" --tokens "$tokens" --evals 5 --optimizer muon --scale "$SCALE" \
    --out /tmp/gpu-compare >> "$OUT/compare.log" 2>&1 || break
  cp /tmp/gpu-compare/results.json "$OUT/compare-results.json"
  cp /tmp/gpu-compare/report.md "$OUT/compare-report.md"
done
echo "compare done: $(ls /tmp/gpu-compare/runs/*/*/ 2>/dev/null | tr '\n' ' ')" >> "$OUT/machine.txt"
