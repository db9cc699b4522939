#!/usr/bin/env bash
# The local demo on embedded defaults: installs what it needs, then `farm demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
VENV="${FARM_VENV:-$ROOT/.venv}"
cd "$ROOT"
exec "$VENV/bin/farm" demo "$@"
