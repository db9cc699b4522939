#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, starts the
# daemons, builds the sandbox image, checks lint and formatting (ruff, pinned in
# pyproject.toml), then runs pytest on two workers (pytest-xdist, one test module per worker
# at a time: the suite spends much of its time waiting on processes it started). Extra
# arguments go to pytest; `-n 0` runs in one process.
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
exec "$VENV/bin/python" -m pytest -n "${FARM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
