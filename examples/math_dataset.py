"""A small maths dataset in the Parquet format users bring, and a reward function for it.

``python -m examples.math_dataset OUT.parquet [--rows 300] [--seed 0]`` writes `rows`
problems with the columns ``question`` (the prompt), ``answer`` (what ``--reward math``
checks with math-verify: an integer, a fraction in LaTeX or a decimal), ``topic`` and
``level`` (kept on the row for a reward function to read). The same seed writes the same
file. Train on it with::

    farm up --tasks OUT.parquet --prompt-column question --answer-column answer --reward math \\
        --system-prompt "Solve the problem. Put the final answer in \\boxed{}."

`boxed_and_correct` is a custom reward for the same file (``--reward
examples.math_dataset:boxed_and_correct``): two components, whether the reply puts its
answer in ``\\boxed{}`` (the format asked for) and whether math-verify finds it correct, so
the worker's ``farm_worker_reward_component`` histogram charts each.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

Problem = tuple[str, str]  # question, answer


def _sum(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", str(a + b)


def _product(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 19), rng.randint(2, 19)
    return f"What is {a} times {b}?", str(a * b)


def _linear(rng: random.Random) -> Problem:
    x, a, b = rng.randint(-9, 9), rng.randint(2, 9), rng.randint(-20, 20)
    return f"Solve for x: {a}x + {b} = {a * x + b}.", str(x)


def _fraction(rng: random.Random) -> Problem:
    p = Fraction(rng.randint(1, 5), rng.randint(2, 6))
    q = Fraction(rng.randint(1, 5), rng.randint(2, 6))
    total = p + q
    answer = str(total.numerator) if total.denominator == 1 else _latex(total)
    return f"What is {p} + {q}? Give the answer as a fraction in lowest terms.", answer


def _percent(rng: random.Random) -> Problem:
    percent, whole = rng.choice([5, 10, 15, 20, 25, 40, 50, 75]), rng.randint(2, 40) * 4
    value = Fraction(percent * whole, 100)
    answer = str(value.numerator) if value.denominator == 1 else str(float(value))
    return f"What is {percent}% of {whole}?", answer


def _latex(value: Fraction) -> str:
    return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


TOPICS: dict[str, tuple[int, Callable[[random.Random], Problem]]] = {
    "sum": (0, _sum),
    "product": (1, _product),
    "percent": (1, _percent),
    "linear": (2, _linear),
    "fraction": (2, _fraction),
}


def problems(rows: int = 300, seed: int = 0) -> list[dict[str, Any]]:
    """`rows` problems, topics in turn, drawn from `seed`."""
    rng = random.Random(seed)
    out = []
    names = sorted(TOPICS)
    for index in range(rows):
        topic = names[index % len(names)]
        level, make = TOPICS[topic]
        question, answer = make(rng)
        out.append({"question": question, "answer": answer, "topic": topic, "level": level})
    return out


def write(path: Path, rows: int = 300, seed: int = 0) -> Path:
    """Write the dataset to `path` (Parquet); returns it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(problems(rows, seed)), path)
    return path


_BOXED = re.compile(r"\\boxed\{")


def boxed_and_correct(completion: str, answer: str) -> dict[str, float]:
    """Two components: the reply uses ``\\boxed{}`` (0.2), and its answer is right (1.0)."""
    from envs.reward_math import math_reward

    return {
        "format": 0.2 if _BOXED.search(completion) else 0.0,
        "correct": math_reward(completion, answer),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the Parquet file to write")
    parser.add_argument("--rows", type=int, default=300, help="how many problems")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed")
    args = parser.parse_args(argv)
    write(args.out, args.rows, args.seed)
    print(f"wrote {args.rows} problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
