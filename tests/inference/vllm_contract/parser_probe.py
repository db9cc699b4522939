"""Run vLLM 0.33's own tool-call and reasoning parsers on given texts.

Started by tests/inference/vllm_contract/test_vllm_parsers.py in a process whose PYTHONPATH
holds the contract environment and its parser directory (env.py). Reads one JSON object from
stdin: a list of jobs ``{"tokenizer": DIR, "tool": [[parser, text], ...], "reasoning":
[[parser, kwargs, text], ...]}`` and writes, per job, ``{"tool": [{"called", "calls": [[name,
arguments]], "content"}], "reasoning": [[reasoning, content]]}`` in the same order. The request is a chat completion
offering one tool, as a client using tools sends it.
"""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def main() -> None:
    json.dump([run(job) for job in json.load(sys.stdin)], sys.stdout)


def run(job: dict) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=[TOOL]
    )
    tools, parsers = [], {}
    for name, text in job["tool"]:
        if name not in parsers:  # one parser per name: a non-streaming parse keeps no state
            parser = ToolParserManager.get_tool_parser(name)(tokenizer)
            parsers[name] = (parser, parser.adjust_request(request))
        parser, adjusted = parsers[name]
        found = parser.extract_tool_calls(text, adjusted)
        calls = [[c.function.name, c.function.arguments] for c in found.tool_calls]
        tools.append({"called": found.tools_called, "calls": calls, "content": found.content})
    reasoning, readers = [], {}
    for name, kwargs, text in job["reasoning"]:
        key = json.dumps([name, kwargs])
        if key not in readers:
            req = ChatCompletionRequest(
                model="m", messages=[{"role": "user", "content": "x"}], chat_template_kwargs=kwargs
            )
            made = ReasoningParserManager.get_reasoning_parser(name)
            readers[key] = (made(tokenizer, chat_template_kwargs=kwargs), req)
        parser, req = readers[key]
        reasoning.append(list(parser.extract_reasoning(text, req)))
    return {"tool": tools, "reasoning": reasoning}


if __name__ == "__main__":
    main()
