#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, starts the
# daemons, builds the sandbox image, then runs pytest. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
VENV="${FARM_VENV:-$ROOT/.venv}"
cd "$ROOT"
if [ -f "$ROOT/sandbox/image.py" ]; then
  "$VENV/bin/python" -m sandbox.image build --quiet || echo "[test] sandbox image build failed" >&2
fi
exec "$VENV/bin/python" -m pytest "$@"
