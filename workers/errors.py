"""Errors raised by the workers package, and the mapping of foreign errors to categories.

    WorkerError
    ├── ConfigError       the worker's configuration is invalid (bad TOML, bad values)
    └── TemplateError     the tokenizer's chat template does not extend conversations by
                          appending tokens, so exact token bookkeeping is impossible

Episode failures are *not* raised through the worker loop: `categorize` turns the
exception that ended an episode into the broker's `ErrorCategory`, and the episode is
recorded as data on its trajectory.
"""

from __future__ import annotations

from broker.messages import ErrorCategory


class WorkerError(Exception):
    """Base of every error the workers package raises."""


class ConfigError(WorkerError, ValueError):
    """The worker configuration could not be loaded or validated."""


class TemplateError(WorkerError):
    """The chat template rendered a conversation that is not a prefix-extension."""


def categorize(exc: BaseException) -> ErrorCategory:
    """Map the exception that ended an episode to the category recorded on the trajectory.

    Imports are local so that `--help` and the config never import the heavy packages.
    Anything unrecognised raised from inside an environment is the environment's fault.
    """
    from envs.errors import EnvInfraError
    from inference.errors import InferenceError

    if isinstance(exc, EnvInfraError):
        return exc.category
    if isinstance(exc, InferenceError):
        return ErrorCategory.INFERENCE
    if isinstance(exc, TimeoutError):
        return ErrorCategory.TIMEOUT
    if type(exc).__name__ == "SandboxError" or any(
        c.__name__ == "SandboxError" for c in type(exc).__mro__
    ):
        return ErrorCategory.SANDBOX
    return ErrorCategory.ENV
