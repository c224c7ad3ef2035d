"""Tokenizers: byte-level (no training), byte-level BPE trained locally, and any local Hugging Face tokenizer.

All end every document with one end-of-text token. BPE (Sennrich et al. 2016, GPT-2's
byte-level variant) is trained with Hugging Face `tokenizers` and saved as `tokenizer.json`,
which can be loaded back by path.

A Hugging Face tokenizer folder (tokenizer.json, with tokenizer_config.json and its chat template
beside it, as published with Llama, Qwen, Mistral or OLMo checkpoints) is read with `tokenizers`;
the end-of-document token is the config's `eos_token`, and any BOS the tokenizer's post-processor
adds stays. Its files are kept byte for byte (`HF_TOKENIZER_FILES`) and written unchanged into
checkpoints and exports, so the chat template and special tokens a user fine-tunes with are the
published ones.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable, Iterable, Protocol

import numpy as np

from fivefold.errors import DataError

EOT = "<|endoftext|>"
# Files of a Hugging Face tokenizer folder that travel with it, unchanged.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                      "chat_template.json")
# End-of-document tokens tried, in order, when a tokenizer.json comes without a tokenizer_config.json.
_EOS_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<|im_end|>")


def _special_token(config: dict, key: str, source: Path) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise DataError(f"{source}: {key} must be a string or {{\"content\": ...}}, not {value!r}")
    return value


def _read_tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise DataError(f"{path} is not a readable JSON tokenizer config ({str(exc)[:200]}); "
                        "fix or remove it (the end-of-document token is then guessed)") from exc
    if not isinstance(config, dict):
        raise DataError(f"{path} must hold a JSON object")
    return config


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    kind: str

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, folder: Path) -> None: ...
    def identity(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 256 ends a document."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        (Path(folder) / "tokenizer.txt").write_text("byte\n")

    def identity(self) -> str:
        return "byte"


class BPETokenizer:
    """A Hugging Face `tokenizers` byte-level BPE with an end-of-text special token."""

    kind = "bpe"

    def __init__(self, tokenizer, source: str = "", eos_token: str | None = None, bos_token: str | None = None,
                 files: dict[str, bytes] | None = None):
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        eos_token = next((t for t in candidates if tokenizer.token_to_id(t) is not None), None)
        if eos_token is None:
            raise DataError(f"tokenizer {source} has no end-of-document token ({' or '.join(candidates)}); fivefold "
                            "needs one to separate documents: set eos_token in tokenizer_config.json")
        self._tok = tokenizer
        self.eos_id = tokenizer.token_to_id(eos_token)
        self.eos_token = eos_token
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.files = files or {}  # a Hugging Face folder's files, byte for byte
        # The vocabulary includes added (special) tokens, whose ids may lie past the model vocabulary.
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True),
                              max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1)

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """A tokenizer.json file, or a Hugging Face tokenizer folder (tokenizer.json and, if present, its config)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        folder = path if path.is_dir() else None
        if folder is not None:
            path = path / "tokenizer.json"
        if not path.is_file():
            hint = " (a Hugging Face folder must hold tokenizer.json; slow sentencepiece-only tokenizers are not read)" \
                if folder is not None else ""
            raise DataError(f"tokenizer file {path} does not exist{hint}")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for a bad file
            raise DataError(f"tokenizer file {path} is not a tokenizer.json Hugging Face tokenizers can read "
                            f"({str(exc)[:200]}); give a tokenizer.json, or data.tokenizer = byte or bpe") from exc
        if folder is None:
            return cls(tokenizer, str(path))
        config = _read_tokenizer_config(folder)
        files = {name: (folder / name).read_bytes() for name in HF_TOKENIZER_FILES if (folder / name).is_file()}
        return cls(tokenizer, str(folder), _special_token(config, "eos_token", folder),
                   _special_token(config, "bos_token", folder), files)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def save(self, folder: Path) -> None:
        if self.files:  # a Hugging Face folder: its files unchanged (chat template, special tokens)
            for name, data in self.files.items():
                (Path(folder) / name).write_bytes(data)
            return
        self.save_json(Path(folder) / "tokenizer.json")

    def save_json(self, path: Path) -> None:
        self._tok.save(str(path))

    def identity(self) -> str:
        text = self._tok.to_str() + (f"\neos={self.eos_token}" if "tokenizer_config.json" in self.files else "")
        return "bpe-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def load_tokenizer_from(folder: str | Path) -> Tokenizer:
    """The tokenizer saved in a checkpoint or run folder."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return BPETokenizer.load(folder)
    if (folder / "tokenizer.txt").is_file() and (folder / "tokenizer.txt").read_text().strip() == "byte":
        return ByteTokenizer()
    raise DataError(f"{folder} holds no tokenizer (tokenizer.json or tokenizer.txt)")


def resolve_tokenizer(
    spec: str, train_texts: Callable[[], list[str]], vocab_size: int, cache_dir: Path, source_id: str
) -> Tokenizer:
    """`byte`, `bpe` (trained on the train texts, cached per source and size) or a tokenizer.json path."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        cached = Path(cache_dir) / f"bpe-{source_id}-{vocab_size}.json"
        if cached.is_file():
            return BPETokenizer.load(cached)
        tok = BPETokenizer.train(train_texts(), vocab_size)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tok.save_json(tmp)
        shutil.move(tmp, cached)
        return tok
    return BPETokenizer.load(spec)
