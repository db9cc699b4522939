#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, starts the
# daemons, builds the sandbox image, checks lint and formatting (ruff, pinned in
# pyproject.toml), then runs pytest in two phases: every test not marked `alone` on two
# pytest-xdist workers (one module per worker at a time: much of the suite waits on the
# processes it starts), then the `alone` ones (tests/conftest.py) in one process, so that
# the claims that hang on process timing run with nothing beside them. Extra arguments go
# to both phases; FARM_TEST_WORKERS=0 runs the first phase in one process too.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
VENV="${FARM_VENV:-$ROOT/.venv}"
cd "$ROOT"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The sandbox image builds offline (debootstrap from the machine's apt mirror), once:
# it is tagged by content and reused while the agent and recipe are unchanged.
"$VENV/bin/python" -m sandbox.image build --quiet
# pytest exits 5 when a phase selects no test (a narrow run of one package): not a failure
phase() {
  local rc=0
  "$VENV/bin/python" -m pytest "$@" || rc=$?
  [ "$rc" -eq 5 ] && rc=0
  return "$rc"
}
rc=0
# Beside another pytest worker every torch process (the tests', and the learners, policy
# servers and benches they start) gets one intra-op thread: two OpenMP threads per process on
# two busy cores spin against each other (the SmolLM2 learning test took 809 s so, ~130 s
# alone). The `alone` phase keeps torch's default.
OMP_NUM_THREADS=1 FARM_INFERENCE_TORCH_THREADS=1 \
  phase -m "not alone" -n "${FARM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || rc=$?
phase -m alone "$@" || rc=$?
exit "$rc"
