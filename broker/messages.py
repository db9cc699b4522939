"""Wire messages: one frozen, typed struct per message kind.

Every struct has a ``KIND`` tag and a ``VERSION``; the codec (``broker.codec``)
writes both beside the msgpack body so that a reader can dead-letter what it
does not understand instead of crashing. Token ids and logprobs are numpy
arrays (``int32``/``float32``); on the wire they are raw little-endian bytes
and come back through ``numpy.frombuffer`` without a copy (read-only views).

Invariant: the unit on the trajectories stream is the *group* — every sample
of one task, published once all of them have finished.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


class ErrorCategory(enum.StrEnum):
    """Why an episode ended abnormally. Infrastructure categories never count
    as the model's failure."""

    NONE = "none"
    ENV = "env"  # the environment raised or misbehaved
    SANDBOX = "sandbox"  # the sandbox backend failed (not the model's code)
    INFERENCE = "inference"  # no inference server could answer
    TIMEOUT = "timeout"  # the episode's wall-clock limit
    FORMAT = "format"  # the model's action could not be parsed

    @property
    def is_infrastructure(self) -> bool:
        return self in (ErrorCategory.ENV, ErrorCategory.SANDBOX, ErrorCategory.INFERENCE)


class FinishReason(enum.StrEnum):
    """How an episode ended."""

    TERMINATED = "terminated"  # the environment ended it
    TRUNCATED = "truncated"  # a limit cut it short; `Trajectory.truncation` says which
    ERROR = "error"  # a failure; `Trajectory.error` gives its category


class Truncation(enum.StrEnum):
    """Which limit cut an episode short."""

    MAX_TURNS = "max_turns"  # the task's horizon or the worker's --max-turns
    CONTEXT = "context"  # --max-context-tokens
    WALL_TIME = "wall_time"  # --episode-timeout-s, after at least one turn
    ENV = "env"  # the environment reported truncated=True
    TOKENS = "tokens"  # an agent episode's completion-token budget (agent env kind)


def _as_i32(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype="<i4")
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-d token array, got shape {arr.shape}")
    return arr


def _as_f32(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype="<f4")
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-d logprob array, got shape {arr.shape}")
    return arr


@dataclass(frozen=True)
class EvalMark:
    """What makes a task an eval task: its results are scored, never trained (schema 2)."""

    set_name: str  # the eval set (``--eval-tasks NAME=FILE``)
    round_id: str  # one evaluation (a learner step's, or one `learner evaluate`): routes results
    row: int  # the task's line index in its set; pass@k is counted per row

    def __post_init__(self) -> None:
        if not self.set_name or not self.round_id:
            raise ValueError("an eval mark needs a set name and a round id")
        if self.row < 0:
            raise ValueError("an eval mark's row must be >= 0")


@dataclass(frozen=True)
class Task:
    """One unit of work: run ``group_size`` episodes of one environment spec."""

    KIND: ClassVar[str] = "task"
    # 2: eval mark and per-task sampling (temperature, max tokens); 3: the dataset row
    VERSION: ClassVar[int] = 3

    task_id: str  # unique; the group built from it carries the same id (dedup key)
    env_spec: str  # "name@{json kwargs}", resolved by envs.make
    group_size: int  # number of episodes (samples) in the group
    seed: int  # reset seed: every episode of the group resets with it, so all see one prompt
    policy_version: int  # learner's policy version when the task was issued
    issued_at: float = field(default_factory=time.time)  # unix seconds
    max_turns: int | None = None  # horizon for this task (None: the env's own limit)
    meta: dict[str, Any] = field(default_factory=dict)  # curriculum data, passed through
    # set: an eval task. Its group goes to the eval stream, never the trajectories stream; it
    # takes no admission slot and the staleness bound does not apply (schema 2)
    eval: EvalMark | None = None
    temperature: float | None = None  # sampling temperature for this task (None: the worker's)
    max_tokens: int | None = None  # completion tokens per turn (None: the worker's)
    # the dataset row's fields (schema 3): the environment gets them at reset
    # (``options={"row": ...}``). At most MAX_ROW_BYTES packed, checked where rows are read
    # (`learner.datasets`). A group carries its task without it: the learner holds the dataset.
    row: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError("group_size must be >= 1")
        if not self.task_id:
            raise ValueError("task_id must not be empty")
        if self.temperature is not None and not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def is_eval(self) -> bool:
        return self.eval is not None

    def sampling_seed(self, index: int, turn: int) -> int:
        """The sampling seed of turn `turn` of episode `index`: distinct per episode and turn,
        the same on every re-run (a redelivered task samples what the first run sampled)."""
        return mix_seed(self.seed, index, turn)


