#!/usr/bin/env bash
# The deliberate upgrade of the dependency locks, locks/cpu.txt and locks/gpu.txt (farm/lock.py):
#   1. re-resolves both with uv (UV_VERSION below, in a tool environment of its own) against
#      PyPI, universal (every platform and python >= 3.11, markers where they differ), with
#      hashes; the CPU torch comes from FARM_TORCH_FIND_LINKS (default /opt/wheels; elsewhere
#      https://download.pytorch.org/whl/cpu/torch/);
#   2. prints what changed (`python -m farm.lock diff`); when nothing did, stops there;
#   3. installs the new CPU lock into a fresh virtual environment (scripts/bootstrap.sh with
#      FARM_VENV), checks it equals the lock, runs the vLLM contract suite on it, then the whole
#      test suite (scripts/test.sh, about 25 minutes on two cores);
#   4. when everything passed, commits pyproject.toml and locks/ with the changes and the test
#      results in the message. A failure leaves the new locks in the work tree and exits 1.
# Usage: scripts/upgrade-deps.sh [--package NAME]... [--keep] [--no-test]
#   (no option)     every package to the newest release pyproject.toml and locks/*.in allow
#   --package NAME  only NAME moves (repeatable); every other package keeps its pin
#   --keep          nothing moves that need not: after an edit of pyproject.toml or locks/*.in
#   --no-test       resolve and print the changes; no tests, no commit
# The GPU lock is resolved but not installed here (it needs CUDA); scripts/gpu_check.sh on a GPU
# node reports how far that node is from it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
UV_VERSION=0.13.9
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/rollout-farm"
TOOLS="$CACHE/uv-$UV_VERSION"
FIND_LINKS="${FARM_TORCH_FIND_LINKS:-/opt/wheels}"  # where the CPU torch is (as scripts/bootstrap.sh)
[ -n "${FARM_TORCH_FIND_LINKS:-}" ] || [ -d "$FIND_LINKS" ] \
  || FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
# The extras each lock covers (farm/lock.py, LOCK_EXTRAS: tests/farm/test_lock.py holds them equal);
# dev in both: a GPU node runs tests too (scripts/gpu_check.sh).
CPU_EXTRAS=(train sandbox tracking data agent dev)
GPU_EXTRAS=(train sandbox tracking data agent dev gpu)

log() { printf '[upgrade-deps] %s\n' "$*" >&2; }

upgrade=(--upgrade)
run_tests=1
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --package) [ $# -ge 2 ] || { log "--package needs a name"; exit 2; }
      [ "${upgrade[0]:-}" = --upgrade ] && upgrade=()
      upgrade+=(--upgrade-package "$2"); shift 2 ;;
    --keep) upgrade=(); shift ;;
    --no-test) run_tests=0; shift ;;
    *) log "unknown option $1 (see the top of $0)"; exit 2 ;;
  esac
done

# uv, and packaging for `farm.lock diff`, pinned, in an environment of their own
if [ ! -x "$TOOLS/bin/uv" ]; then
  log "installing uv $UV_VERSION into $TOOLS"
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q "uv==$UV_VERSION" "packaging==26.4"
fi

cd "$ROOT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/upgrade-deps.XXXXXX")"
for lock in cpu gpu; do
  if [ -f "locks/$lock.txt" ]; then cp "locks/$lock.txt" "$WORK/$lock.old"; fi
done

resolve() {  # LOCK EXTRA... -- MORE UV ARGUMENTS
  local lock=$1 extras=()
  shift
  while [ "$1" != -- ]; do extras+=(--extra "$1"); shift; done
  shift
  log "resolving locks/$lock.txt"
  "$TOOLS/bin/uv" pip compile --quiet --universal --python-version 3.11 --generate-hashes \
    --custom-compile-command scripts/upgrade-deps.sh --overrides locks/overrides.txt \
    ${upgrade[@]+"${upgrade[@]}"} "$@" -o "locks/$lock.txt" \
    pyproject.toml "${extras[@]}" "locks/$lock.in"
}
resolve cpu "${CPU_EXTRAS[@]}" -- --find-links "$FIND_LINKS"
resolve gpu "${GPU_EXTRAS[@]}" --

: > "$WORK/changes"
for lock in cpu gpu; do
  if [ -f "$WORK/$lock.old" ]; then
    PYTHONPATH="$ROOT" "$TOOLS/bin/python" -m farm.lock diff "$WORK/$lock.old" \
      "locks/$lock.txt" > "$WORK/$lock.changes"
  else
    echo "(new)" > "$WORK/$lock.changes"
  fi
  if [ -s "$WORK/$lock.changes" ]; then
    { echo "locks/$lock.txt:"; sed 's/^/  /' "$WORK/$lock.changes"; } >> "$WORK/changes"
  fi
done
if [ ! -s "$WORK/changes" ] && git diff --quiet -- pyproject.toml locks; then
  log "no version changed; nothing to commit"
  rm -rf "$WORK"
  exit 0
fi
cat "$WORK/changes" >&2
[ "$run_tests" -eq 1 ] || { log "--no-test: the new locks are in locks/, untested"; exit 0; }

# the new CPU lock in a fresh environment, then the contract suite and the whole suite on it
VENV="$WORK/venv"
FARM_VENV="$VENV" scripts/bootstrap.sh
"$VENV/bin/python" -m farm.lock check
log "the vLLM contract suite"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/inference/vllm_contract \
  tests/farm/test_vllm_serve.py 2>&1 | tee "$WORK/contract.log"
log "the whole test suite (scripts/test.sh)"
FARM_VENV="$VENV" scripts/test.sh 2>&1 | tee "$WORK/suite.log"

# pytest's closing line of each run ("941 passed, 2 skipped in 1247.20s", with or without -q)
summary() {
  grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s' "$1" \
    | tr -d '=' | sed 's/^ *//;s/ *$//'
}
{
  echo "locks: upgrade-deps $args"
  echo
  echo "scripts/upgrade-deps.sh $args re-resolved locks/cpu.txt and locks/gpu.txt with uv"
  echo "$UV_VERSION on $(date -u +%Y-%m-%d). On the new CPU lock, installed fresh:"
  echo "- the vLLM contract suite: $(summary "$WORK/contract.log" | paste -sd ';')"
  echo "- the whole suite (scripts/test.sh, two phases): $(summary "$WORK/suite.log" | paste -sd ';')"
  echo
  cat "$WORK/changes"
} > "$WORK/message"
git add pyproject.toml locks
git commit -q -F "$WORK/message" -- pyproject.toml locks
log "committed: $(git log -1 --format=%s)"
rm -rf "$WORK"
