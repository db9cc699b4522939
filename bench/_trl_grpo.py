"""The TRL side of `bench e2e`: GRPOTrainer on the toy task, run inside the TRL venv.

`python -m bench._trl_grpo SETTINGS_JSON` trains the tiny model with TRL's
`GRPOTrainer` on CPU and prints one JSON line per optimizer step
(``{"step", "reward", "t"}``, ``t`` = `time.time()`), stopping once the mean reward
of the last `window` steps reaches `target` or after `max_steps`. The task matches
the farm's: toy observations rendered with the model's own chat template, one
completion token restricted to the digits and the stop tokens (what the farm's
workers allow through `action_vocabulary`), reward 1 for the right digit, group-
normalised advantages, no KL term. It imports only TRL, transformers, datasets and
this repository's `envs`/`workers.tokens`, so it runs in a venv layered over the
project's.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any


def _dataset(n: int, seed: int) -> Any:
    from datasets import Dataset

    import envs

    env = envs.make('toy@{"difficulty": 0}')
    rows = []
    for i in range(n):
        obs, _ = env.reset(seed=seed * 1_000_003 + i)
        rows.append({"prompt": [{"role": "user", "content": obs}], "answer": obs})
    return Dataset.from_list(rows)


def _reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, answer, strict=True)]


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.toy import DIGITS
    from workers.tokens import ChatCodec

    s = json.loads(Path(argv[0]).read_text())
    tok = AutoTokenizer.from_pretrained(s["model"], local_files_only=True)
    allowed = set(ChatCodec(tok).allowed_token_ids(DIGITS) or ())
    suppress = [i for i in range(len(tok)) if i not in allowed]
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

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            learning_rate=s["learning_rate"],
            per_device_train_batch_size=s["group_size"] * s["groups_per_batch"],
            num_generations=s["group_size"],
            max_completion_length=1,
            temperature=1.0,
            lr_scheduler_type="constant_with_warmup",  # the farm's: linear warm-up, then flat
            warmup_steps=s["warmup_steps"],
            gradient_checkpointing=False,
            beta=0.0,
            max_steps=s["max_steps"],
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=s["seed"],
            generation_kwargs={"suppress_tokens": suppress},
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(s["model"], local_files_only=True),
            reward_funcs=_reward,
            args=config,
            train_dataset=_dataset(s["max_steps"] * s["groups_per_batch"] + 64, s["seed"]),
            processing_class=tok,
            callbacks=[Progress()],
        )
        trainer.train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
