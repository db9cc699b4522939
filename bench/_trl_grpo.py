"""The TRL side of `bench e2e`: GRPOTrainer on the toy or on `arith`, run inside the TRL venv.

`python -m bench._trl_grpo SETTINGS_JSON` (`bench._e2e_setups.Setup.trl_settings`) trains the
model with TRL's `GRPOTrainer` on CPU and prints one JSON line per optimizer step
(``{"step", "reward", "t"}``, ``t`` = `time.time()`), stopping once the mean reward of the
last `window` steps reaches `target` or after `max_steps`. The task matches the farm's:

- ``toy``: toy observations rendered with the model's own chat template, one completion
  token restricted to the digits and the stop tokens (what the farm's workers allow through
  `action_vocabulary`), reward 1 for the right digit;
- ``arith``: every problem of the environment's train split, its observation as the user
  turn (the worker's first prompt: the same chat template, no system prompt, so the same
  token ids; tests/bench/test_e2e_arith.py checks it), and the environment's own reward:
  the problem is reset by index and the completion stepped through `envs.arith`.

Both: fp32 (TRL would autocast to bf16 by default), group-normalised advantages, no KL term, token-mean loss (TRL's ``dapo``, the farm
learner's default), a constant learning rate after `warmup_steps`, sampling at
`temperature` with top-p 1 and no top-k, stop at the tokenizer's end of turn, and the batch
of `group_size` x `groups_per_batch` completions trained in micro-batches of `micro_batch`
with one optimizer step. It imports only TRL, transformers, datasets and this repository's
`envs`/`workers.tokens`, so it runs in a venv layered over the project's.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any


def _toy_dataset(n: int, seed: int) -> Any:
    from datasets import Dataset

    import envs

    env = envs.make('toy@{"difficulty": 0}')
    rows = []
    for i in range(n):
        obs, _ = env.reset(seed=seed * 1_000_003 + i)
        rows.append({"prompt": [{"role": "user", "content": obs}], "answer": obs})
    return Dataset.from_list(rows)


def _toy_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    return [
        1.0 if t.strip() == a else 0.0 for t, a in zip(_texts(completions), answer, strict=True)
    ]


def _texts(completions: list[Any]) -> list[str]:
    """The completions' text (TRL passes a conversation's as one assistant message each)."""
    return [c[0]["content"] if isinstance(c, list) else c for c in completions]


def arith_rows() -> list[dict[str, Any]]:
    """One row per problem of `arith`'s train split: the observation as the user turn, the
    problem's index (for the reward)."""
    import envs

    env = envs.make("arith")
    rows = []
    for i in range(len(env.problems)):
        obs, _ = env.reset(options={"row": {"index": i}})
        rows.append({"prompt": [{"role": "user", "content": obs}], "index": i})
    return rows


def arith_reward(completions: list[Any], index: list[int], **_: Any) -> list[float]:
    """The `arith` environment's own reward for each completion of problem `index`."""
    import envs

    env = envs.make("arith")
    rewards = []
    for text, i in zip(_texts(completions), index, strict=True):
        env.reset(options={"row": {"index": i}})
        rewards.append(float(env.step(text)[1]))
    return rewards


def _task(s: dict[str, Any], tok: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(dataset, reward function, extra generation kwargs) of the settings' task."""
    from datasets import Dataset

    if s["task"] == "arith":
        return Dataset.from_list(arith_rows()), arith_reward, {}
    from envs.toy import DIGITS
    from workers.tokens import ChatCodec

    allowed = set(ChatCodec(tok).allowed_token_ids(DIGITS) or ())
    suppress = [i for i in range(len(tok)) if i not in allowed]
    dataset = _toy_dataset(s["max_steps"] * s["groups_per_batch"] + 64, s["seed"])
    return dataset, _toy_reward, {"suppress_tokens": suppress}


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = json.loads(Path(argv[0]).read_text())
    tok = AutoTokenizer.from_pretrained(s["model"], local_files_only=True)
    dataset, reward, generation_kwargs = _task(s, tok)
    recent: deque[float] = deque(maxlen=s["window"])

    class Progress(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            recent.append(float(logs["reward"]))
            print(
                json.dumps({"step": state.global_step, "reward": logs["reward"], "t": time.time()}),
                flush=True,
            )
            if len(recent) == recent.maxlen and sum(recent) / len(recent) >= s["target"]:
                control.should_training_stop = True

    batch = s["group_size"] * s["groups_per_batch"]
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            learning_rate=s["learning_rate"],
            # one generation of `batch` completions per optimizer step, trained in micro-batches
            per_device_train_batch_size=s["micro_batch"],
            gradient_accumulation_steps=batch // s["micro_batch"],
            num_generations=s["group_size"],
            max_completion_length=s["max_tokens"],
            temperature=s["temperature"],
            lr_scheduler_type="constant_with_warmup",  # the farm's: linear warm-up, then flat
            warmup_steps=s["warmup_steps"],
            gradient_checkpointing=False,  # the farm's learner recomputes nothing by default
            beta=0.0,
            max_steps=s["max_steps"],
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,  # TRL's default is bf16 autocast; the farm's learner trains in fp32
            seed=s["seed"],
            generation_kwargs=generation_kwargs or None,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(s["model"], local_files_only=True),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[Progress()],
        )
        trainer.train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
