"""Checksummed manifests: every file of a checkpoint or export, its size and its hash, verified on read.

A checkpoint's `meta.json` is its manifest and is written last, after every other file is on disk
and fsynced; its presence marks the checkpoint complete. It records, for every file, the byte
count and a hash of the content, and a hash of its own canonical JSON, so a damaged manifest is
told apart from a damaged file:

    {"format": 3, "step": 200, "run_id": "...", "written_at": 1763900000.0, "hash": "xxh3-128",
     "files": {"state/__0_0.distcp": {"bytes": 1234, "hash": "9f..."}, ...}, "self": "4b..."}

The hash is xxh3-128 (xxHash, a well-kept non-cryptographic hash): against accidental damage (a
flipped bit, a torn write, a truncated copy) any 128-bit hash is as good as SHA-256, and it runs
several times faster (benchmarks/checksums.py measures both here; docs/reliability.md has the
figures). Against a deliberate attacker no unsigned manifest helps, since the attacker rewrites it
too: that threat is met by never running code from a file (reliability/safe_dcp.py). SHA-256
manifests are read as well (`hash = "sha256"`).

Readers go through `Manifest`: `read_bytes(name)` hashes the bytes it returns, so what is checked
is what is parsed; `verify(name)` streams a large file once before a library reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import xxhash

from fivefold.errors import CheckpointError

DEFAULT_HASH = "xxh3-128"
EXPORT_MANIFEST = "fivefold-manifest.json"  # the manifest of a folder written by `fivefold convert`
_HASHERS: dict[str, Callable[[], object]] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_CHUNK = 8 << 20


def hash_bytes(data: bytes | memoryview, algorithm: str = DEFAULT_HASH) -> str:
    hasher = _HASHERS[algorithm]()
    hasher.update(data)
    return hasher.hexdigest()


def hash_file(path: Path, algorithm: str = DEFAULT_HASH) -> str:
    """Hash of a file's content, read in 8 MiB chunks."""
    hasher = _HASHERS[algorithm]()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def file_entry(path: Path, algorithm: str = DEFAULT_HASH) -> dict:
    return {"bytes": path.stat().st_size, "hash": hash_file(path, algorithm)}


def _self_hash(body: dict, algorithm: str) -> str:
    return hash_bytes(json.dumps(body, sort_keys=True).encode(), algorithm)


def manifest_json(body: dict, algorithm: str = DEFAULT_HASH) -> str:
    """The manifest text: `body` (which holds "files") plus its algorithm and its own hash."""
    body = {**body, "hash": algorithm}
    return json.dumps({**body, "self": _self_hash(body, algorithm)}, indent=1, sort_keys=True)


def write_manifest(folder: Path, body: dict, known: dict[str, dict] | None = None, name: str = "meta.json",
                   algorithm: str = DEFAULT_HASH) -> Path:
    """Hash every file below `folder` (except those already in `known`) and write the manifest last, fsynced."""
    folder = Path(folder)
    files = dict(known or {})
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if relative != name and relative not in files:
            files[relative] = file_entry(path, algorithm)
    target = folder / name
    write_file(target, manifest_json({**body, "files": files}, algorithm).encode())
    return target


def write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write, fsync, set permissions: for files inside a folder that is renamed into place afterwards."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(path, mode)


@dataclass
class Manifest:
    """A verified manifest of `folder`; every read through it checks the file against its entry."""

    folder: Path
    body: dict
    label: str  # how errors name the checkpoint: "checkpoint runs/x/step-000200 (step 200)"

    @classmethod
    def load(cls, folder: Path, name: str = "meta.json", label: str | None = None) -> "Manifest":
        folder = Path(folder)
        path = folder / name
        label = label or f"{folder}"
        if not path.is_file():
            raise CheckpointError(f"{label}: no {name} (the manifest written last): the save did not finish; "
                                  "use an earlier checkpoint")
        try:
            body = json.loads(path.read_bytes().decode("utf-8"))
            files, algorithm, recorded = body["files"], body["hash"], body.pop("self")
            if not isinstance(files, dict) or algorithm not in _HASHERS:
                raise ValueError("files or hash of an unknown form")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{label}: {path} is not a readable manifest ({exc}); the checkpoint is damaged: "
                                  "use an earlier one") from exc
        if _self_hash(body, algorithm) != recorded:
            raise CheckpointError(f"{label}: {path} fails its own checksum: the manifest is damaged; use an earlier "
                                  "checkpoint")
        return cls(folder, body, label)

    @property
    def files(self) -> dict[str, dict]:
        return self.body["files"]

    @property
    def algorithm(self) -> str:
        return self.body["hash"]

    def _entry(self, name: str) -> dict:
        entry = self.files.get(name)
        if entry is None:
            raise CheckpointError(f"{self.label}: {name} is not listed in its manifest; the checkpoint is damaged "
                                  "or was altered")
        return entry

    def _path(self, name: str) -> Path:
        path = self.folder / name
        if not path.is_file():
            raise CheckpointError(f"{self.label}: {name} is missing; the checkpoint is damaged: use an earlier one")
        return path

    def _mismatch(self, name: str, what: str) -> CheckpointError:
        return CheckpointError(f"{self.label}: {name} {what}: the file is damaged; use an earlier checkpoint "
                               f"(`fivefold verify {self.folder.parent}` lists the good ones)")

    def read_bytes(self, name: str) -> bytes:
        """The file's content, after checking its size and hash against the manifest."""
        entry = self._entry(name)
        data = self._path(name).read_bytes()
        if len(data) != entry["bytes"]:
            raise self._mismatch(name, f"has {len(data)} bytes, its manifest says {entry['bytes']}")
        if hash_bytes(data, self.algorithm) != entry["hash"]:
            raise self._mismatch(name, "fails its checksum")
        return data

    def read_json(self, name: str):
        try:
            return json.loads(self.read_bytes(name).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.label}: {name} is not valid JSON ({exc})") from exc

    def verify(self, name: str) -> None:
        """Stream one listed file and check it (for files a library opens itself)."""
        entry = self._entry(name)
        path = self._path(name)
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise self._mismatch(name, f"has {size} bytes, its manifest says {entry['bytes']}")
        if hash_file(path, self.algorithm) != entry["hash"]:
            raise self._mismatch(name, "fails its checksum")

    def verify_all(self) -> int:
        """Check every listed file; returns the bytes checked."""
        for name in sorted(self.files):
            self.verify(name)
        return sum(entry["bytes"] for entry in self.files.values())


def readable_tree(folder: Path) -> None:
    """Files 0644 and folders 0755 below `folder`, whatever the umask or a temporary file's mode was."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            os.chmod(Path(root) / name, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
        for name in dirs:
            os.chmod(Path(root) / name, 0o755)
    os.chmod(folder, 0o755)
