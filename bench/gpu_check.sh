#!/usr/bin/env bash
# One-shot GPU checks for issue 25, in priority order, each under its own time limit (about 7 minutes in all with
# the defaults); results land in $OUT.
#
#   OUT=bench/results/gpu bash bench/gpu_check.sh
#
# 1. python -m bench.studies.ghost --device cuda at T = 64 (engine vs naive vs floor, N = 16, 32, 64; one process per
#    variant, kernel counts and GPU kernel time per call);
# 2. bench.harness.steptime at gpu-gpt2 (bf16-mixed, AdamW): random, RHO-LOSS on a precomputed reference table
#    (rho_lookup, its reference pretrained for 50 steps; the table's one-off cost is not step time) and OPUS,
#    one interleaved repeat of $STEPS steps (default 30);
# 3. tests/test_gpu.py but its stack group (the ghost engine under bf16 autocast, a bf16 train.py run).
# Off unless given a limit in seconds: STACK_LIMIT (tests/test_gpu.py's stack group, -m stack, about 4 minutes:
# OPUS and RHO-LOSS under a compiled learner against eager, every online method under bf16-mixed against fp32 and
# through train.py, FSDP2 on a one-GPU mesh against one device, OPUS at the GPT-2-small shape compiled in bf16;
# $OUT/gpu_stack_tests.log, with the passed tests' output: the GPT-2-shape step time, the FSDP2 score gaps),
# GHOST32_LIMIT (bench.studies.ghost at T = 64 in passes of 32 candidates),
# GHOST16_LIMIT (at T = 16, the shipped OPUS window), SMALL_LIMIT (bench.harness.steptime on gpu-small under Muon,
# random against OPUS), RACE_LIMIT (bench.harness.race at gpu-small under AdamW: the methods of RACE_METHODS, default
# random,rho@score_len=16, each at an equal wall-clock budget of RACE_BUDGET seconds, default 180, its max_steps from
# a 20-step probe of its step time; about 2·RACE_BUDGET + 90 s; race.md and race.json in $OUT/race-gpu-small);
# with them the total can pass the device's 10-minute call limit.
# Exits non-zero when the GPU tests (the stack group too, when run) fail; the benchmarks' return codes are in
# $OUT/machine.txt.
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
  timeout -k 10 "$2" python3 -m bench.studies.ghost --device cuda --score-len "$1" --repeats 5 --rounds 1 --engine-chunk "$3" \
    --out "$OUT/ghost-cuda-len$1-chunk$3.json" > "$OUT/ghost-len$1-chunk$3.log" 2>&1
  echo "bench.studies.ghost T=$1 chunk=$3 rc=$? (limit $2 s)" >> "$OUT/machine.txt"
}

steptime() {  # $1: scale, $2: optimizer, $3: methods, $4: time limit, $5: folder name under $OUT
  rm -rf "/tmp/steptime-$5"  # a warm machine keeps an earlier call's files
  timeout -k 10 "$4" python3 -m bench.harness.steptime --pool "$DATA/pool.jsonl" --target "$DATA/target.jsonl" --val "$DATA/val.jsonl" \
    --methods "$3" --steps "${STEPS:-30}" --evals 2 --repeats 1 --optimizer "$2" --scale "$1" --out "/tmp/steptime-$5" \
    > "$OUT/steptime-$5.log" 2>&1
  echo "bench.harness.steptime $5 rc=$? (limit $4 s)" >> "$OUT/machine.txt"
  mkdir -p "$OUT/steptime-$5" && cp "/tmp/steptime-$5/steptime.md" "/tmp/steptime-$5/steptime.json" "$OUT/steptime-$5/" 2>/dev/null
}

ghost 64 "${GHOST_LIMIT:-120}" 0
steptime gpu-gpt2 adamw "random,rho_lookup@reference_steps=50,opus" "${GPT2_LIMIT:-240}" gpu-gpt2-adamw
timeout -k 10 "${TEST_LIMIT:-70}" python3 -m pytest -q -p no:cacheprovider -m "not stack" tests/test_gpu.py \
  > "$OUT/gpu_tests.log" 2>&1
tests=$?
echo "gpu tests rc=$tests (limit ${TEST_LIMIT:-70} s)" >> "$OUT/machine.txt"
if [ "${STACK_LIMIT:-0}" -gt 0 ]; then
  timeout -k 10 "$STACK_LIMIT" python3 -m pytest -q -rP -p no:cacheprovider -m stack tests/test_gpu.py \
    > "$OUT/gpu_stack_tests.log" 2>&1
  stack=$?
  echo "gpu stack tests rc=$stack (limit $STACK_LIMIT s)" >> "$OUT/machine.txt"
  if [ "$tests" -eq 0 ]; then tests=$stack; fi
fi
if [ "${GHOST32_LIMIT:-0}" -gt 0 ]; then ghost 64 "$GHOST32_LIMIT" 32; fi
if [ "${GHOST16_LIMIT:-0}" -gt 0 ]; then ghost 16 "$GHOST16_LIMIT" 0; fi
if [ "${SMALL_LIMIT:-0}" -gt 0 ]; then steptime gpu-small muon "random,opus" "$SMALL_LIMIT" gpu-small-muon; fi
if [ "${RACE_LIMIT:-0}" -gt 0 ]; then
  rm -rf /tmp/race-gpu-small
  timeout -k 10 "$RACE_LIMIT" python3 -m bench.harness.race --pool "$DATA/pool.jsonl" --target "$DATA/target.jsonl" \
    --val "$DATA/val.jsonl" --methods "${RACE_METHODS:-random,rho@score_len=16}" --budget "${RACE_BUDGET:-180}" \
    --scale gpu-small --out /tmp/race-gpu-small > "$OUT/race-gpu-small.log" 2>&1
  echo "bench.harness.race gpu-small rc=$? (limit $RACE_LIMIT s)" >> "$OUT/machine.txt"
  mkdir -p "$OUT/race-gpu-small" && cp /tmp/race-gpu-small/race.md /tmp/race-gpu-small/race.json "$OUT/race-gpu-small/" 2>/dev/null
fi
exit "$tests"
