"""`fivefold diagnose RUN_DIR`: how a run ended, which rank is to blame, and the lines that show it.

Reads what a run leaves in its folder, all written by fivefold itself:

    failure.json           the verdict of whoever detected the fault first (watchdog, guard, a rank's error)
    events/rank-*.jsonl    each rank's start, bad steps, rollbacks, its error (type, message, errno), finish
    heartbeats/rank-*.json each rank's last step and phase, and whether it finished, failed or went silent
    launcher.jsonl         each failed attempt with every failed rank's exit code or signal
    metrics.jsonl          the loss, skipped steps

and names one class, checked in this order (the first that matches wins):

    completed            every rank of the last attempt finished
    config_error         settings refused at start (ConfigError)
    data_error           a corpus, tokenizer or token file that cannot be used (DataError)
    checkpoint_corrupt   a checkpoint that fails its checksums or cannot be read (CheckpointError)
    disk_full            a write failed with ENOSPC
    out_of_memory        MemoryError / torch.OutOfMemoryError
    loss_spike           the guard stopped the run on loss spikes
    non_finite           the guard stopped the run on non-finite losses or gradients
    rank_hung            the watchdog found a rank that stopped heart-beating (stopped, frozen)
    collective_timeout   the watchdog (or a process group) timed out waiting in a collective
    rank_died            a rank was killed by a signal (SIGKILL: the OOM killer, an operator, a crash)
    launcher_died        the launcher vanished without a record and every rank stopped at once
    exception            a rank raised something fivefold does not expect (a bug: the traceback is shown)
    unknown              not enough evidence (the folder of a run that never started?)

benchmarks/diagnosis.py injects each class into tiny runs and reports the accuracy over the corpus.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.reliability.events import read_failure, read_jsonl

ADVICE = {
    "completed": "nothing to fix",
    "config_error": "fix the named setting and start again",
    "data_error": "fix the named file or data setting; a damaged token cache is rebuilt once deleted",
    "checkpoint_corrupt": "resume from an earlier checkpoint (`fivefold verify RUN_DIR` lists the good ones; "
                          "--resume auto skips damaged ones by itself)",
    "disk_full": "free space in the output folder or lower checkpoint.keep_last; the earlier checkpoints are intact",
    "out_of_memory": "lower train.micro_batch_size or train.seq_len, use train.recompute, or shard the model",
    "loss_spike": "lower optim.lr, raise optim.warmup_steps or guard.spike_zscore, check the data of those steps",
    "non_finite": "lower optim.lr, check the data around the step; guard.rollback_lr_factor < 1 lowers it per rollback",
    "rank_hung": "the named rank's process was stopped or its machine froze; --max-restarts restarts the job",
    "collective_timeout": "the named rank did not reach the collective the others waited in (stuck compute, a "
                          "deadlock, or a bug that issues collectives in another order); --max-restarts restarts",
    "rank_died": "the named rank was killed (OOM killer, operator, node failure); --max-restarts restarts the job",
    "launcher_died": "the launcher (torchrun) was killed; the workers ended with it; resume with --resume auto",
    "exception": "a bug: the traceback is in the evidence; rerun with --debug, and please report it",
    "unknown": "no failure record found; was this folder a fivefold run?",
}
ERROR_CLASSES = {"ConfigError": "config_error", "DataError": "data_error", "CheckpointError": "checkpoint_corrupt",
                 "MemoryError": "out_of_memory", "OutOfMemoryError": "out_of_memory"}


@dataclass
class Diagnosis:
    kind: str
    culprits: list[int] = field(default_factory=list)
    step: int | None = None
    evidence: list[str] = field(default_factory=list)

    @property
    def advice(self) -> str:
        return ADVICE[self.kind]


@dataclass
class RunRecords:
    folder: Path
    failure: dict | None
    events: dict[int, list[tuple[int, dict]]]  # rank -> (line number, record) of the last attempt
    heartbeats: dict[int, dict]
    launcher: list[tuple[int, dict]]

    @classmethod
    def read(cls, folder: Path) -> "RunRecords":
        events: dict[int, list[tuple[int, dict]]] = {}
        for path in sorted((folder / "events").glob("rank-*.jsonl")):
            records = list(enumerate(read_jsonl(path), 1))
            starts = [i for i, (_, r) in enumerate(records) if r.get("event") == "start"]
            events[int(path.stem.split("-")[1])] = records[starts[-1]:] if starts else records
        heartbeats = {}
        for path in sorted((folder / "heartbeats").glob("rank-*.json")):
            try:
                heartbeats[int(path.stem.split("-")[1])] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        launcher = list(enumerate(read_jsonl(folder / "launcher.jsonl"), 1))
        starts = [i for i, (_, r) in enumerate(launcher) if r.get("event") == "start"]
        launcher = launcher[starts[-1]:] if starts else []  # the launcher of the latest job only
        runs = cls(folder, read_failure(folder), events, heartbeats, launcher)
        first = min((r["time"] for recs in events.values() for _, r in recs if r.get("event") == "start"), default=None)
        if launcher and first is not None and launcher[0][1].get("time", 0) > first:
            runs.launcher = []  # that launcher started after this run: not this run's
        return runs

    def last_attempt_id(self) -> str | None:
        starts = [(r["time"], r.get("attempt_id")) for recs in self.events.values() for _, r in recs if r.get("event") == "start"]
        return max(starts)[1] if starts else None

    def of_kind(self, kind: str) -> list[tuple[int, int, dict]]:
        return [(rank, line, r) for rank, recs in sorted(self.events.items()) for line, r in recs if r.get("event") == kind]


def _quote(source: str, record: dict, keys: tuple[str, ...]) -> str:
    shown = {k: record[k] for k in keys if k in record and record[k] is not None}
    return f"{source}: {json.dumps(shown, default=str)[:400]}"


def _error_kind(record: dict) -> str:
    text = f"{record.get('type')}: {record.get('message', '')}"
    if record.get("errno") == 28 or "No space left on device" in text:
        return "disk_full"
    if record.get("type") == "TrainingFault":
        return "loss_spike" if "loss spike" in text else "non_finite"
    if record.get("type") in ERROR_CLASSES:
        return ERROR_CLASSES[record["type"]]
    if "out of memory" in text.lower():
        return "out_of_memory"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "collective_timeout"
    return "exception"


def diagnose(folder: str | Path) -> Diagnosis:
    folder = Path(folder)
    runs = RunRecords.read(folder)
    attempt = runs.last_attempt_id()
    failure = runs.failure if runs.failure and runs.failure.get("attempt_id") == attempt else None
    finished = runs.of_kind("finished")
    reactions = [e for e in runs.of_kind("error") if _lost_a_peer(e[2])]  # consequences of another rank's failure
    errors = [e for e in runs.of_kind("error") if e not in reactions
              and (_error_kind(e[2]) != "collective_timeout" or not failure)]
    if runs.events and not errors and not failure and len(finished) == len(runs.events):
        bad = runs.of_kind("bad_step")
        note = [f"events: {len(bad)} bad step(s) skipped, {len(runs.of_kind('rollback'))} rollback(s)"] if bad else []
        return Diagnosis("completed", [], finished[0][2].get("step"),
                         [_quote(f"events/rank-{r:05d}.jsonl:{line}", rec, ("event", "step")) for r, line, rec in finished[:4]] + note)
    watchdog = failure if failure and failure.get("kind") in ("rank_hung", "rank_died", "collective_timeout", "launcher_died") else None
    if errors and not watchdog:  # a rank's own error (not a reaction to a peer's failure): its class
        rank, line, record = errors[0]
        evidence = [_quote(f"events/rank-{rank:05d}.jsonl:{line}", record, ("event", "step", "type", "message", "errno"))]
        kind = _error_kind(record)
        if kind in ("non_finite", "loss_spike"):
            evidence += [_quote(f"events/rank-{r:05d}.jsonl:{ln}", rec, ("event", "step", "reason", "to"))
                         for r, ln, rec in (runs.of_kind("bad_step") + runs.of_kind("rollback"))[-4:]]
        if kind == "exception":
            evidence.append("traceback (last frames):\n" + record.get("traceback", "")[-1500:])
        return Diagnosis(kind, [rank], record.get("step"), evidence)
    if watchdog:
        evidence = [f"failure.json: {line}" for line in watchdog.get("lines", [])[:12]]
        return Diagnosis(watchdog["kind"], list(watchdog.get("culprits", [])), watchdog.get("step"), evidence)
    found = _from_exits(runs, attempt)
    found.evidence += [_quote(f"events/rank-{r:05d}.jsonl:{ln}", rec, ("event", "step", "type", "message"))
                       for r, ln, rec in reactions[:2]]
    return found


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "lost a peer")


def _lost_a_peer(record: dict) -> bool:
    return any(text in record.get("message", "") for text in PEER_LOST)


def _from_exits(runs: RunRecords, attempt: str | None) -> Diagnosis:
    """No error record and no watchdog verdict: the launcher's exit codes, then the heartbeats."""
    failed = [(line, r) for line, r in runs.launcher if r.get("event") == "failed"]
    if failed:
        line, record = failed[-1]
        exits = [(int(rank), code) for rank, code in record.get("failures", {}).items()]  # the cause first
        killed = [(rank, code) for rank, code in exits if code < 0 and code != -signal.SIGTERM] or \
                 [(rank, code) for rank, code in exits if code < 0]  # SIGTERM: torchrun stopping the others
        if killed:
            rank, code = killed[0]
            beat = runs.heartbeats.get(rank, {})
            return Diagnosis("rank_died", [rank], beat.get("step"),
                             [f"launcher.jsonl:{line}: rank {rank} killed by {signal.Signals(-code).name}",
                              _quote(f"launcher.jsonl:{line}", record, ("event", "failures")),
                              f"heartbeats/rank-{rank:05d}.json: last step {beat.get('step')}, state {beat.get('state')}"])
    live = {rank: b for rank, b in runs.heartbeats.items() if b.get("attempt_id") == attempt and b.get("state") == "running"}
    started = [(line, r) for line, r in runs.launcher if r.get("event") == "start"]
    ended = [r for _, r in runs.launcher if r.get("event") in ("failed", "finished")]
    if live and len(live) == len(runs.heartbeats) and started and len(ended) < len(started):
        times = sorted(b["time"] for b in live.values())
        return Diagnosis("launcher_died", [], max(b.get("step", 0) for b in live.values()),
                         [_quote(f"launcher.jsonl:{started[-1][0]}", started[-1][1], ("event", "nproc_per_node")),
                          "launcher.jsonl: no record of the job ending",
                          f"heartbeats: all {len(live)} ranks stopped within {times[-1] - times[0]:.1f} s of each other, "
                          "none finished or failed"])
    if live:
        rank = min(live, key=lambda r: live[r]["time"])
        return Diagnosis("rank_hung", [rank], live[rank].get("step"),
                         [f"heartbeats/rank-{rank:05d}.json: the earliest last heartbeat, at step {live[rank].get('step')}"])
    return Diagnosis("unknown", [], None, [f"{runs.folder}: no events, heartbeats or launcher records"])


def format_diagnosis(d: Diagnosis) -> str:
    culprit = f"rank {', '.join(map(str, d.culprits))}" if d.culprits else "-"
    lines = [f"diagnosis: {d.kind}", f"culprit:   {culprit}" + (f" (step {d.step})" if d.step is not None else ""),
             "evidence:", *(f"  {line}" for line in d.evidence), f"what to do: {d.advice}"]
    return "\n".join(lines)
