"""A worker loads its tokenizer without importing torch, and gets the tokenizer it would have
got with torch (`workers.tokens.load_tokenizer`).

Every directory is loaded in two fresh processes: one as a worker starts (nothing imported
yet: the first load takes the torch-less path, and transformers stays torch-less for the
rest), one that imports torch first (`AutoTokenizer` as usual). Both must pick the same
class and encode, decode and render chat templates identically. The directories cover the
branches of `AutoTokenizer` that read the model's config: the Qwen3 and Llama 3.2 tokenizers
(tests/chat_models) with the `tokenizer_class` and `config.json` their model repositories
ship, and Mistral's SentencePiece one as saved. (Loading them is most of the test's time.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.chat_models import tokenizer_dir

PROBE = r"""
import json, sys
if sys.argv[1] == "torch":
    import torch  # noqa: F401
from workers.tokens import load_tokenizer

texts = ["Hello world", "  x = 1\n\tprint(x)  ", "<|im_end|><think>\u00e9\u4e2d</think>", "12+30="]
messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
out = {}
for directory in sys.argv[2:]:
    tok = load_tokenizer(directory)
    ids = [tok.encode(t) for t in texts]
    out[directory] = {
        "class": type(tok).__name__,
        "size": len(tok),
        "ids": ids,
        "text": [tok.decode(i) for i in ids],
        "chat": tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        "specials": tok.all_special_tokens,
    }
print(json.dumps({"torch": "torch" in sys.modules, "loaded": out}))
"""

# what the model repositories ship beside the tokenizer (Qwen3-0.6B, Llama-3.2-1B-Instruct)
REPO_CONFIGS = {
    "qwen3": ("Qwen2Tokenizer", "qwen3"),
    "llama3.2": ("PreTrainedTokenizerFast", "llama"),
}


def _probe(mode: str, directories: list[Path]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, *map(str, directories)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def _as_in_repo(family: str, into: Path) -> Path:
    """The family's tokenizer with its model repository's tokenizer_class and config.json."""
    shutil.copytree(tokenizer_dir(family), into)
    cls, model_type = REPO_CONFIGS[family]
    config = json.loads((into / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = cls
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    (into / "config.json").write_text(json.dumps({"model_type": model_type}))
    return into


def test_the_worker_tokenizer_is_autotokenizers_without_torch(tmp_path: Path) -> None:
    # a repository-like directory first: the torch-less branch reads its config.json
    directories = [_as_in_repo(name, tmp_path / name) for name in REPO_CONFIGS]
    directories.append(tokenizer_dir("mistral"))  # SentencePiece (the others are byte-level BPE)
    lean, usual = _probe("lean", directories), _probe("torch", directories)
    assert lean["torch"] is False  # the worker's loads never imported torch
    assert usual["torch"] is True
    assert set(lean["loaded"]) == set(map(str, directories))
    for directory, loaded in lean["loaded"].items():
        assert loaded == usual["loaded"][directory], directory