# The most a task's row may weigh packed (msgpack): a task entry stays small beside the
# stream's byte budget, and one oversized row cannot stall a worker's read.
MAX_ROW_BYTES = 1 << 20


def mix_seed(*parts: int) -> int:
    """A seed derived from `parts`: equal parts, equal seed; any other, an unrelated one."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: vLLM's and the server's range


# vLLM 0.33's `_MAX_TEMP` (vllm/sampling_params.py): the lowest temperature it samples at, so
# only 0 is greedy (its greedy test, `< _SAMPLING_EPS` = 1e-5, then never sees (0, 1e-5))
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True, eq=False)
class Sampling:
    """The distribution a turn's completion tokens were drawn from, as vLLM 0.33 applies it.

    In order: the allowed-token mask, the temperature (0: greedy, scored at 1), min-p, top-k,
    then top-p. A temperature in (0, 0.01) is raised to 0.01, as vLLM's `SamplingParams` does
    (``vllm/sampling_params.py``: it warns and samples at 0.01), so the record holds the
    temperature the tokens were drawn at and only exactly 0 is greedy. The turn's logprobs are under this processed, renormalised distribution (vLLM's
    ``--logprobs-mode processed_logprobs``), and the learner scores its own policy under the
    same one (`inference.sampling.processed_logits`). Schema 4; a schema-3 turn carried the
    temperature alone, and older ones nothing (decoded as the defaults).
    """

    temperature: float = 1.0  # 0 = greedy; (0, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1 = off
    min_p: float = 0.0  # drop tokens below min_p x the top probability; 0 = off
    allowed_token_ids: np.ndarray | None = None  # int32, sorted, unique; None = whole vocabulary

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.allowed_token_ids is not None:
            ids = np.unique(np.asarray(self.allowed_token_ids, dtype="<i4"))
            if ids.ndim != 1 or not len(ids) or ids[0] < 0:
                raise ValueError("allowed_token_ids must be a non-empty set of token ids >= 0")
            object.__setattr__(self, "allowed_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncated(self) -> bool:
        """Whether anything beyond the temperature shapes the distribution."""
        return (
            self.allowed_token_ids is not None
            or self.top_k > 0
            or self.top_p < 1.0
            or self.min_p > 0.0
        )

    def check_drawn(self, tokens: np.ndarray) -> None:
        """Raise ValueError if `tokens` could not have been drawn: one outside the allowed set."""
        ids = self.allowed_token_ids
        if ids is not None and len(tokens) and not np.isin(tokens, ids).all():
            outside = np.setdiff1d(tokens, ids)[:5].tolist()
            raise ValueError(f"completion tokens {outside} lie outside the allowed set")

    def key(self) -> tuple[float, int, float, float, bytes | None]:
        """A hashable identity (equal keys, equal distributions)."""
        ids = self.allowed_token_ids
        return (
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            None if ids is None else ids.tobytes(),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sampling):
            return NotImplemented
        return self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())


DEFAULT_SAMPLING = Sampling()


@dataclass(frozen=True, eq=False)
class Turn:
    """One model turn: the prompt-side tokens added before it, and its completion."""

    prompt_ids: np.ndarray  # int32, tokens appended on the prompt side (loss mask 0)
    completion_ids: np.ndarray  # int32, tokens the model sampled (loss mask 1)
    logprobs: np.ndarray  # float32, behaviour logprob of each completion token
    weight_version: int  # oldest weight version that produced any completion token
    reward: float  # reward the environment gave for this turn's action
    terminated: bool  # the environment reached a terminal state
    truncated: bool  # a limit cut the episode short after this turn
    # True: prompt_ids is a whole new prompt that does not extend the turns before it (an
    # agent rewrote its history); the learner trains it as a separate sequence.
    segment_start: bool = False
    # the distribution the completion was sampled from; `logprobs` are under it (schema 4)
    sampling: Sampling = DEFAULT_SAMPLING
    # the completion ended at a length limit (max tokens, the context left, a token budget),
    # not at a stop token (schema 4; DAPO's overlong rules read it)
    cut: bool = False
    # how many completion tokens, from the start, are the model's reasoning with its markers
    # (the run's reasoning parser split them off; the environment got the rest) (schema 6)
    reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _as_i32(self.prompt_ids))
        object.__setattr__(self, "completion_ids", _as_i32(self.completion_ids))
        object.__setattr__(self, "logprobs", _as_f32(self.logprobs))
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens"
            )
        self.sampling.check_drawn(self.completion_ids)
        if not 0 <= self.reasoning_tokens <= len(self.completion_ids):
            raise ValueError(
                f"{self.reasoning_tokens} reasoning tokens of {len(self.completion_ids)} completion tokens"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Turn):
            return NotImplemented
        return (
            np.array_equal(self.prompt_ids, other.prompt_ids)
            and np.array_equal(self.completion_ids, other.completion_ids)
            and np.array_equal(self.logprobs, other.logprobs, equal_nan=True)
            and self.weight_version == other.weight_version
            and self.reward == other.reward
            and self.terminated == other.terminated
            and self.truncated == other.truncated
            and self.segment_start == other.segment_start
            and self.sampling == other.sampling
            and self.cut == other.cut
            and self.reasoning_tokens == other.reasoning_tokens
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Trajectory:
    """One episode, turn by turn."""

    turns: tuple[Turn, ...]  # in order; may be empty when an error struck before turn 1
    finish_reason: FinishReason
    error: ErrorCategory = ErrorCategory.NONE  # category when finish_reason is ERROR
    error_detail: str = ""  # short human-readable detail, capped by the producer
    sample_index: int = 0  # index within the group; it chose the episode's sampling seeds
    timings: dict[str, float] = field(default_factory=dict)  # seconds: inference, env, total
    truncation: Truncation | None = None  # which limit, when finish_reason is TRUNCATED

    def __post_init__(self) -> None:
        object.__setattr__(self, "finish_reason", FinishReason(self.finish_reason))
        if self.truncation is not None:
            object.__setattr__(self, "truncation", Truncation(self.truncation))
        if (self.finish_reason is FinishReason.TRUNCATED) != (self.truncation is not None):
            raise ValueError("a truncation cause goes with finish_reason TRUNCATED, and only then")

    @property
    def outcome(self) -> str:
        """One label for logs and metrics: the reason, with the truncation cause if any."""
        if self.truncation is not None:
            return f"{self.finish_reason.value}:{self.truncation.value}"
        return self.finish_reason.value


@dataclass(frozen=True)
class TrajectoryGroup:
    """Every episode of one task; the learner only ever sees whole groups."""

    KIND: ClassVar[str] = "group"
    # 2: finish reason enum + truncation cause; 3: Turn.temperature; 4: Turn.sampling, .cut;
    # 5: its task in task schema 2 (eval mark, per-task sampling); 6: Turn.reasoning_tokens
    VERSION: ClassVar[int] = 6

    group_id: str  # equals the task's task_id; consumers dedup on it
    task: Task  # the task this group answers
    trajectories: tuple[Trajectory, ...]  # exactly task.group_size of them
    worker_id: str  # which worker produced it
    created_at: float = field(default_factory=time.time)  # unix seconds at publish

    @property
    def infra_failed(self) -> bool:
        """True when infrastructure, not the model, spoiled an episode."""
        return any(t.error.is_infrastructure for t in self.trajectories)

    @property
    def min_weight_version(self) -> int:
        versions = [turn.weight_version for t in self.trajectories for turn in t.turns]
        return min(versions) if versions else self.task.policy_version


@dataclass(frozen=True)
class PolicyVersion:
    """A weight version the learner has pushed and every server has confirmed."""

    KIND: ClassVar[str] = "policy"
    VERSION: ClassVar[int] = 2

    version: int  # monotonically increasing, starts at 0 for the initial weights
    step: int  # learner optimizer step that produced it
    servers: tuple[str, ...] = ()  # inference servers verified to serve this version
    weights_path: str = ""  # where the weights (or the adapter) were written ("" for NCCL)
    created_at: float = field(default_factory=time.time)
    # the served LoRA adapter name (`<run>-v<N>`) that workers put in `model`; "" means the
    # version is full weights, served under the server's base model name (schema 1 has none)
    adapter: str = ""


@dataclass(frozen=True)
class DeadLetter:
    """An entry a consumer could not or would not process, kept for inspection."""

    KIND: ClassVar[str] = "deadletter"
    VERSION: ClassVar[int] = 1

    source_stream: str  # stream the entry came from
    entry_id: str  # its id there
    reason: str  # why it was moved here
    fields: dict[bytes, bytes]  # the entry's raw fields, untouched, for requeue
    deliveries: int = 0  # times it had been delivered when dead-lettered
    consumer: str = ""  # consumer that gave up on it
    created_at: float = field(default_factory=time.time)


Message = Task | TrajectoryGroup | PolicyVersion | DeadLetter
MESSAGE_TYPES: tuple[type, ...] = (Task, TrajectoryGroup, PolicyVersion, DeadLetter)
