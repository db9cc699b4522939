"""The arith environment: the reward rule, the disjoint deterministic splits, bad specs."""

from __future__ import annotations

import json

import pytest

import envs
from envs.arith import answer_of, score, split_lines, split_problems
from envs.errors import EnvSpecError, EnvStateError


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("12", 1.0),
        ("  12.\n", 1.0),
        ("7 + 5 = 12", 1.0),
        ("The answer is 12!", 1.0),
        ("12<|im_end|>", 1.0),
        ("7 + 5 = 12\n\nThis is a classic example of", 0.0),  # rambles past the answer
        ("7 + 5 = 13", 0.0),
        ("112", 0.0),
        ("12 apples", 0.0),
        ("twelve", 0.0),
        ("", 0.0),
    ],
)
def test_the_answer_must_be_the_last_thing_said(reply: str, reward: float) -> None:
    assert score(reply, 12, strict=False) == reward


def test_strict_wants_the_number_alone() -> None:
    assert score(" 12\n", 12, strict=True) == 1.0
    assert score("7 + 5 = 12", 12, strict=True) == 0.0
    assert score("12.", 12, strict=True) == 0.0
    assert score("-3", -3, strict=True) == 1.0 and score("5 - 8 = -3", -3, strict=False) == 1.0


async def test_an_episode_asks_scores_and_terminates() -> None:
    env = envs.make("arith")
    obs, info = await envs.areset(env, seed=3)
    assert obs == f"What is {info['problem']}? Answer with the number only."
    a, b = (int(x) for x in info["problem"].split("+"))
    _, reward, terminated, truncated, info = await envs.astep(env, f"{a} + {b} = {a + b}")
    assert (reward, terminated, truncated, info["correct"]) == (1.0, True, False, True)
    with pytest.raises(EnvStateError):
        await envs.astep(env, "1")
    await envs.areset(env, seed=3)
    _, reward, *_ = await envs.astep(env, f"{a + b}\n\nThis is a classic example")
    assert reward == 0.0


@pytest.mark.parametrize(("ops", "size"), [("+", 100), ("-", 55), ("+-", 155)])
def test_splits_are_disjoint_cover_the_space_and_never_move(ops: str, size: int) -> None:
    splits = split_problems(9, ops, 0.2)
    train, held = set(splits["train"]), set(splits["heldout"])
    assert not train & held and len(train | held) == size
    assert len(held) == round(size * 0.2)
    assert all(answer_of(p) >= 0 for p in train | held)
    # the split is part of the environment's contract: a changed seed or shuffle would leak
    assert split_problems.__wrapped__(9, ops, 0.2) == splits


async def test_each_split_only_draws_its_own_problems_deterministically() -> None:
    held = set(split_problems(9, "+", 0.2)["heldout"])
    seen: dict[str, set[str]] = {"train": set(), "heldout": set()}
    for split in seen:
        env = envs.make(f'arith@{{"split": "{split}"}}')
        for seed in range(300):
            obs, info = await envs.areset(env, seed=seed)
            assert info["split"] == split
            assert (await envs.areset(env, seed=seed))[0] == obs
            seen[split].add(info["problem"])
    names = {f"{a}+{b}" for a, _, b in held}
    assert seen["heldout"] == names  # 300 draws reach all 20 held-out problems
    assert not seen["train"] & names and len(seen["train"]) > 60


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('arith@{"split": "test"}', "split"),
        ('arith@{"max_operand": 0}', "max_operand"),
        ('arith@{"ops": "*"}', "ops"),
        ('arith@{"heldout_fraction": 1.0}', "heldout_fraction"),
        ('arith@{"difficulty": 1}', "difficulty"),
    ],
)
def test_bad_specs_are_refused_with_the_field_named(spec: str, message: str) -> None:
    for check in (envs.check_spec, envs.make):
        with pytest.raises(EnvSpecError, match=message):
            check(spec)


async def test_split_lines_name_every_held_out_problem_exactly_once() -> None:
    """An eval set of the held-out split by row scores each problem once; seeds did not:
    20 seeds drew only some of the 20 problems (the old eval's row-index seeds)."""
    lines = [json.loads(line) for line in split_lines("heldout")]
    held_out = split_problems(9, "+", 0.2)["heldout"]
    asked = []
    for line in lines:
        env = envs.make(line["env_spec"])
        _, info = await envs.areset(env, seed=0, options={"row": line["row"]})
        asked.append(info["problem"])
    assert sorted(asked) == sorted(f"{a}{op}{b}" for a, op, b in held_out)
    by_seed = set()
    for seed in range(len(held_out)):
        _, info = await envs.areset(envs.make(lines[0]["env_spec"]), seed=seed)
        by_seed.add(info["problem"])
    assert len(by_seed) < len(held_out)  # why rows: seeds 0..N-1 collide
    with pytest.raises(EnvSpecError, match="index"):
        await envs.areset(envs.make("arith"), seed=0, options={"row": {"index": 10_000}})
