"""`fivefold verify PATH`: check checkpoints and exports offline, file by file, without loading a model.

    a step-* folder    every file against its manifest, and every part parsed the way a resume
                       reads it (config, layout, trainer state, RNG, DCP index without unpickling)
    a run folder       each of its checkpoints, newest first: which ones `--resume auto` could use
    an export          a folder written by `fivefold convert`: every file against fivefold-manifest.json

One line per checkpoint: OK with its size and the hashing rate, or BAD with the first damaged file.
The exit code is 0 only if everything checked is sound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import CheckpointError
from fivefold.reliability.manifest import EXPORT_MANIFEST, Manifest


@dataclass
class Report:
    path: Path
    ok: bool
    detail: str


def _timed(path: Path, check) -> Report:
    start = time.perf_counter()
    try:
        checked = check()
    except CheckpointError as exc:
        return Report(path, False, str(exc))
    seconds = time.perf_counter() - start
    return Report(path, True, f"{checked.files} files, {checked.bytes / 1e9:.3f} GB in {seconds:.2f} s "
                              f"({checked.bytes / 1e9 / max(seconds, 1e-9):.2f} GB/s)")


@dataclass
class _Checked:
    files: int
    bytes: int


def _checkpoint(folder: Path) -> _Checked:
    from fivefold.train.checkpoint import verify_checkpoint

    manifest = verify_checkpoint(folder)
    return _Checked(len(manifest.files), sum(e["bytes"] for e in manifest.files.values()))


def _export(folder: Path) -> _Checked:
    manifest = Manifest.load(folder, EXPORT_MANIFEST, f"export {folder}")
    return _Checked(len(manifest.files), manifest.verify_all())


def verify_path(path: str | Path) -> list[Report]:
    from fivefold.train.checkpoint import STEP_DIR

    path = Path(path)
    if not path.is_dir():
        return [Report(path, False, "no such folder")]
    if (path / EXPORT_MANIFEST).is_file():
        return [_timed(path, lambda: _export(path))]
    if (path / "meta.json").is_file() or STEP_DIR.match(path.name):
        return [_timed(path, lambda: _checkpoint(path))]
    steps = sorted((p for p in path.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name, reverse=True)
    if not steps:
        return [Report(path, False, "holds no step-* checkpoint and is not a fivefold export")]
    return [_timed(folder, lambda folder=folder: _checkpoint(folder)) for folder in steps]


def format_reports(reports: list[Report]) -> str:
    return "\n".join(f"{'OK ' if r.ok else 'BAD'}  {r.path}  {r.detail}" for r in reports)
