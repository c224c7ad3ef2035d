"""Per-rank heartbeats and the watchdog that reads them: hung ranks, stalled collectives, a dead launcher.

Every rank runs one daemon thread that, every `watchdog.heartbeat_s` seconds, atomically rewrites
`<output_dir>/heartbeats/rank-NNNNN.json` with a beat counter and what the rank is doing
(reliability/activity.py: step, phase stack per thread, communication sequence number). Rank 0
watches every rank and rank 1 watches rank 0; a watcher judges a peer by whether its beat counter
*changes*, timed on the watcher's own monotonic clock, so clocks of different machines never meet.

    rank hung          a peer's beat has not changed for 1.5 heartbeats: its whole process is
                       stopped (SIGSTOP, a frozen machine) or gone; named with its last step and
                       phase. Detection takes at most 1.5 + 0.25 heartbeats after the stop.
    collective stall   a rank's main thread has waited in one communication phase for longer than
                       `watchdog.collective_timeout_s`: the ranks elsewhere (in compute, or behind
                       in the sequence) are named as the culprits, every rank's phase listed
    launcher died      this rank's parent (the torchrun agent) is gone: exit (PR_SET_PDEATHSIG does
                       this at once on Linux, reliability/lifeline.py; this is the portable backstop)

On a verdict the watcher prints the report, writes it to `<output_dir>/failure.json` and its
events log (for `fivefold diagnose`), then kills a stopped peer on the same host (so the launcher
can tear the job down instead of waiting on it), and exits the process with EXIT_FAULT; torchrun
then stops the others (and restarts them, with `--max-restarts`). Ranks that finish or fail on
their own write a last record saying so, and are not judged. The training thread also rewrites
the record at every step start, so the step a rank stopped in is exact.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fivefold.errors import EXIT_FAULT  # noqa: F401 - the exit of a verdict
from fivefold.reliability.activity import ACTIVITY



def heartbeat_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank:05d}.json"


def read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str:
    """'stopped', 'gone', 'zombie' or 'running' for a process on this host (/proc on Linux, else a signal-0 probe)."""
    if Path("/proc/self/stat").exists():
        try:
            code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "gone"
        return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(code, "running")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass
    return "running"


def describe_record(record: dict, age: float | None = None) -> str:
    """One line: where a rank was (its main thread's phase stack) by its last heartbeat."""
    threads = record.get("threads", {})
    main = threads.get("MainThread") or next(iter(threads.values()), None)
    where = " > ".join(main["phases"]) if main else "outside any phase"
    wait = f", {main['age_s']:.1f} s in it" if main else ""
    comm = f", comm seq {main['seq']}" if main and main.get("comm") else ""
    stale = f"; heartbeat {age:.1f} s old" if age is not None else ""
    return (f"rank {record.get('rank')} (pid {record.get('pid')} on {record.get('host')}): step {record.get('step')}, "
            f"{where}{comm}{wait}{stale}")


@dataclass
class Verdict:
    kind: str  # rank_hung | rank_died | collective_timeout | launcher_died
    culprits: list[int]
    lines: list[str]
    step: int | None = None
    latency_s: float | None = None
    stopped_pid: int | None = None  # a stopped peer on this host, killed once the verdict is on record


@dataclass
class _Seen:
    beat: int = -1
    changed: float = 0.0  # monotonic time the beat last changed
    record: dict = field(default_factory=dict)


class Heartbeat(threading.Thread):
    """The heartbeat writer and watchdog of one rank (a daemon thread)."""

    def __init__(self, folder: Path, rank: int, world_size: int, attempt_id: str, period: float,
                 collective_timeout: float, on_verdict: Callable[[Verdict], None], parent_pid: int | None = None,
                 watch: bool = True):
        super().__init__(name="fivefold-heartbeat", daemon=True)
        self.folder, self.rank, self.world_size = Path(folder), rank, world_size
        self.attempt_id, self.period, self.collective_timeout = attempt_id, period, collective_timeout
        self.on_verdict, self.parent_pid = on_verdict, parent_pid
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.watched = ([r for r in range(world_size) if r != rank] if rank == 0 else [0] if rank == 1 else []) if watch else []
        self.beat = 0
        self.state = "running"
        self._halt = threading.Event()
        self._seen: dict[int, _Seen] = {}
        self._began = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.write()

    # ------------------------------------------------------------------ this rank's record
    def record(self) -> dict:
        snapshot = ACTIVITY.snapshot()
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "attempt_id": self.attempt_id,
                "beat": self.beat, "time": time.time(), "state": self.state, "period_s": self.period, **snapshot}

    def write(self) -> None:
        path = heartbeat_path(self.folder, self.rank)
        tmp = path.with_name(f".{path.name}.{self.pid}.{threading.get_ident()}.tmp")
        try:
            try:
                tmp.write_text(json.dumps(self.record()))
            except FileNotFoundError:  # the folder was removed under us: make it again, or no beat would ever land
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(self.record()))
            os.replace(tmp, path)
        except OSError:
            pass  # a full or vanished disk must not kill training from here; the next beat tries again

    def refresh(self) -> None:
        """Rewrite the record from the training thread at every step start: where a rank that then stops
        was is known to the step, not to the last beat (a small file; steps at scale take seconds)."""
        self.write()

    def finish(self, state: str) -> None:
        """A last record ('finished' or 'failed'): watchers stop judging this rank."""
        self.state = state
        self._halt.set()
        self.beat += 1
        self.write()

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        next_beat = time.monotonic() + self.period
        while not self._halt.wait(self.period / 4):
            now = time.monotonic()
            if now >= next_beat:
                self.beat += 1
                self.write()
                next_beat = now + self.period
            verdict = self.check_parent() or self.check_peers(now)
            if verdict is not None and not self._halt.is_set():
                self.on_verdict(verdict)
                return

    def check_parent(self) -> Verdict | None:
        if self.parent_pid is None or os.getppid() == self.parent_pid:
            return None
        return Verdict("launcher_died", [], [f"fivefold: rank {self.rank}: the launcher (pid {self.parent_pid}) is gone; "
                                             "exiting so no worker trains on alone"], ACTIVITY.step)

    def check_peers(self, now: float) -> Verdict | None:
        records: dict[int, dict] = {}
        for peer in self.watched:
            record = read_record(heartbeat_path(self.folder, peer))
            seen = self._seen.setdefault(peer, _Seen(changed=self._began))
            if record is None or record.get("attempt_id") != self.attempt_id:
                if now - self._began > 3 * self.period + 5:  # never appeared in this attempt
                    return Verdict("rank_hung", [peer], [f"fivefold watchdog: rank {peer} never wrote a heartbeat in "
                                                         f"{now - self._began:.0f} s: it is hung or never started"],
                                   ACTIVITY.step)
                continue
            if record.get("state") != "running":
                continue
            records[peer] = record
            if record["beat"] != seen.beat:
                seen.beat, seen.changed, seen.record = record["beat"], now, record
            elif now - seen.changed > 1.5 * self.period:
                return self._hung(peer, record, now - seen.changed, records)
        if self.rank == 0 and self.world_size > 1:
            return self._stall(records)
        return None

    def _everyone(self, records: dict[int, dict]) -> dict[int, dict]:
        mine = self.record()
        return {self.rank: mine, **{r: read_record(heartbeat_path(self.folder, r)) or {} for r in range(self.world_size)
                                     if r != self.rank and r not in records}, **records}

    def _hung(self, peer: int, record: dict, silent: float, records: dict[int, dict]) -> Verdict:
        same_host = record.get("host") == self.host
        state = process_state(record["pid"]) if same_host else "unknown (another host)"
        kind = "rank_died" if state in ("gone", "zombie") else "rank_hung"
        what = {"stopped": "its process is stopped (SIGSTOP or a debugger)", "gone": "its process is gone",
                "zombie": "its process has exited", "running": "its process runs but its threads are frozen"}.get(state, state)
        lines = [f"fivefold watchdog: rank {peer} {'died' if kind == 'rank_died' else 'is hung'}: no heartbeat for "
                 f"{silent:.1f} s ({what})", f"  last seen: {describe_record(record)}", "  every rank:"]
        lines += [f"    {describe_record(r)}" for _, r in sorted(self._everyone(records).items()) if r]
        stopped = record["pid"] if same_host and state == "stopped" else None
        if stopped is not None:
            lines.append(f"  killing the stopped process {stopped} so the job can end (or restart)")
        return Verdict(kind, [peer], lines, record.get("step"), silent, stopped)

    def _stall(self, records: dict[int, dict]) -> Verdict | None:
        everyone = self._everyone(records)
        waiting = {}
        for rank, record in everyone.items():
            main = (record.get("threads") or {}).get("MainThread")
            if record.get("state") == "running" and main and main.get("comm") and main["age_s"] > self.collective_timeout:
                waiting[rank] = main
        if not waiting:
            return None
        running = {r: rec for r, rec in everyone.items() if rec.get("state") == "running"}
        elsewhere = [r for r in running if r not in waiting]
        if not elsewhere:  # all wait: the ones behind in the sequence are the culprits, else a deadlock of equals
            low = min(m["seq"] for m in waiting.values())
            elsewhere = [r for r, m in waiting.items() if m["seq"] == low] if len({m["seq"] for m in waiting.values()}) > 1 else []
        first = min(waiting, key=lambda r: (-waiting[r]["age_s"], r))
        lines = [f"fivefold watchdog: collective stalled: rank {first} has waited {waiting[first]['age_s']:.0f} s in "
                 f"{' > '.join(waiting[first]['phases'])} (watchdog.collective_timeout_s = {self.collective_timeout:g})",
                 (f"  likely culprit(s): rank {', '.join(map(str, elsewhere))} (not in that collective)" if elsewhere
                  else "  every rank waits in the same collective: a deadlock among them"), "  every rank:"]
        lines += [f"    {describe_record(r)}" for _, r in sorted(everyone.items()) if r]
        return Verdict("collective_timeout", elsewhere, lines, everyone[first].get("step"), waiting[first]["age_s"])


def print_verdict(verdict: Verdict) -> None:
    print("\n".join(verdict.lines), file=sys.stderr, flush=True)
