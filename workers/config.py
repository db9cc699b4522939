"""The rollout worker's configuration: one role model nesting its components' configs.

`WorkerConfig` holds what `python -m workers` needs. Its sections are the config models
the components take as they are: `EpisodeSettings` (every episode's sampling and limits)
and `inference.config.ClientConfig` (the generation client, flags ``--inference-*``).
Every field is a flag, a ``FARM_*`` variable and a TOML key by its flat name, resolved
by `launch.settings` (flags > environment > TOML). Importing this module imports neither
torch nor transformers, so ``python -m workers --help`` answers at once. Unknown keys
are rejected.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from broker.consumer import ConsumerSettings
from broker.run import RunFields
from inference.config import ClientConfig
from launch.settings import CommaList, RoleConfig, section
from workers.errors import ConfigError


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class EpisodeSettings:
    """Sampling and limits shared by every episode a worker runs."""

    max_tokens: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="max completion tokens per turn (capped by the context left)",
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, le=1_000_000, description="keep the k most likely tokens (0: off)")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability (0: off)"
    )
    sampling_seeds: bool = Field(
        True,
        description="seed every request from the task (each episode and turn its own seed, "
        "the same on a re-run); off: the server's own randomness",
    )
    max_context_tokens: int = Field(
        4096, ge=16, le=10_000_000, description="prompt+completion tokens an episode may reach"
    )
    episode_timeout_s: float = Field(600.0, gt=0.0, description="wall-clock limit per episode")
    env_step_timeout_s: float | None = Field(
        None,
        gt=0.0,
        description="limit on one env reset/step (default: only the episode limit); beyond it: category timeout",
    )

    @model_validator(mode="after")
    def _step_within_episode(self) -> EpisodeSettings:
        if self.env_step_timeout_s and self.env_step_timeout_s > self.episode_timeout_s:
            raise ValueError("env_step_timeout_s must not exceed episode_timeout_s")
        return self


TOOL_PARSERS = ("auto", "hermes", "qwen3_json", "llama3_json", "llama4_json", "mistral", "pythonic")
REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ChatSettings:
    """How the model's chat template is rendered and its output read.

    See docs/workers.md, "Chat templates"."""

    tool_parser: Literal[TOOL_PARSERS] = Field(  # type: ignore[valid-type]
        "auto",
        description="tool-call parser, named as vLLM's --tool-call-parser (hermes, qwen3_json, "
        "llama3_json, mistral, pythonic); auto: Hermes, CodeGym and bare JSON",
    )
    reasoning_parser: Literal[REASONING_PARSERS] = Field(  # type: ignore[valid-type]
        "none",
        description="split the reasoning off each answer as vLLM's --reasoning-parser of that "
        "name does (qwen3, deepseek_r1); the environment gets the answer only",
    )
    chat_template_kwargs: str = Field(
        "{}",
        description="JSON object of chat template variables for every rendering, e.g. "
        "'{\"enable_thinking\": false}'",
    )
    reasoning_history: Literal["keep", "drop"] = Field(
        "keep",
        description="keep: every earlier turn stays as the model saw it (its reasoning too; "
        "one growing sequence); drop: each prompt is the template's rendering of the "
        "conversation with earlier answers only (a new segment where it rewrites history)",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"chat_template_kwargs is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("chat_template_kwargs must be a JSON object")
        return value

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return dict(json.loads(self.chat_template_kwargs))


class WorkerConfig(RunFields, RoleConfig):
    """Everything `python -m workers` needs; see docs/workers.md for the reference."""

    role: ClassVar[str] = "worker"
    error: ClassVar[type[Exception]] = ConfigError

    # --- where things are ------------------------------------------------------------------
    inference_urls: CommaList = Field(
        default_factory=list, description="inference servers, comma-separated (at least one)"
    )
    model: Path = Field(description="model/tokenizer directory (its chat template is used)")
    worker_id: str = Field(
        default_factory=_default_worker_id,
        pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="consumer name in the tasks group (host-random, so pods are stateless)",
        json_schema_extra={"help_default": "HOST-RANDOM"},  # a new one each start
    )
    # --- concurrency -----------------------------------------------------------------------
    concurrency: int = Field(
        256, ge=1, le=100_000, description="episodes run at once; tasks are read only within it"
    )
    group_size: int | None = Field(
        None, ge=1, le=4096, description="override every task's group size n (default: the task's)"
    )
    # --- per-episode limits ----------------------------------------------------------------
    max_turns: int = Field(
        32,
        ge=1,
        le=100_000,
        description="hard cap on turns (the horizon/task value applies below it)",
    )
    episode_retries: int = Field(
        2, ge=0, le=10, description="re-runs of an episode cut short by inference/sandbox faults"
    )
    # --- sandbox ---------------------------------------------------------------------------
    sandbox_backend: Literal["none", "docker", "bwrap"] = Field(
        "none", description="sandbox pool handed to envs that need one (none: no pool)"
    )
    # --- broker and lifecycle --------------------------------------------------------------
    shutdown_grace_s: float = Field(
        30.0, ge=0.0, description="on SIGTERM, time allowed for in-flight groups to finish"
    )
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop", description="event loop (uvloop: about a third less CPU per env step)"
    )
    policy_refresh_s: float = Field(
        1.0,
        gt=0.0,
        le=60.0,
        description="how often the run's published policy is re-read for its LoRA adapter name "
        "(an unloaded adapter forces a re-read at once)",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port (0: none)")
    # --- components ------------------------------------------------------------------------
    episode: EpisodeSettings = section(EpisodeSettings)
    chat: ChatSettings = section(ChatSettings)
    consumer: ConsumerSettings = section(ConsumerSettings)
    inference: ClientConfig = section(
        ClientConfig, prefix="inference_", request_timeout_s=60.0, retry_budget_s=120.0
    )

    @field_validator("inference_urls")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"inference URL {url!r} must start with http:// or https://")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> WorkerConfig:
        if not self.inference_urls:
            raise ValueError("inference_urls: at least one inference server is required")
        return self
