"""Double-ring attention and 2d placement (parallel/context_parallel.py ContextParallelLayout): the visiting
order covers every block once, inner hops stay in their inner ring, placements map ranks both ways, bad
settings are refused by name, and the planner prices inner hops on the node's links."""

import pytest

from fivefold.config import load_config
from fivefold.errors import ConfigError
from fivefold.parallel.context_parallel import ContextParallelLayout, _rounds
from fivefold.parallel.validate import check_config
from fivefold.plan.cluster import PRESETS
from fivefold.plan.estimate import estimate


@pytest.mark.parametrize("ring,inner", [(8, 2), (8, 4), (6, 3), (4, 1), (4, 4), (4, 0)])
def test_every_rank_visits_every_block_once_and_inner_hops_stay_inside(ring, inner):
    layout = ContextParallelLayout.for_method("ring", ring, 1, inner)
    w = inner or ring
    assert (layout.inner_size, layout.outer) == (w, ring // w) and len(_rounds(layout)) == ring
    for me in range(ring):
        seen = [layout.source(me, j, i) for j, i in _rounds(layout)]
        assert sorted(seen) == list(range(ring)) and seen[0] == me
        peers = layout.ring_peers(me)
        assert all(p // w == me // w for p in peers["inner"])  # the inner ring keeps to its node
        assert all(p % w == me % w for p in peers["outer"])  # the outer ring keeps the inner position
        for j, i in _rounds(layout):  # what `me` holds next is what its inner (or, at a round's end, outer) peer held
            if i + 1 < w:
                assert layout.source(me, j, i + 1) == layout.source(peers["inner"][1], j, i)
            elif j + 1 < layout.outer:
                assert layout.source(me, j + 1, 0) == layout.source(peers["outer"][1], j, 0)


@pytest.mark.parametrize("placement", ["head-first", "context-first"])
def test_placements_map_ranks_both_ways_and_shard_the_whole_sequence(placement):
    layout = ContextParallelLayout.for_method("2d", 8, 2, placement=placement)
    coords = [layout.coords(p) for p in range(8)]
    assert sorted(coords) == [(r, h) for r in range(4) for h in range(2)]
    assert all(layout.cp_rank(*c) == p for p, c in enumerate(coords))
    adjacent = coords[1] if placement == "head-first" else coords[1][::-1]
    assert adjacent == (0, 1)  # head-first: cp ranks 0 and 1 share a ring rank; context-first: a head rank
    positions = sorted(int(x) for p in range(8) for x in layout.shard_positions(64, p))
    assert positions == list(range(64))
    double = ContextParallelLayout.for_method("2d", 8, 2, inner_ring=2, placement=placement)
    # the inner ring's 2 ring ranks: cp ranks 0 and 2 head-first (span 3), 0 and 1 context-first (span 2)
    assert double.inner_span() == (3 if placement == "head-first" else 2)


@pytest.mark.parametrize("overrides,message", [
    (["--context_parallel.degree", "4", "--context_parallel.inner_ring", "3"], "inner_ring = 3 must divide"),
    (["--context_parallel.degree", "4", "--context_parallel.method", "ulysses", "--context_parallel.inner_ring", "2"],
     "inner_ring = 2 must divide the ring's 1"),
    (["--context_parallel.placement", "nodes-first"], "context_parallel.placement"),
    (["--context_parallel.inner_ring", "-1"], "inner_ring = -1"),
])
def test_bad_double_ring_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config("configs/tiny.toml", ["--train.seq_len", "128", *overrides]))


def test_planner_puts_inner_hops_on_the_node_links():
    """cp 16 over 2 nodes of 8: one ring prices every hop on the inter-node link; a double ring with an inner
    ring of 8 puts 7 of every 8 hops on NVLink and hides the outer hop behind a round."""
    h100 = PRESETS["h100-sxm"]
    base = ["--train.seq_len", "4096", "--model.max_seq_len", "4096", "--train.micro_batch_size", "1",
            "--context_parallel.degree", "16"]
    single = estimate(load_config("configs/tiny.toml", base), 16, h100, vocab_size=257)
    double = estimate(load_config("configs/tiny.toml", [*base, "--context_parallel.inner_ring", "8"]), 16, h100,
                      vocab_size=257)
    assert single.time.cp > 0 and double.time.cp < single.time.cp / 2
