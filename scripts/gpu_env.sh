#!/usr/bin/env bash
# The Python environment scripts/gpu_check.sh runs in, from locks/gpu.txt, on a GPU machine that
# already has torch. It keeps the machine's torch, CUDA libraries and vLLM (farm/lock.py, STACK:
# held at whatever versions the machine has, a torch built for its driver) and installs
# everything else the project needs (pyproject.toml's base and the extras train, sandbox,
# tracking, data, dev) at the lock's versions into OUT_DIR/venv, a virtual environment that
# sees the machine's packages behind its own (a .pth file naming the machine python's paths:
# --system-site-packages would miss them where that python is itself a venv or conda's), so
# the machine's own environment is not touched (pip uninstalls nothing outside the venv).
# Writes into OUT_DIR:
#   lock-before.txt  the machine's packages against the lock (`python -m farm.lock check
#                    --keep-stack`): what is kept at another version, what differs;
#   lock-install.log pip's output; lock-after.txt the same check in the venv;
#   lock.txt         one line for a summary.
# Prints the python to run with on stdout: the venv's, or the machine's where nothing could be
# installed (no package index reachable, a conflict with the kept stack, or FARM_GPU_LOCK=0).
# Usage: [PYTHON=python3] [FARM_GPU_LOCK=0] scripts/gpu_env.sh OUT_DIR
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(realpath -m "${1:?usage: scripts/gpu_env.sh OUT_DIR}")"
PY="${PYTHON:-python3}"
EXTRAS=train,sandbox,tracking,data,dev
mkdir -p "$OUT_DIR"
cd "$ROOT"

check() {  # PYTHON FILE: the lock check's report, its first line and the counts on stderr
  PYTHONPATH="$ROOT" "$1" -m farm.lock check --lock gpu --keep-stack --report > "$2" 2>&1
}
counts() {  # FILE: "N at the lock's versions, K kept, D differ, A not installed"
  local at kept differ absent
  at=$(sed -n '1s/.*, \([0-9]*\) at their locked versions$/\1/p' "$1")
  kept=$(sed -n 's/^kept, the machine.s own (--keep-stack): //p' "$1")
  differ=$(sed -n 's/^differ: //p' "$1")
  absent=$(sed -n 's/^not installed: //p' "$1")
  echo "${at:-?} at the lock's versions, ${kept:-0} of the machine's stack kept at other" \
    "versions, ${differ:-0} differ, ${absent:-0} not installed"
}

check "$PY" "$OUT_DIR/lock-before.txt" || {
  echo "lock: python -m farm.lock failed ($OUT_DIR/lock-before.txt)" | tee "$OUT_DIR/lock.txt" >&2
  echo "$PY"
  exit 0
}
before="the machine's packages: $(counts "$OUT_DIR/lock-before.txt")"
if [ "${FARM_GPU_LOCK:-1}" = 0 ]; then
  echo "lock: FARM_GPU_LOCK=0, nothing installed; $before ($OUT_DIR/lock-before.txt)" \
    | tee "$OUT_DIR/lock.txt" >&2
  echo "$PY"
  exit 0
fi

VENV="$OUT_DIR/venv"
PIN="$OUT_DIR/lock-constraints.txt"
# the lock's pins, with the stack held at the machine's versions (pip then keeps those)
PYTHONPATH="$ROOT" "$PY" -m farm.lock constraints --lock gpu --keep-stack > "$PIN"
: > "$OUT_DIR/lock-install.log"
machine_paths() {  # the machine python's import paths after the venv's own, in a .pth file
  "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p))' > "$OUT_DIR/machine-paths.txt" \
    && "$VENV/bin/python" - "$OUT_DIR/machine-paths.txt" <<'PY'
import site
import sys

own = set(sys.path)
paths = [p for p in open(sys.argv[1]).read().splitlines() if p not in own]
with open(f"{site.getsitepackages()[0]}/machine-packages.pth", "w") as pth:
    pth.write("".join(f"{p}\n" for p in paths))
PY
}
if "$PY" -m venv "$VENV" >> "$OUT_DIR/lock-install.log" 2>&1 && machine_paths \
  && "$VENV/bin/python" -m pip install -c "$PIN" pip setuptools \
    >> "$OUT_DIR/lock-install.log" 2>&1 \
  && "$VENV/bin/python" -m pip install -c "$PIN" --no-build-isolation -e "$ROOT[$EXTRAS]" \
    >> "$OUT_DIR/lock-install.log" 2>&1; then
  check "$VENV/bin/python" "$OUT_DIR/lock-after.txt"
  echo "lock: installed from locks/gpu.txt into $VENV; $before; now" \
    "$(counts "$OUT_DIR/lock-after.txt") (lock-before.txt, lock-after.txt)" \
    | tee "$OUT_DIR/lock.txt" >&2
  echo "$VENV/bin/python"
else
  echo "lock: could not install from locks/gpu.txt (the end of $OUT_DIR/lock-install.log:" \
    "$(tail -1 "$OUT_DIR/lock-install.log")); running on $before (lock-before.txt)" \
    | tee "$OUT_DIR/lock.txt" >&2
  echo "$PY"
fi
