"""Price a layout search's candidates in forked worker processes.

The planner's search (plan/search.py) prices tens of thousands of independent candidates, pure
Python arithmetic each, so one interpreter is bound to one core. `map_shares` deals the candidates
out in blocks, round robin (neighbouring candidates share caches and cost alike), forks one process
per share but the first, prices the first share itself, and collects the others' results through a
pipe. The children are forks of the planner (they inherit the candidates and the pricing function,
nothing is sent to them); each sends back one pickled result, read only by the process that forked
it. Where fork is not the safe default (macOS, Windows) the shares are priced one after another in
this process, which gives the same result.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

BLOCK = 64  # candidates dealt to a share at a time


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """Processes a search uses by default: one per usable core, at most 8 (past that the merge and the
    forks' start outweigh what another share saves on a search of tens of thousands of candidates)."""
    return min(usable_cores(), 8)


def can_fork() -> bool:
    return sys.platform == "linux" and hasattr(os, "fork")


def deal(items: Sequence[Item], shares: int, block: int = BLOCK) -> list[list[Item]]:
    """`items` dealt into `shares` lists, `block` consecutive items at a time, round robin."""
    out: list[list[Item]] = [[] for _ in range(shares)]
    for start in range(0, len(items), block):
        out[(start // block) % shares].extend(items[start:start + block])
    return out


def map_shares(price: Callable[[list[Item]], Result], items: Sequence[Item], workers: int) -> list[Result]:
    """`price` of each share of `items` (`deal`), the first priced here, the others in forked children: one
    result per process used. With one worker, no fork, or fewer items than two blocks, one share priced here. A
    child that fails raises here with its traceback; one that dies (killed, out of memory) raises with its exit
    code."""
    if workers < 1:
        raise ValueError(f"workers = {workers}: must be at least 1")
    shares = deal(items, min(workers, max(1, -(-len(items) // BLOCK))) if can_fork() else 1)
    if len(shares) == 1:
        return [price(shares[0])]
    import multiprocessing

    context = multiprocessing.get_context("fork")
    children = []
    try:
        for share in shares[1:]:
            reader, writer = context.Pipe(duplex=False)
            child = context.Process(target=_price_and_send, args=(price, share, writer), daemon=True)
            child.start()
            writer.close()
            children.append((child, reader))
        results = [price(shares[0])]
        for child, reader in children:
            try:
                ok, value = reader.recv()
            except EOFError:
                child.join()
                raise RuntimeError(f"a search worker (pid {child.pid}) died with exit code {child.exitcode} before "
                                   "sending its share: out of memory? run with fewer workers") from None
            if not ok:
                raise RuntimeError(f"a search worker (pid {child.pid}) failed:\n{value}")
            results.append(value)
        return results
    finally:
        for child, reader in children:
            reader.close()
            if child.is_alive():
                child.join(timeout=5)
            if child.is_alive():
                child.kill()
                child.join()


def _price_and_send(price: Callable, share: list, writer) -> None:
    try:
        outcome = (True, price(share))
    except BaseException:  # sent back and raised in the parent, which knows what the search was doing
        outcome = (False, traceback.format_exc())
    writer.send(outcome)
    writer.close()
