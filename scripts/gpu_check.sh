#!/usr/bin/env bash
# The CUDA paths, checked on a GPU node that already has torch:
#   0. the environment (scripts/gpu_env.sh): locks/gpu.txt installed into OUT_DIR/venv over the
#      machine's packages, keeping the machine's torch, CUDA libraries and vLLM (farm.lock
#      STACK) and installing the rest at the lock's versions; the summary says what was kept
#      at another version than the lock's and what still differs (OUT_DIR/lock-*.txt). Where
#      nothing can be installed (no package index, FARM_GPU_LOCK=0) the machine's packages run.
#   1. vLLM (when `vllm` is on PATH and importable): `farm up --inference vllm` on MODEL for
#      VLLM_STEPS steps, one server on GPU 0 and the learner on GPU 1, weights pushed over NCCL;
#      scripts/served_follows.py checks that the server's /weight_info follows the learner's
#      policy version. Without vLLM it says so and goes on.
#   2. With two or more GPUs: `farm up --learner-gpus 0,1` (the CPU policy server, the learner
#      as two torchrun ranks, FSDP2 on NCCL) for a few steps, the same served-version check.
#   3. The in-process learning claims (tests/learner/test_learning.py and the LoRA toy) with
#      the learner on the GPU (bf16 autocast, fused AdamW).
#   4. `farm demo` with its learner on the GPU (device auto), pushing to the CPU policy server.
# Usage: [MODEL=DIR] [VLLM_STEPS=5] [DEMO_STEPS=100] scripts/gpu_check.sh [OUTPUT_DIR]
#   (default gpu-check/; redis-server on PATH; MODEL defaults to the tiny model, built here).
# Writes OUTPUT_DIR/summary.txt: one line per part, and exits non-zero if a part that ran failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(realpath -m "${1:-gpu-check}")"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
cd "$ROOT"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
failed=0

# 0. the environment: the lock over the machine's torch stack
PY="$(PYTHON="$PY" scripts/gpu_env.sh "$OUT_DIR")"
note "$(cat "$OUT_DIR/lock.txt")"

"$PY" -c 'import torch, transformers
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(), "torch", torch.__version__,
      "transformers", transformers.__version__)' | tee "$OUT_DIR/device.txt" || exit 1
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
MODEL="${MODEL:-$OUT_DIR/model}"
[ -f "$MODEL/config.json" ] || "$PY" -m inference.tiny "$MODEL" > /dev/null || exit 1
# a few steps on whatever model: small groups, short answers
SMALL=(--model "$MODEL" --workers 1 --quiet --learner-arg=--group-size=4
       --learner-arg=--groups-per-batch=4 --worker-arg=--max-tokens=8)

# 1. vLLM servers and the learner, one command
if command -v vllm > /dev/null && "$PY" -c 'import vllm' 2> /dev/null; then
  if [ "$GPUS" -ge 2 ]; then
    "$PY" scripts/served_follows.py "$OUT_DIR/vllm" "${SMALL[@]}" --max-steps "${VLLM_STEPS:-5}" \
      --inference vllm --inference-gpus 0 --learner-gpus 1 \
      --vllm-arg=--gpu-memory-utilization=0.5 2>&1 | tail -5
    rc=${PIPESTATUS[0]}
    note "vllm: farm up --inference vllm --inference-gpus 0 --learner-gpus 1: exit $rc" \
      "($OUT_DIR/vllm/served.json, logs in $OUT_DIR/vllm/farm/logs)"
    [ "$rc" -eq 0 ] || failed=1
  else
    note "vllm: installed, but one GPU: the servers and the learner need one each; skipped"
  fi
else
  note "vllm: not installed here (no \`vllm\` command, or \`import vllm\` fails): the vLLM" \
    "servers were not checked; running the rest"
fi

# 2. the learner as two torchrun ranks, FSDP2 on NCCL
if [ "$GPUS" -ge 2 ]; then
  "$PY" scripts/served_follows.py "$OUT_DIR/fsdp" "${SMALL[@]}" --max-steps 5 \
    --learner-gpus 0,1 2>&1 | tail -5
  rc=${PIPESTATUS[0]}
  grep -h "training on" "$OUT_DIR"/fsdp/farm/logs/learner.log | head -2
  note "fsdp: farm up --learner-gpus 0,1 (two NCCL ranks): exit $rc ($OUT_DIR/fsdp/served.json)"
  [ "$rc" -eq 0 ] || failed=1
else
  note "fsdp: one GPU: the two-rank NCCL learner was not checked"
fi

# 3. the learning claims on the GPU
FARM_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
  tests/learner/test_learning.py tests/learner/test_lora.py::test_a_lora_run_learns_the_toy \
  2>&1 | tee "$OUT_DIR/learning.log"
rc=${PIPESTATUS[0]}
note "learning tests on cuda: exit $rc ($OUT_DIR/learning.log)"
[ "$rc" -eq 0 ] || failed=1

# 4. farm demo with its learner on the GPU
"$PY" -m farm demo --work-dir "$OUT_DIR/demo" --max-steps "${DEMO_STEPS:-100}" 2>&1 \
  | tee "$OUT_DIR/demo.log"
rc=${PIPESTATUS[0]}
grep -h "training on" "$OUT_DIR"/demo/logs/learner*.log | head -1
note "demo: exit $rc ($OUT_DIR/demo/summary.txt)"
[ "$rc" -eq 0 ] || failed=1

echo "--- $SUMMARY"
cat "$SUMMARY"
exit "$failed"
