"""plan/workers.py: a search's candidates dealt into shares, priced in forked processes, merged in order."""

import os

import pytest

from fivefold.plan.workers import BLOCK, can_fork, deal, map_shares

needs_fork = pytest.mark.skipif(not can_fork(), reason="shares are forked on Linux only")


def test_deal_gives_every_item_once_in_blocks_round_robin():
    items = list(range(5 * BLOCK + 3))
    shares = deal(items, 3)
    assert sorted(x for share in shares for x in share) == items
    assert shares[0][:BLOCK] == items[:BLOCK] and shares[1][:BLOCK] == items[BLOCK:2 * BLOCK]
    assert shares[0][BLOCK:2 * BLOCK] == items[3 * BLOCK:4 * BLOCK]
    assert [len(share) for share in shares] == [2 * BLOCK, 2 * BLOCK, BLOCK + 3]


@needs_fork
def test_each_share_is_priced_in_its_own_process_and_comes_back_in_order():
    items = list(range(4 * BLOCK))
    results = map_shares(lambda share: (os.getpid(), sum(share), share), items, workers=4)
    assert [r[2] for r in results] == deal(items, 4)
    assert results[0][0] == os.getpid() and len({r[0] for r in results}) == 4
    assert sum(r[1] for r in results) == sum(items)


def test_few_items_or_one_worker_are_priced_here():
    pids = map_shares(lambda share: os.getpid(), list(range(BLOCK)), workers=8)  # one block: one share
    assert pids == [os.getpid()]
    assert map_shares(lambda share: len(share), list(range(3 * BLOCK)), workers=1) == [3 * BLOCK]
    with pytest.raises(ValueError, match="workers = 0"):
        map_shares(len, [1], workers=0)


def _fails_in_the_second_share(share):
    if share[0] >= BLOCK:
        raise ValueError("bad candidate 64")
    return len(share)


def _dies_in_the_second_share(share):
    if share[0] >= BLOCK:
        os._exit(9)  # as a worker killed for memory would
    return len(share)


@needs_fork
def test_a_failing_worker_raises_here_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)a search worker .* failed.*ValueError: bad candidate 64"):
        map_shares(_fails_in_the_second_share, list(range(2 * BLOCK)), workers=2)


@needs_fork
def test_a_dead_worker_raises_here_with_its_exit_code():
    with pytest.raises(RuntimeError, match="died with exit code 9"):
        map_shares(_dies_in_the_second_share, list(range(2 * BLOCK)), workers=2)
