"""Real models' chat templates and tokenizers (tests/chat_models) through the worker.

For each family (Qwen3 with thinking on and off, Qwen2.5, DeepSeek-R1-Distill-Qwen, Llama 3.2,
Mistral v3, Gemma 3, SmolLM2), a three-turn tool episode (the model talks, calls `lookup`,
answers with the tool's result) runs through the worker's own episode loop over the real
template, with the family's tool and reasoning parsers, and a scripted model
(tests/workers/scripted.py). It must record exactly the tokens the model was fed, hand the
environment the answer only (reasoning split off, the call parsed in the family's syntax),
reach its reward, and the agent endpoint, driven through the same conversation, must record
the same tokens. A hypothesis property checks each observation's tokens against the
template's own tokenization for generated observations and tool results.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.messages import ErrorCategory, FinishReason, Task, Trajectory
from inference.client import SamplingParams
from tests.chat_models import tokenizer_dir
from tests.workers import chatenvs
from tests.workers.agent_helpers import DEFAULTS, LIMITS, call_prompts
from tests.workers.scripted import ScriptedModel
from workers.agent_endpoint import AgentEndpoint
from workers.agent_record import EpisodeRecord
from workers.answers import AnswerReader
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext, run_episode
from workers.tokens import ChatCodec, load_codec

CALL_JSON = '{"name": "lookup", "arguments": {"key": "KEY"}}'
HERMES = f"<tool_call>\n{CALL_JSON}\n</tool_call>"
PLAIN = ("I will look it up.", HERMES, "VALUE")


@dataclass(frozen=True)
class Case:
    """One family's run: its tokenizer, template kwargs, parsers and the model's three turns."""

    family: str  # tests/chat_models family, or "smollm2"
    tool_parser: str
    reasoning_parser: str = "none"
    kwargs: dict[str, Any] = field(default_factory=dict)
    said: tuple[str, str, str] = PLAIN  # KEY and VALUE are filled in
    thinks: bool = False  # every completion carries reasoning


CASES = {
    "qwen3-thinking": Case(
        "qwen3",
        "hermes",
        "qwen3",
        said=(
            "<think>\nThe user wants a lookup.\n</think>\n\nI will look it up.",
            f"<think>\nCall the tool.\n</think>\n\n{HERMES}",
            "<think>\nThe tool said VALUE.\n</think>\n\nVALUE",
        ),
        thinks=True,
    ),
    "qwen3-no-thinking": Case("qwen3", "hermes", "qwen3", {"enable_thinking": False}),
    "qwen2.5": Case("qwen2.5", "hermes"),
    "deepseek-r1": Case(
        "deepseek-r1",
        "hermes",
        "deepseek_r1",
        said=(  # its prompt ends inside <think>
            "The user wants a lookup.\n</think>\n\nI will look it up.",
            f"Call the tool.\n</think>\n\n{HERMES}",
            "The tool said VALUE.\n</think>\n\nVALUE",
        ),
        thinks=True,
    ),
    "llama3.2": Case(
        "llama3.2",
        "llama3_json",
        said=(PLAIN[0], '{"name": "lookup", "parameters": {"key": "KEY"}}', "VALUE"),
    ),
    "mistral": Case("mistral", "mistral", said=(PLAIN[0], f"[TOOL_CALLS] [{CALL_JSON}]", "VALUE")),
    "gemma3": Case("gemma3", "pythonic", said=(PLAIN[0], '[lookup(key="KEY")]', "VALUE")),
    "smollm2": Case("smollm2", "hermes"),
}
SEED = 11


def _tokenizer_path(case: Case, request: pytest.FixtureRequest) -> Path:
    if case.family == "smollm2":
        return Path(request.getfixturevalue("smollm2_dir"))
    return tokenizer_dir(case.family)


@pytest.fixture(scope="module", params=sorted(CASES))
def setup(request: pytest.FixtureRequest) -> tuple[Case, ChatCodec]:
    case = CASES[request.param]
    return case, load_codec(str(_tokenizer_path(case, request)), case.kwargs)


def _key_value() -> tuple[str, str]:
    env = chatenvs.ToolTurns()
    env.reset(seed=SEED)
    return env.key, env.value


def _completions(case: Case, codec: ChatCodec) -> list[list[int]]:
    """What the scripted model samples: the family's own tokens, ending its turn."""
    key, value = _key_value()
    end = codec.end_of_turn if codec.end_of_turn is not None else codec.stop_token_ids[0]
    tok = codec._tok
    texts = [t.replace("KEY", key).replace("VALUE", value) for t in case.said]
    return [[*tok.encode(t, add_special_tokens=False), end] for t in texts]


