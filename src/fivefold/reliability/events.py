"""The run's own record of what happened: per-rank event logs and the last failure verdict.

    <output_dir>/events/rank-NNNNN.jsonl   one JSON object per line, appended and flushed: start
                                           (attempt, world size, resumed from), checkpoint saved,
                                           step skipped, rollback, the error that ended the rank
                                           (its class, message and traceback tail), finish
    <output_dir>/failure.json              the verdict of the component that stopped the run (the
                                           watchdog, the guard, or a rank's error): kind, culprit
                                           ranks, step, the report lines; the launcher prints it
    <output_dir>/launcher.jsonl            the launcher's own events: start, each failed attempt
                                           with every rank's exit code or signal, restarts

`fivefold diagnose` (reliability/diagnose.py) reads these with the heartbeats and metrics.jsonl.
Each rank writes only its own file, so nothing is shared between processes but the folder.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any


def events_path(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / "events" / f"rank-{rank:05d}.jsonl"


class EventLog:
    """Appends events of one rank; never raises (a full disk must not turn a report into a second failure)."""

    def __init__(self, output_dir: Path, rank: int, attempt: int = 0):
        self.path, self.rank, self.attempt = events_path(output_dir, rank), rank, attempt

    def log(self, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "rank": self.rank, "attempt": self.attempt, "event": event, **fields}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record, default=str) + "\n")
        except OSError:
            pass

    def error(self, exc: BaseException, step: int | None) -> None:
        """The exception that ends this rank: its type, message, errno and the last frames."""
        tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:]
        cause = exc.__cause__ or exc.__context__
        self.log("error", step=step, type=type(exc).__name__, message=str(exc)[:2000],
                 errno=getattr(exc, "errno", None) or getattr(cause, "errno", None),
                 cause=type(cause).__name__ if cause is not None else None, traceback="".join(tail)[-4000:])


def write_failure(output_dir: Path, verdict: dict[str, Any]) -> None:
    """failure.json, atomically; the first verdict of an attempt is kept (a later one is usually a consequence)."""
    path = Path(output_dir) / "failure.json"
    try:
        existing = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        existing = None
    if existing and existing.get("attempt_id") == verdict.get("attempt_id"):
        return
    tmp = path.with_name(f".failure.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"time": time.time(), **verdict}, indent=1, default=str))
        os.replace(tmp, path)
    except OSError:
        pass


def read_failure(output_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(output_dir) / "failure.json").read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn or damaged line is skipped."""
    out = []
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
