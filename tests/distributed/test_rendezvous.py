"""Ranks wait for rank 0 where it works on shared files (train/rendezvous.py), and heartbeats survive their folder
being removed.

A fresh run's rank 0 removes an earlier run's heartbeats and events from the output folder; the parameter
servers, outside the trainers' group, started writing theirs there at once, and rank 0's removal met a
server's heartbeat file mid-rename and failed the run's start (seen 2026-11-26 in plan_vs_measured's
ps2-servers2-bsp). Servers now wait until rank 0 announces the folder claimed.
"""

from __future__ import annotations

import json
import shutil
import time

from distributed.spawn import run_distributed


def _ordered(rank: int, world_size: int) -> float:
    from fivefold.train.rendezvous import announce, wait_for

    if rank == 0:
        time.sleep(0.6)
        announce("output-ready", "attempt-1")
        return time.time()
    wait_for("output-ready", "attempt-1", "waiting for rank 0 to claim the output folder")
    return time.time()


def test_ranks_wait_until_rank0_announces():
    announced, *waited = run_distributed(_ordered, 3)
    assert all(when >= announced - 0.05 for when in waited)


def test_one_process_waits_for_nothing():
    from fivefold.train.rendezvous import announce, wait_for

    announce("output-ready", "alone")  # no process group: nothing to tell
    wait_for("output-ready", "alone", "nothing")


def test_a_heartbeat_remakes_its_removed_folder(tmp_path):
    from fivefold.reliability.heartbeat import Heartbeat, heartbeat_path

    folder = tmp_path / "heartbeats"
    beat = Heartbeat(folder, 3, 4, "attempt", 1.0, 60.0, lambda verdict: None, watch=False)
    shutil.rmtree(folder)  # an earlier run's diagnostics removed with this run's record in them
    beat.beat += 1
    beat.write()
    assert json.loads(heartbeat_path(folder, 3).read_text())["beat"] == 1
