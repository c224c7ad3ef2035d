"""Faults of real multi-process jobs, through `fivefold train` under torchrun (issue items 5, 6, 7, 9).

Each test injects one fault with `[fault]` into a 2-rank job of a micro model and checks what a
user sees: the exit code, the launcher's account naming the culprit, `fivefold diagnose`, and for
--max-restarts a finished run equal to an uninterrupted one. Heartbeats every second, so the
detection goals are checked at their own scale: a hung rank within two heartbeats.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed.cli import micro_args, run_cli
from fivefold.reliability.diagnose import diagnose

pytestmark = pytest.mark.slow
WATCHDOG = ["--watchdog.heartbeat_s", "1", "--watchdog.collective_timeout_s", "6"]


def test_a_hung_rank_is_named_within_two_heartbeats(tmp_path, corpus_dir):
    out = run_cli(["train", "--nproc-per-node", "2", *micro_args(corpus_dir, tmp_path, "run", steps=30), *WATCHDOG,
                   "--fault.kind", "hang", "--fault.step", "6", "--fault.rank", "1"], tmp_path, timeout=180)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "rank 1 is hung" in out.stderr and "stopped (SIGSTOP" in out.stderr
    assert "Traceback" not in out.stderr
    failure = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert failure["kind"] == "rank_hung" and failure["culprits"] == [1] and failure["step"] == 6
    assert failure["latency_s"] <= 2.0  # two heartbeats of 1 s
    found = diagnose(tmp_path / "run")
    assert (found.kind, found.culprits, found.step) == ("rank_hung", [1], 6)


def test_a_stalled_collective_names_the_rank_that_is_elsewhere(tmp_path, corpus_dir):
    out = run_cli(["train", "--nproc-per-node", "2", *micro_args(corpus_dir, tmp_path, "run", steps=30), *WATCHDOG,
                   "--fault.kind", "stall", "--fault.step", "6", "--fault.rank", "1"], tmp_path, timeout=180)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "collective stalled: rank 0 has waited" in out.stderr and "likely culprit(s): rank 1" in out.stderr
    assert "injected stall at step 6" in out.stderr  # rank 1's phase, from its heartbeat
    found = diagnose(tmp_path / "run")
    assert (found.kind, found.culprits) == ("collective_timeout", [1])


def test_killing_the_launcher_ends_its_workers_within_seconds(tmp_path, corpus_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    launcher = subprocess.Popen([sys.executable, "-m", "fivefold", "train", "--nproc-per-node", "2",
                                 *micro_args(corpus_dir, tmp_path, "run", steps=100000), *WATCHDOG,
                                 "--checkpoint.every", "100000"], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    beats = tmp_path / "run" / "heartbeats"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(beats.glob("rank-*.json"))) < 2:
        time.sleep(0.5)
    time.sleep(2)  # training now
    pids = [json.loads(p.read_text())["pid"] for p in sorted(beats.glob("rank-*.json"))]
    assert len(pids) == 2, "the workers never started"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    killed = time.time()
    while time.time() - killed < 10 and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    gone_after = time.time() - killed
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "workers outlived their launcher"
    assert gone_after < 5
    assert diagnose(tmp_path / "run").kind == "launcher_died"


def test_max_restarts_resume_from_the_newest_checkpoint_and_match_an_uninterrupted_run(tmp_path, corpus_dir):
    """Rank 1 dies at step 7; the restart resumes from the newest complete checkpoint and finishes step 10.

    Checkpoints are asynchronous: the one of step 6 may still be in flight when rank 1 dies (then it
    never completes and the restart takes step 3's). Either way the result equals an uninterrupted run.
    """
    import dataclasses

    from fivefold.config import load_config
    from fivefold.train.checkpoint import read_weights
    from fivefold.train.metrics import read_metrics
    from fivefold.train.trainer import Trainer
    from parity.harness import assert_parity

    common = micro_args(corpus_dir, tmp_path, "run", steps=10)
    out = run_cli(["train", "--nproc-per-node", "2", "--max-restarts", "1", *common, *WATCHDOG,
                   "--checkpoint.every", "3", "--checkpoint.async_save", "true",
                   "--fault.kind", "kill", "--fault.step", "7", "--fault.rank", "1"], tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    markers = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"event"' in line]
    assert [(m["event"], m["attempt"]) for m in markers] == [("start", 0), ("resume", 1)]
    resumed = markers[1]["step"]
    assert resumed in (3, 6) and f"resuming from {tmp_path / 'run' / f'step-{resumed:06d}'}" in out.stdout
    reference = load_config(None, [*common, "--train.micro_batch_size", "4", "--train.output_dir", str(tmp_path / "one"),
                                   "--checkpoint.every", "0"])
    single = Trainer(dataclasses.replace(reference)).fit()
    restarted = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert restarted[-1] == pytest.approx(single.final_loss, rel=1e-5)  # the loss of step 10
    assert_parity(([single.final_loss], read_weights(single.checkpoint)),
                  ([restarted[-1]], read_weights(tmp_path / "run" / "step-000010")))
    assert diagnose(tmp_path / "run").kind == "completed"
