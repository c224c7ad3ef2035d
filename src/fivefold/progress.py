"""No silent phase: a phase that runs longer than a few seconds says what it is doing, and how long it took.

    with announce("tokenising 1,203 files", log):
        ...

prints nothing for a phase that ends within `after` seconds (3 by default), and otherwise
"tokenising 1,203 files ..." once that time has passed, then "tokenising 1,203 files: done in
12.4 s". Used for tokenisation and BPE training, evaluation, checkpoint saves and sampling,
so the output never goes quiet for longer than that while the program works.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator


@contextlib.contextmanager
def announce(what: str, log: Callable[[str], None] | None, after: float = 3.0) -> Iterator[None]:
    if log is None:
        yield
        return
    start = time.perf_counter()
    said = threading.Event()

    def say() -> None:
        said.set()
        log(f"{what} ...")

    timer = threading.Timer(after, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            log(f"{what}: done in {time.perf_counter() - start:.1f} s")
