"""How a dataset of prompts becomes tasks: the column mapping, the reward, the row bound.

`DataConfig` is the component every command that reads ``--tasks`` or ``--eval-tasks`` takes
(the learner, `learner evaluate`/`filter`, `farm up`/`eval`/`filter`). With
``--prompt-column`` or ``--messages-column`` each row of the file is a task of the
``dataset`` environment (`envs.dataset`): the spec is built once from these settings
(`DataConfig.env_spec`), and the row travels whole with its task, so every column stays
available to the reward. Without them the file is a task file: each row names its own
``env_spec``. Nothing here imports pyarrow: ``--help`` stays instant.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from broker.messages import MAX_ROW_BYTES


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class DataConfig:
    """Datasets of prompts: columns, reward function, row bound (docs/envs.md)."""

    prompt_column: str | None = Field(
        None, min_length=1, description="column holding the prompt text: each row is a task"
    )
    messages_column: str | None = Field(
        None, min_length=1, description="column holding chat messages as the prompt"
    )
    answer_column: str = Field("answer", min_length=1, description="column the reward checks")
    reward: str | None = Field(
        None, min_length=1, description="math | exact | regex | code | pkg.module:fn"
    )
    reward_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="a reward call past this is an infrastructure failure"
    )
    system_prompt: str | None = Field(None, description="system message before each prompt")
    tools: str | None = Field(
        None, min_length=1, description="pkg.module:factory of @tool methods (multi-turn)"
    )
    max_row_bytes: int = Field(
        64 * 1024, ge=256, le=MAX_ROW_BYTES, description="the most a row may weigh (msgpack)"
    )
    dataset_cache_dir: Path | None = Field(
        None, description="where Parquet files are converted (None: ~/.cache/rollout-farm)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.prompt_column and self.messages_column:
            raise ValueError("give prompt_column or messages_column, not both")
        prompts = bool(self.prompt_column or self.messages_column)
        if prompts and self.reward is None:
            raise ValueError("a dataset of prompts needs reward (math, exact, regex, code or fn)")
        if not prompts and (self.reward or self.tools or self.system_prompt):
            raise ValueError(
                "reward, tools and system_prompt apply to a dataset of prompts: "
                "give prompt_column or messages_column"
            )
        return self

    @property
    def prompts(self) -> bool:
        """Whether rows are prompts (a `dataset` env task each) rather than task lines."""
        return bool(self.prompt_column or self.messages_column)

    def env_spec(self) -> str | None:
        """The ``dataset`` env spec every row runs under (None for a task file)."""
        if not self.prompts:
            return None
        kwargs: dict[str, object] = {
            "answer_column": self.answer_column,
            "reward": self.reward,
            "reward_timeout_s": self.reward_timeout_s,
        }
        if self.messages_column:
            kwargs["messages_column"] = self.messages_column
        else:
            kwargs["prompt_column"] = self.prompt_column
        if self.system_prompt:
            kwargs["system_prompt"] = self.system_prompt
        if self.tools:
            kwargs["tools"] = self.tools
        return "dataset@" + json.dumps(kwargs, sort_keys=True)

    @property
    def cache_dir(self) -> Path:
        return self.dataset_cache_dir or Path.home() / ".cache" / "rollout-farm" / "datasets"