def _context(case: Case, codec: ChatCodec, history: str = "keep") -> EpisodeContext:
    model = ScriptedModel(_completions(case, codec))
    reader = AnswerReader(codec, case.tool_parser, case.reasoning_parser)
    return EpisodeContext(codec, model, SamplingParams, reader=reader, history=history)  # type: ignore[arg-type]


async def _episode(ctx: EpisodeContext) -> Trajectory:
    chatenvs.ACTIONS.pop(SEED, None)
    task = Task("t-chat", "wk-toolturns", group_size=1, seed=SEED, policy_version=0)
    return await run_episode(ctx, EpisodeSettings(max_context_tokens=8192), task, 0, 8)


async def test_a_three_turn_tool_episode_records_what_the_model_was_fed(setup) -> None:
    case, codec = setup
    ctx = _context(case, codec)
    traj = await _episode(ctx)
    key, value = _key_value()
    assert traj.error is ErrorCategory.NONE, traj.error_detail
    assert traj.finish_reason is FinishReason.TERMINATED and len(traj.turns) == 3
    assert [t.reward for t in traj.turns] == [0.0, 0.0, 1.0]
    # exactly the tokens the model was fed, turn by turn, one growing sequence
    assert call_prompts(list(traj.turns)) == ctx.client.prompts  # type: ignore[attr-defined]
    assert not any(t.segment_start for t in traj.turns)
    # the env got the answer only, and the call in the family's syntax
    talk, call, answer = chatenvs.ACTIONS[SEED]
    assert not any("think>" in str(a) for a in (talk, call, answer))
    assert str(answer).strip() == value
    calls = call.parsed.calls
    assert [(c.name, c.arguments) for c in calls] == [("lookup", {"key": key})]
    # the tool's result reached the model inside the template's own markers
    result_turn = codec.decode(traj.turns[2].prompt_ids, skip_special=False)
    assert value in result_turn
    for turn in traj.turns:
        head = codec.decode(turn.completion_ids[: turn.reasoning_tokens], skip_special=False)
        assert head.endswith("</think>") if case.thinks else turn.reasoning_tokens == 0


async def test_qwen3_keeps_or_drops_earlier_reasoning_as_the_run_chooses() -> None:
    case = CASES["qwen3-thinking"]
    codec = load_codec(str(tokenizer_dir("qwen3")))
    kept = await _episode(keep := _context(case, codec, "keep"))
    dropped = await _episode(drop := _context(case, codec, "drop"))
    for ctx, traj in ((keep, kept), (drop, dropped)):
        assert traj.turns[-1].reward == 1.0
        assert call_prompts(list(traj.turns)) == ctx.client.prompts  # type: ignore[attr-defined]
    last_keep = codec.decode(keep.client.prompts[-1], skip_special=False)  # type: ignore[attr-defined]
    last_drop = codec.decode(drop.client.prompts[-1], skip_special=False)  # type: ignore[attr-defined]
    # keep: the model's own tokens stay, reasoning and all; one sequence
    assert "The user wants a lookup." in last_keep and "Call the tool." in last_keep
    assert not any(t.segment_start for t in kept.turns)
    # drop: the template's rendering of the answers alone; each turn after a reasoning one
    # no longer extends what the model saw, so it starts a segment of its own
    assert "The user wants a lookup." not in last_drop and "Call the tool." not in last_drop
    assert [t.segment_start for t in dropped.turns] == [False, True, True]


async def test_the_agent_endpoint_records_the_same_tokens(setup) -> None:
    """The same conversation, driven by an agent through the OpenAI endpoint, records the
    worker's tokens: first call rendered, later calls continued after the model's reply."""
    case, codec = setup
    worker = await _episode(_context(case, codec))
    model = ScriptedModel(_completions(case, codec))
    reader = AnswerReader(codec, case.tool_parser, case.reasoning_parser)
    endpoint = AgentEndpoint(codec, model, reader=reader)  # type: ignore[arg-type]
    await endpoint.start()
    try:
        record = EpisodeRecord(LIMITS, policy_version=0)
        key = endpoint.open_episode(record, "t/0", DEFAULTS)
        env = chatenvs.ToolTurns()
        question, _ = env.reset(seed=SEED)
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=key, max_retries=0
        ) as api:
            for _ in range(3):
                reply = await api.chat.completions.create(
                    model="m",
                    messages=messages,
                    tools=chatenvs.TOOLS,  # type: ignore[arg-type]
                )
                message = reply.choices[0].message
                assert "think>" not in (message.content or "")
                messages.append(message.model_dump(exclude_none=True, exclude={"reasoning"}))
                observation, *_ = env.step(_action(message))
                if isinstance(observation, dict):
                    messages.append(observation)
                elif observation:
                    messages.append({"role": "user", "content": observation})
    finally:
        await endpoint.close()
    ours = [(t.prompt_ids.tolist(), t.completion_ids.tolist()) for t in record.turns]
    assert ours == [(t.prompt_ids.tolist(), t.completion_ids.tolist()) for t in worker.turns]
    assert record.segments == 1
    assert [t.reasoning_tokens for t in record.turns] == [t.reasoning_tokens for t in worker.turns]


