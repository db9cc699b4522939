"""The stream-retention settings (`StreamBounds`), apart from the trimmer that applies them
(`broker.trim`): a config that names them (the farm's, the learner's) imports neither
the trimmer nor the archive and codec modules under it."""

from __future__ import annotations

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as config_dataclass


@config_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class StreamBounds:
    """Stream retention: acknowledged entries trimmed, the rest bounded (docs/deploy.md)."""

    max_bytes: int = Field(
        256 << 20,
        ge=1 << 16,
        description="bytes one stream may hold (MEMORY USAGE); above it admission backs off",
    )
    maxlen: int = Field(
        100_000, ge=1, description="entries one stream may hold; above it admission backs off"
    )
    trim_interval_s: float = Field(2.0, gt=0.0, le=3600.0, description="seconds between trims")
