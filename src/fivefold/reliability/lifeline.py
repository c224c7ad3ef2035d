"""Workers die with their launcher: no orphaned ranks training on after the launcher is killed.

torchrun's agent stops its workers when it exits normally, but a launcher killed with SIGKILL
cannot: its workers are re-parented and train on. On Linux each worker asks the kernel to send it
SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), so it ends at once; the heartbeat thread
also compares the parent pid with the one at start (reliability/heartbeat.py), which covers other
systems within a quarter heartbeat.

The parent may die between the worker's start and the prctl call; the worker then already has a
new parent, so `arm()` checks the parent pid after arming against the launcher's, which
`fivefold train` passes down in FIVEFOLD_LAUNCHER_PID (under a plain torchrun, the parent at start).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

from fivefold.errors import EXIT_LAUNCHER_DIED

PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "FIVEFOLD_LAUNCHER_PID"


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def arm() -> int | None:
    """Die with the parent; returns the parent pid being watched (None outside a torchrun worker)."""
    if not launched_by_torchrun():
        return None
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    expected = os.environ.get(LAUNCHER_ENV)
    launcher_gone = os.getppid() != parent or os.getppid() == 1
    if expected is not None and not _alive(int(expected)):
        launcher_gone = True
    if launcher_gone:
        print(f"fivefold: the launcher died before rank {os.environ.get('RANK')} started; exiting", file=sys.stderr)
        os._exit(EXIT_LAUNCHER_DIED)
    return parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
