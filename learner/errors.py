"""Errors raised by the learner.

    LearnerError
    ├── ConfigError        the configuration is invalid (unknown keys, out-of-range values)
    ├── TaskSourceError    the task dataset cannot be read or is malformed
    ├── CheckpointError    a checkpoint cannot be written or read back
    ├── WeightPushError    the new weights could not be pushed to, or verified on, every server
    ├── RunFailedError     nothing can be trained: every episode fails with an infra/spec error
    └── ReplayError        a replay source cannot be found or read

Library exceptions (pydantic, torch, OSError, the inference client) are translated
at the boundary of the module that calls them.
"""

from __future__ import annotations


class LearnerError(Exception):
    """Base of every error the learner raises."""


class ConfigError(LearnerError):
    """The learner configuration is invalid; the message says which field and why."""


class TaskSourceError(LearnerError):
    """The JSONL task dataset is missing, empty or malformed."""


class CheckpointError(LearnerError):
    """A checkpoint could not be written durably or read back."""


class WeightPushError(LearnerError):
    """Weights were not confirmed by every inference server."""


class RunFailedError(LearnerError):
    """Batch after batch held nothing trainable because the infrastructure or the task
    specs failed every episode; the message names the dominant category and an example."""


class ReplayError(LearnerError):
    """A replay source (archive path or stream range) is unusable."""
