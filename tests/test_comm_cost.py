"""The alpha-beta-gamma formulas of comm/cost.py: known values, the regimes `auto` must tell apart, fitting."""

import pytest

from fivefold.comm.cost import Cluster, Link, best_all_reduce, fit_link, halving_doubling, predict, ring

LINK = Link(alpha=1e-5, beta=1e-9, gamma=1e-10)


def test_ring_and_halving_doubling_formulas():
    n, p = 1e6, 8
    assert ring(n, p, LINK) == pytest.approx(14e-5 + 2 * 7 / 8 * 1e-3 + 7 / 8 * 1e-4)
    assert halving_doubling(n, p, LINK) == pytest.approx(6e-5 + 2 * 7 / 8 * 1e-3 + 7 / 8 * 1e-4)
    # 6 = 4 + 2: the 4-rank core plus two folding messages of the whole vector
    assert halving_doubling(n, 6, LINK) == pytest.approx(halving_doubling(n, 4, LINK) + 2 * (1e-5 + 1e-3) + 1e-4)


def test_auto_prefers_few_messages_for_small_vectors_and_bandwidth_optimal_ones_for_large():
    cluster = Cluster(LINK, LINK, node_size=8)
    assert best_all_reduce(64, 8, cluster) in ("butterfly", "halving_doubling", "rabenseifner")
    assert predict("butterfly", 64, 8, cluster) < predict("ring", 64, 8, cluster)
    large = best_all_reduce(1e9, 8, cluster)
    assert predict(large, 1e9, 8, cluster) <= predict("ring", 1e9, 8, cluster)
    assert predict("butterfly", 1e9, 8, cluster) > predict("ring", 1e9, 8, cluster)


def test_hierarchical_wins_when_the_inter_node_link_is_slow():
    cluster = Cluster(intra=Link(1e-6, 1e-11), inter=Link(1e-5, 1e-9), node_size=8)
    n, p = 1e8, 64
    assert predict("hierarchical", n, p, cluster) < predict("ring", n, p, cluster)
    assert best_all_reduce(n, p, cluster) == "hierarchical"


def test_fit_recovers_alpha_and_beta():
    sizes = [1e3, 1e4, 1e5, 1e6]
    link = fit_link(sizes, [2e-5 + n * 3e-10 for n in sizes])
    assert link.alpha == pytest.approx(2e-5) and link.beta == pytest.approx(3e-10)
    with pytest.raises(ValueError, match="two or more"):
        fit_link([1e3], [1e-5])


def test_relative_fit_keeps_small_messages_right():
    """Sizes spanning decades: plain least squares follows the large messages and misses the small ones'
    fixed cost; the relative fit keeps every size within a few percent."""
    sizes = [16e3, 128e3, 1e6, 4e6]
    link = fit_link(sizes, [1e-3 + n * 1e-9 for n in sizes], relative=True)
    assert link.alpha == pytest.approx(1e-3) and link.beta == pytest.approx(1e-9)
    measured = [0.3e-3, 0.5e-3, 2.0e-3, 6.2e-3]  # not quite linear, as measured times are
    plain, relative = fit_link(sizes, measured), fit_link(sizes, measured, relative=True)

    def worst(link):
        return max(abs(link.alpha + n * link.beta - t) / t for n, t in zip(sizes, measured))

    assert worst(relative) < 0.1 < 0.25 < worst(plain)


def test_uneven_all_to_all_prices_each_step_by_its_larger_message():
    from fivefold.comm.cost import Link, dispatch_bytes, uneven_all_to_all

    # 3 ranks, 1 expert each: rank 0 sends 5 rows to expert 1, rank 2 sends 2 rows to expert 0
    matrix = dispatch_bytes([[0, 5, 0], [0, 0, 0], [2, 0, 0]], 1, 10)
    assert matrix == [[0, 50, 0], [0, 0, 0], [20, 0, 0]]
    link = Link(alpha=1.0, beta=0.1)
    # rank 0, step 1: sends 50 to rank 1 while receiving 20 from rank 2: 1 + 0.1 x 50 = 6.0; step 2 empty.
    # rank 1 receives the 50 (6.0), rank 2 sends the 20 (3.0): the slowest takes 6.0
    assert uneven_all_to_all(matrix, link) == pytest.approx(6.0)
    assert uneven_all_to_all(dispatch_bytes([[0, 5, 0], [0, 0, 0], [0, 2, 0]], 1, 10), link) == pytest.approx(9.0)  # rank 1 receives both: 6 + 3
    assert uneven_all_to_all([[0, 0], [0, 0]], link) == 0.0