def _action(message: Any) -> Any:
    """The reply as the env reads it: its calls (as the endpoint parsed them) or its text."""
    from envs.parsing import Action, ParsedAction
    from envs.tools import ToolCall

    calls = tuple(
        ToolCall(c.function.name, json.loads(c.function.arguments), id=c.id)
        for c in message.tool_calls or ()
    )
    return Action(message.content or "", ParsedAction(calls, message.content or ""))


_PIECES = [*"ab7 \n\t:{}<>_\"'\\", "ü", "✓", "12", "  ", "\n\n", "Hello", " world", "=", "."]
_TEXT = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=8).map("".join)


@given(texts=st.lists(_TEXT, min_size=1, max_size=3), tool=st.booleans())
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_observation_tokens_are_the_templates_own(setup, texts: list[str], tool: bool) -> None:
    """Property: for any observation text or tool results (several in a row), the tokens the
    worker appends are the template's own tokenization of them after an assistant turn."""
    _, codec = setup
    if tool:
        obs = [
            {"role": "tool", "content": t, "tool_call_id": "call00001", "name": "lookup"}
            for t in texts
        ]
    else:
        obs = texts[0]
    messages = codec.as_messages(obs)
    assert codec.observation_ids(obs) == codec._ids_after_base(messages)


def test_a_template_that_cannot_be_handled_fails_at_start_up_naming_it(tmp_path: Path) -> None:
    """The worker refuses it before taking any task, in one line, not as an env error at
    turn 2 of every episode."""
    from transformers import AutoTokenizer

    from workers.errors import TemplateError

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen2.5")))
    # a template that writes an observation twice: no way to cut it around its content
    tok.chat_template = tok.chat_template.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + message.content + '<|im_end|>' + '\\n' }}",
    )
    tok.save_pretrained(str(tmp_path))
    with pytest.raises(TemplateError, match=f"chat template of {tmp_path} cannot be used"):
        load_codec(str(tmp_path))
    args = ["--redis-url", "redis://127.0.0.1:1/0", "--inference-urls", "http://127.0.0.1:1"]
    done = subprocess.run(
        [sys.executable, "-m", "workers", *args, "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"error: the chat template of {tmp_path} cannot be used" in done.stderr
    assert "Traceback" not in done.stderr


async def test_a_request_may_turn_thinking_off_at_the_endpoint() -> None:
    """`chat_template_kwargs` of a request override the run's: rendered without thinking, its
    reply is read without a reasoning split, as vLLM's qwen3 parser reads it."""
    codec = load_codec(str(tokenizer_dir("qwen3")))
    said = [[*codec._tok.encode("hmm</think>42", add_special_tokens=False), codec.end_of_turn]]
    model = ScriptedModel(said)
    endpoint = AgentEndpoint(codec, model, reader=AnswerReader(codec, "hermes", "qwen3"))  # type: ignore[arg-type]
    await endpoint.start()
    try:
        key = endpoint.open_episode(EpisodeRecord(LIMITS, policy_version=0), "t/0", DEFAULTS)
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=key, max_retries=0
        ) as api:
            reply = await api.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
    finally:
        await endpoint.close()
    assert codec.decode(model.prompts[0], skip_special=False).endswith("<think>\n\n</think>\n\n")
    assert reply.choices[0].message.content == "hmm</think>42"


def test_the_worker_offers_every_parser_there_is() -> None:
    """`workers.config` names the parsers without importing them (`--help` stays light)."""
    from envs.parsing import PARSER_NAMES
    from envs.reasoning import NAMES
    from workers.config import REASONING_PARSERS, TOOL_PARSERS

    assert set(TOOL_PARSERS) == set(PARSER_NAMES) and set(REASONING_PARSERS) == set(NAMES)
