"""Run `farm up` for a few steps and check that every server's weight version follows the learner.

    python scripts/served_follows.py OUT_DIR FARM-UP-ARGS...   (FARM-UP-ARGS must hold --max-steps)

Used by scripts/gpu_check.sh. It starts ``python -m farm up --work-dir OUT_DIR/farm
--status-interval-s 1 FARM-UP-ARGS``, learns from the farm's own "process NAME: COMMAND"
lines where the learner's /metrics and each inference server (vLLM or the CPU policy server)
listen, and while the farm runs, twice a second, reads the learner's policy version
(``farm_learner_policy_version``) and each server's ``GET /weight_info``. The verdict: the
farm exited 0 (the learner reached --max-steps), the learner published versions, and every
server served at least two versions and ended within one version of the learner's last.
Writes OUT_DIR/served.json (the samples and the verdict) and exits 0 when it holds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PROCESS = re.compile(r"^farm\s+\| process (\S+): .*?--(metrics-port|port) (\d+)")


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def _learner_version(url: str) -> int | None:
    text = _get(url) or ""
    found = re.search(r"^farm_learner_policy_version (\S+)$", text, re.MULTILINE)
    return int(float(found[1])) if found else None


def _served(url: str) -> int | None:
    body = _get(url + "/weight_info")
    try:
        return int(json.loads(body)["weight_version"]) if body else None
    except (ValueError, KeyError, TypeError):
        return None


def main(out: Path, farm_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "farm", "up", "--work-dir", str(out / "farm")]
    argv += ["--status-interval-s", "1", "--metrics-port", "0", *farm_args]
    farm = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ports: dict[str, int] = {}
    log = (out / "farm.log").open("w")

    def read() -> None:
        assert farm.stdout is not None
        for line in farm.stdout:
            log.write(line)
            log.flush()
            if m := PROCESS.match(line):
                ports[m[1]] = int(m[3])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples: list[dict[str, object]] = []
    while farm.poll() is None:
        servers = {n: p for n, p in ports.items() if n.startswith(("vllm-", "inference"))}
        if "learner" in ports and servers:
            learner = _learner_version(f"http://127.0.0.1:{ports['learner']}/metrics")
            served = {n: _served(f"http://127.0.0.1:{p}") for n, p in servers.items()}
            samples.append({"t": time.time(), "learner": learner, "served": served})
        time.sleep(0.5)
    reader.join(10)
    return _verdict(out, farm.returncode, samples)


def _verdict(out: Path, rc: int, samples: list[dict[str, object]]) -> int:
    learner = [s["learner"] for s in samples if s["learner"] is not None]
    last = max(learner, default=0)
    names = sorted({n for s in samples for n in s["served"]})
    seen = {n: [s["served"][n] for s in samples if s["served"].get(n) is not None] for n in names}
    problems = [] if rc == 0 else [f"farm up exited {rc}"]
    if last < 1:
        problems.append("the learner published no version")
    for name, versions in seen.items():
        if len(set(versions)) < 2:
            problems.append(f"{name} served only {sorted(set(versions))}")
        elif max(versions) < last - 1:
            problems.append(f"{name} reached version {max(versions)}, the learner {last}")
    verdict = {
        "ok": not problems and bool(seen),
        "problems": problems or ([] if seen else ["no server was ever read"]),
        "learner_last_version": last,
        "served_versions": {n: sorted(set(v)) for n, v in seen.items()},
        "samples": samples,
    }
    (out / "served.json").write_text(json.dumps(verdict, indent=1))
    print(json.dumps({k: v for k, v in verdict.items() if k != "samples"}))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) < 3 or "--max-steps" not in sys.argv:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(Path(sys.argv[1]), sys.argv[2:]))
