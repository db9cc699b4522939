#!/usr/bin/env bash
# The CUDA paths, checked on a GPU node that has the project's packages (no vLLM needed):
#   1. the in-process learning claims (tests/learner/test_learning.py and the LoRA toy) with
#      the learner training on the GPU (bf16 autocast, fused AdamW);
#   2. `farm demo` with its learner on the GPU (device auto): the weights it trains on CUDA
#      are pushed to the CPU policy server the workers sample from.
# Usage: [DEMO_STEPS=100] scripts/gpu_check.sh [OUTPUT_DIR]   (default gpu-check/; redis-server
# on PATH)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(realpath -m "${1:-gpu-check}")"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
cd "$ROOT"
"$PY" -c 'import torch, transformers
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee "$OUT_DIR/device.txt" || exit 1
FARM_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
  tests/learner/test_learning.py tests/learner/test_lora.py::test_a_lora_run_learns_the_toy \
  2>&1 | tee "$OUT_DIR/learning.log"
learning=${PIPESTATUS[0]}
"$PY" -m farm demo --work-dir "$OUT_DIR/demo" --max-steps "${DEMO_STEPS:-100}" 2>&1 | tee "$OUT_DIR/demo.log"
demo=${PIPESTATUS[0]}
grep -h "training on" "$OUT_DIR"/demo/logs/learner*.log | head -1
echo "learning tests: exit $learning; demo: exit $demo"
[ "$learning" -eq 0 ] && [ "$demo" -eq 0 ]
