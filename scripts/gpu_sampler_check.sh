#!/usr/bin/env bash
# vLLM 0.33's GPU sampler against the learner's kept set, on CUDA with bf16 logits
# (scripts/gpu_sampler_check.py): vLLM's real apply_top_k_top_p and its Triton top-k/top-p,
# temperature and min-p kernels, for top-k, top-p, min-p, their mixes and low temperatures, at
# 24 rows (split top-p pipeline) and 128 rows (monolithic kernel). Prints one table row per
# setting and batch; exits 1 if a kept set differs in a way docs/learner.md does not list.
#
#   scripts/gpu_sampler_check.sh --build      here: builds .gpu-sampler/ (vLLM's sampling files
#                                             from the contract environment, ~0.3 MB, ignored)
#   scripts/gpu_sampler_check.sh              on a GPU machine with torch, Triton and NumPy (no
#                                             vLLM needed); carry .gpu-sampler
#   scripts/gpu_sampler_check.sh --interpret  without a GPU: Triton's interpreter, small sizes
# Other arguments go to gpu_sampler_check.py (--only SETTING). GPU_SAMPLER_BUNDLE overrides
# the bundle's folder.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="${GPU_SAMPLER_BUNDLE:-$ROOT/.gpu-sampler}"
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
cd "$ROOT"
if [ "${1:-}" = "--build" ]; then
  PYTHONPATH="$ROOT" "$PY" -m tests.inference.vllm_contract.gpu_bundle "$BUNDLE"
  du -sh "$BUNDLE"
  exit 0
fi
if [ ! -f "$BUNDLE/vllm/v1/sample/ops/topk_topp_triton.py" ]; then
  echo "no vLLM bundle in $BUNDLE: run $0 --build where the contract environment is" >&2
  exit 2
fi
export PYTHONPATH="$BUNDLE:$ROOT"
if [[ " $* " == *" --interpret "* ]]; then
  # the contract environment's Triton (tests/inference/vllm_contract/env.py)
  TRITON_DIR="$("$PY" -c \
    'from tests.inference.vllm_contract.env import ensure_triton_env; print(ensure_triton_env())')"
  export TRITON_INTERPRET=1 PYTHONPATH="$BUNDLE:$TRITON_DIR:$ROOT"
fi
"$PY" -c 'import numpy, torch, triton' || { echo "needs torch, triton and numpy" >&2; exit 2; }
exec "$PY" -W ignore scripts/gpu_sampler_check.py "$@"
