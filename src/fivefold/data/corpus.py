"""Where text comes from: the embedded default corpus or the user's files.

The default corpus is the Python standard library source of the running interpreter,
found through `sysconfig` (no download; every Python install carries it). Text files
(.txt, .md, .py, ...) are one document each; a .jsonl file holds one document per record,
in a configurable field.

Train/validation split is deterministic and machine-independent: a document goes to
validation when the CRC32 of its key (relative path, or `path:line` for a .jsonl record)
falls below `val_fraction` of the 32-bit range. The stdlib is therefore split by file.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from fivefold.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
JSONL_SUFFIXES = (".jsonl",)


@dataclass(frozen=True)
class SourceFile:
    key: str
    """Stable name used for the split: the path relative to its root."""
    path: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(source: str) -> list[SourceFile]:
    """Every file of a source, sorted by key: `stdlib`, or comma-separated files/folders."""
    if source == "stdlib":
        root = stdlib_root()
        files = [
            SourceFile(p.relative_to(root).as_posix(), p)
            for p in root.rglob("*.py")
            if "site-packages" not in p.parts and "__pycache__" not in p.parts
        ]
        if not files:
            raise DataError(f"found no .py files under the standard library at {root}; set data.source to your text")
        return sorted(files, key=lambda f: f.key)
    found: list[SourceFile] = []
    for part in [s.strip() for s in source.split(",") if s.strip()]:
        path = Path(part).expanduser()
        if path.is_file():
            _check_suffix(path)
            found.append(SourceFile(path.name, path))
        elif path.is_dir():
            for p in sorted(path.rglob("*")):
                if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES:
                    found.append(SourceFile(p.relative_to(path).as_posix(), p))
        else:
            raise DataError(f"data.source path {part!r} does not exist")
    if not found:
        raise DataError(
            f"data.source = {source!r} holds no text files (looked for {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)})"
        )
    return sorted(found, key=lambda f: f.key)


def _check_suffix(path: Path) -> None:
    if path.suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES:
        raise DataError(
            f"{path}: unsupported file type {path.suffix!r}; use text ({', '.join(TEXT_SUFFIXES)}) or .jsonl"
        )


def is_validation(key: str, val_fraction: float) -> bool:
    return zlib.crc32(key.encode()) < val_fraction * 2**32


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path} in data.source cannot be read ({exc.strerror}); fix its permissions or remove it") from exc
    if b"\0" in data:
        raise DataError(f"{path} in data.source holds NUL bytes: a binary file, not text; remove it from data.source")
    return data


def iter_documents(files: list[SourceFile], jsonl_field: str = "text") -> Iterator[tuple[str, str]]:
    """(split key, text) for every document, in a fixed order."""
    for f in files:
        data = _read(f.path)
        if f.path.suffix in JSONL_SUFFIXES:
            for lineno, raw in enumerate(data.split(b"\n"), 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise DataError(f"{f.path}:{lineno} is not UTF-8 text (byte {exc.start})") from exc
                except json.JSONDecodeError as exc:
                    raise DataError(f"{f.path}:{lineno} is not valid JSON: {exc}") from exc
                if not isinstance(record, dict) or jsonl_field not in record:
                    raise DataError(f"{f.path}:{lineno} has no {jsonl_field!r} field; set data.jsonl_field")
                yield f"{f.key}:{lineno}", str(record[jsonl_field])
        else:
            yield f.key, data.decode("utf-8", errors="replace")


def split_documents(
    files: list[SourceFile], val_fraction: float, jsonl_field: str = "text"
) -> tuple[list[str], list[str]]:
    """(train texts, validation texts)."""
    train, val = [], []
    for key, text in iter_documents(files, jsonl_field):
        (val if is_validation(key, val_fraction) else train).append(text)
    if not train or not val:
        raise DataError(
            f"the split gave {len(train)} train and {len(val)} validation documents; "
            "both need at least one: add documents or change data.val_fraction"
        )
    return train, val


def fingerprint(files: list[SourceFile]) -> str:
    """Cheap identity of a source: keys, sizes and modification times."""
    digest = zlib.crc32(b"")
    for f in files:
        stat = f.path.stat()
        digest = zlib.crc32(f"{f.key}|{f.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode(), digest)
    return f"{digest:08x}"
