"""Tokenizers: byte-level (no training) and byte-level BPE trained locally.

Both end every document with one end-of-text token. BPE (Sennrich et al. 2016, GPT-2's
byte-level variant) is trained with Hugging Face `tokenizers` and saved as `tokenizer.json`,
which can be loaded back by path.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Callable, Iterable, Protocol

import numpy as np

from fivefold.errors import DataError

EOT = "<|endoftext|>"


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

    def __init__(self, tokenizer, source: str = ""):
        eos = tokenizer.token_to_id(EOT)
        if eos is None:
            raise DataError(f"tokenizer {source or ''} has no {EOT} token; fivefold needs it to separate documents")
        self._tok = tokenizer
        self.eos_id = eos
        self.vocab_size = tokenizer.get_vocab_size()

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
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for a bad file
            raise DataError(f"tokenizer file {path} is not a tokenizer.json Hugging Face tokenizers can read "
                            f"({str(exc)[:200]}); give a tokenizer.json, or data.tokenizer = byte or bpe") from exc
        return cls(tokenizer, str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def save(self, folder: Path) -> None:
        self.save_json(Path(folder) / "tokenizer.json")

    def save_json(self, path: Path) -> None:
        self._tok.save(str(path))

    def identity(self) -> str:
        return "bpe-" + hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]


def load_tokenizer_from(folder: str | Path) -> Tokenizer:
    """The tokenizer saved in a checkpoint or run folder."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return BPETokenizer.load(folder / "tokenizer.json")
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
