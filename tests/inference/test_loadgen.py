"""The benchmark's load generator speaks the shape the real GenerationClient accepts."""

from __future__ import annotations

from aiohttp.test_utils import TestServer

from bench._loadgen import LoadGenerator, build_app
from inference.client import GenerationClient, SamplingParams


async def test_generation_client_accepts_load_generator_replies() -> None:
    server = TestServer(build_app(LoadGenerator(median_ms=1.0, sigma=0.1, tokens=5)))
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        async with GenerationClient([url]) as client:
            params = SamplingParams(max_tokens=5, stop_token_ids=(258,), allowed_token_ids=(49, 50))
            gen = await client.generate([1, 2, 3], params, session_id="s")
    finally:
        await server.close()
    assert len(gen.token_ids) == 5 and gen.token_ids[-1] == 258
    assert set(gen.token_ids[:-1]) <= {49, 50}
    assert len(gen.logprobs) == 5 and gen.weight_versions == [0] * 5
    assert gen.finish_reason == "stop"


async def test_code_mode_answers_with_solutions_the_code_env_grades() -> None:
    """`--mode code` replies decode (byte-level ids) to a ```python block whose code
    passes, fails or passes slowly on the built-in `sum-two` tests."""
    import subprocess
    import sys

    from bench._loadgen import MIX, code_answer
    from envs.code.grading import extract_code
    from envs.code.problems import load_problems

    gen = LoadGenerator(median_ms=1.0, sigma=0.1, tokens=5, mode="code", slow_s=0.01)
    server = TestServer(build_app(gen))
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        async with GenerationClient([url]) as client:
            params = SamplingParams(max_tokens=256, stop_token_ids=(258,))
            replies = [
                await client.generate([1, 2, 3], params, session_id=f"s{i}") for i in range(30)
            ]
    finally:
        await server.close()
    texts = {bytes(g.token_ids[:-1]).decode() for g in replies}
    assert all(g.token_ids[-1] == 258 for g in replies)
    assert texts == {code_answer(kind, 0.01) for kind, _ in MIX}  # every kind, nothing else
    assert sum(gen.answers.values()) == 30
    problem = next(p for p in load_problems() if p.id == "sum-two")
    for kind, _ in MIX:
        code = extract_code(code_answer(kind, 0.01))
        outputs = [
            subprocess.run(
                [sys.executable, "-c", code], input=t.input, capture_output=True, text=True
            ).stdout
            for t in problem.tests
        ]
        right = outputs == [t.output for t in problem.tests]
        assert right == (kind != "failing"), (kind, outputs)
