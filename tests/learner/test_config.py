"""Config: precedence CLI > FARM_* env > TOML, and clear errors for bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from learner.cli import load_config
from learner.config import LearnerConfig
from learner.errors import ConfigError


def test_precedence_cli_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "learner.toml"
    toml.write_text('model = "/m"\ngamma = 0.5\nrun = "from-toml"\ngroups_per_batch = 3\n')
    monkeypatch.setenv("FARM_GAMMA", "0.7")
    monkeypatch.setenv("FARM_RUN", "from-env")
    monkeypatch.setenv("FARM_INFERENCE_URLS", "http://a:1,http://b:2")
    cfg = load_config(["--config", str(toml), "--run", "from-cli"])
    assert (cfg.run, cfg.batch.gamma, cfg.groups_per_batch) == ("from-cli", 0.7, 3)
    assert cfg.inference_urls == ["http://a:1", "http://b:2"]
    assert cfg.admission_limit == (1 + 1) * 3


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({"gamma": 1.5}, "gamma: Input should be less than or equal to 1"),
        ({"groups_per_batch": 0}, "groups_per_batch: Input should be greater than or equal to 1"),
        (
            {"algorithm": "ppo2"},
            "algorithm: Input should be 'grpo', 'rebn', 'rloo', 'reinforce', 'reinforce++',",
        ),
        ({"overlong": "soft", "overlong_max_tokens": 8}, "overlong soft needs 0 < overlong_buffer"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1 (or 0: off), got 1.0"),
        ({"kl_estimator": "k4"}, "kl_estimator: Input should be 'k1', 'k2', 'k3', 'k1+' or"),
        ({"stale_policy": "ignore"}, "stale_policy"),
        ({"redis_url": "http://x"}, "redis_url"),
        ({"resume": True}, "resume needs checkpoint_dir"),
        ({"horizon_start": 5, "horizon_max": 2}, "horizon_start must not exceed horizon_max"),
    ],
)
def test_bad_values_are_named(values: dict[str, object], complaint: str) -> None:
    with pytest.raises(ConfigError) as info:
        LearnerConfig.load({"model": "/m", **values})
    assert complaint in str(info.value)


def test_unknown_toml_key_is_rejected(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('model = "/m"\nlearning_rat = 0.1\n')
    with pytest.raises(ConfigError, match="learning_rat: Extra inputs are not permitted"):
        load_config(["--config", str(toml)])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--config", str(tmp_path / "missing.toml")])


def test_cli_reports_bad_config_and_help_skips_torch() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "learner", "--model", "/m", "--clip-low", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "clip_low: Input should be less than 1" in bad.stderr
    code = "import sys, learner.cli as c\ntry:\n  c.load_config(['--help'])\nexcept SystemExit:\n  pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr


def test_every_algorithm_is_documented() -> None:
    """docs/learner.md's `algorithm` row names every --algorithm choice (issue 42)."""
    from learner.config import Algorithm

    docs = Path(__file__).parents[2] / "docs" / "learner.md"
    row = next(x for x in docs.read_text().splitlines() if x.startswith("| `algorithm` |"))
    missing = [a.value for a in Algorithm if f"`{a.value}`" not in row]
    assert not missing, f"--algorithm choices missing from docs/learner.md: {missing}"
