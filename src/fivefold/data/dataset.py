"""Pre-tokenised token files (memory-mapped) and the stateless, resumable batch sampler.

Token file layout (little-endian), 64-byte header then the tokens:
    magic b"FFTOKENS" | version u32 | vocab_size u32 | itemsize u32 | reserved u32 |
    count u64 | blake2b-128 checksum of the token bytes (16 B) | zero padding
Tokens are uint16 when the vocabulary fits, else uint32. A file whose size, vocabulary or
checksum disagrees with its header or with the tokenizer is refused with the fix in the
message, never read as silent garbage.

The sampler is a pure function of (seed, step, dp_rank, micro_step): the batch of any step can
be recomputed from scratch, so a resumed run reads exactly what the uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fivefold.config import DataConfig
from fivefold.data.corpus import fingerprint, list_source_files, split_documents
from fivefold.data.tokenizer import ByteTokenizer, Tokenizer, resolve_tokenizer
from fivefold.errors import DataError
from fivefold.progress import announce

MAGIC = b"FFTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQ16s")
HEADER_BYTES = 64
_CHUNK = 1 << 24


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _checksum(tokens: np.ndarray) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    flat = tokens.reshape(-1).view(np.uint8)
    for start in range(0, flat.size, _CHUNK):
        digest.update(flat[start : start + _CHUNK])
    return digest.digest()


def write_token_file(path: str | Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Write atomically: a temporary file in the same folder, fsynced, then renamed."""
    path = Path(path)
    dtype = token_dtype(vocab_size)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise DataError(f"token id {int(tokens.max())} does not fit vocabulary size {vocab_size}")
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    header = HEADER.pack(MAGIC, VERSION, vocab_size, dtype.itemsize, 0, tokens.size, _checksum(tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(header.ljust(HEADER_BYTES, b"\0"))
        handle.write(tokens.tobytes())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_token_file(path: str | Path, expected_vocab: int | None = None, verify: bool = True) -> np.memmap:
    """Memory-map a token file after checking its header, size, vocabulary and checksum."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist")
    size = path.stat().st_size
    fix = f"delete {path} and it will be rebuilt from the corpus"
    if size < HEADER_BYTES:
        raise DataError(f"token file {path} is truncated ({size} bytes, shorter than its header); {fix}")
    with open(path, "rb") as handle:
        magic, version, vocab, itemsize, _, count, checksum = HEADER.unpack(handle.read(HEADER.size))
    if magic != MAGIC or version != VERSION:
        raise DataError(f"{path} is not a fivefold token file (version {VERSION}); {fix}")
    if itemsize != token_dtype(vocab).itemsize:
        raise DataError(f"token file {path} declares {itemsize}-byte tokens for vocabulary {vocab}; {fix}")
    expected_size = HEADER_BYTES + count * itemsize
    if size != expected_size:
        raise DataError(
            f"token file {path} is truncated or padded: header says {count} tokens ({expected_size} bytes), "
            f"file has {size} bytes; {fix}"
        )
    if expected_vocab is not None and vocab != expected_vocab:
        raise DataError(
            f"token file {path} was made for vocabulary size {vocab} but the tokenizer has {expected_vocab}; "
            f"it belongs to another tokenizer: {fix}"
        )
    tokens = np.memmap(path, dtype=token_dtype(vocab), mode="r", offset=HEADER_BYTES, shape=(count,))
    if verify and _checksum(tokens) != checksum:
        raise DataError(f"token file {path} fails its checksum (corrupted); {fix}")
    return tokens


def token_file_fingerprint(path: str | Path) -> str:
    """The checksum and token count a token file's header records: identifies the data a run trains on."""
    with open(path, "rb") as handle:
        _, _, _, _, _, count, checksum = HEADER.unpack(handle.read(HEADER.size))
    return f"{checksum.hex()}:{count}"


def tokenize_documents(texts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenate the documents' tokens, each followed by end-of-text."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    if isinstance(tokenizer, ByteTokenizer):
        encoded = (tokenizer.encode_array(t) for t in texts)
    else:
        encoded = (np.asarray(ids) for ids in tokenizer.encode_batch(texts))
    for ids in encoded:
        pieces.append(ids.astype(dtype, copy=False))
        pieces.append(eos)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    train_path: Path
    val_path: Path

    @property
    def fingerprint(self) -> str:
        return token_file_fingerprint(self.train_path)


def prepare_data(config: DataConfig, log: Callable[[str], None] | None = None) -> PreparedData:
    """Resolve the tokenizer and the cached train/val token files, building them once if missing.

    `log` hears of any phase that takes more than a few seconds (reading and splitting the
    corpus, training a BPE tokenizer, tokenising, verifying the cache).
    """
    files = list_source_files(config.source)
    source_id = f"{fingerprint(files)}-v{int(config.val_fraction * 1e6)}"
    cache = Path(config.cache_dir)
    texts: dict[str, list[str]] = {}

    def split() -> tuple[list[str], list[str]]:
        if "train" not in texts:
            with announce(f"reading {len(files):,} files of data.source", log):
                texts["train"], texts["val"] = split_documents(files, config.val_fraction, config.jsonl_field)
        return texts["train"], texts["val"]

    with announce(f"training a {config.bpe_vocab_size:,}-token BPE tokenizer" if config.tokenizer == "bpe"
                  else "loading the tokenizer", log):
        tokenizer = resolve_tokenizer(config.tokenizer, lambda: split()[0], config.bpe_vocab_size, cache, source_id)
    stem = f"tokens-{source_id}-{tokenizer.identity()}"
    paths = {name: cache / f"{stem}-{name}.bin" for name in ("train", "val")}
    if not all(p.is_file() for p in paths.values()):
        train_texts, val_texts = split()
        for name, docs in (("train", train_texts), ("val", val_texts)):
            with announce(f"tokenising the {name} split ({len(docs):,} documents) into {paths[name]}", log):
                write_token_file(paths[name], tokenize_documents(docs, tokenizer), tokenizer.vocab_size)
    with announce("verifying the token cache", log):
        loaded = {name: read_token_file(p, expected_vocab=tokenizer.vocab_size) for name, p in paths.items()}
    return PreparedData(tokenizer, loaded["train"], loaded["val"], paths["train"], paths["val"])


def sample_batch(
    tokens: np.ndarray,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    step: int,
    micro_step: int = 0,
    grad_accum_steps: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of random windows; a pure function of (seed, step, dp_rank, micro_step).

    The step's global batch (micro x accum x dp windows) is drawn from a generator keyed by
    (seed, step) alone, and each (micro_step, dp_rank) takes its slice of it: so the same
    global batch is seen however it is split across accumulation steps and ranks.
    Returns (inputs, labels), int64 of shape (micro_batch_size, seq_len), labels shifted by one.
    """
    windows = len(tokens) - seq_len
    if windows < 1:
        raise DataError(
            f"the split has {len(tokens)} tokens, too few for train.seq_len = {seq_len}: "
            "use more text or a shorter sequence"
        )
    if not (0 <= micro_step < grad_accum_steps and 0 <= dp_rank < dp_size):
        raise ValueError(f"micro_step {micro_step} / dp_rank {dp_rank} out of range")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, windows, size=micro_batch_size * grad_accum_steps * dp_size)
    first = (micro_step * dp_size + dp_rank) * micro_batch_size
    return _gather(tokens, starts[first : first + micro_batch_size], seq_len)


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced windows over the validation split: the same every evaluation."""
    windows = len(tokens) - seq_len
    if windows < 1:
        raise DataError(f"the validation split has {len(tokens)} tokens, too few for train.seq_len = {seq_len}")
    starts = np.linspace(0, windows - 1, num_batches * batch_size).astype(np.int64)
    return [_gather(tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(num_batches)]


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    batch = torch.from_numpy(rows)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def unigram_cross_entropy(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Validation cross-entropy (nats/token) of an add-one-smoothed unigram model fit on train."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[np.asarray(val_tokens, dtype=np.int64)].mean())
