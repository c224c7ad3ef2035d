"""Independent sharding degrees (parallel/shard_layout.py): the pieces nest, the groups partition the ranks, the
collectives' chunk orders put every piece where it belongs, and bad degrees are refused by name."""

import itertools

import numpy as np
import pytest

from fivefold.errors import ConfigError
from fivefold.parallel.shard_layout import GROUP_KINDS, ShardDegrees
from fivefold.plan.memory import sharded_model_states, zero_model_states


def all_degrees(world: int) -> list[ShardDegrees]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [ShardDegrees(p, g, o, world) for p, g, o in itertools.product(divisors, repeat=3) if g % p == 0 and o % g == 0]


CASES = [d for world in (1, 2, 4, 8, 12, 16) for d in all_degrees(world)]


def test_four_ranks_have_ten_combinations():
    assert [(d.params, d.grads, d.optim) for d in all_degrees(4)] == [
        (1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 2), (1, 2, 4), (1, 4, 4), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4)]


@pytest.mark.parametrize("d", CASES, ids=str)
def test_pieces_nest_and_every_block_holds_each_piece_once(d):
    for t in range(d.world):
        k, gi, a = d.optim_index(t), d.grad_index(t), d.param_index(t)
        assert k * d.grads // d.optim == gi  # optimizer piece k of o lies in gradient piece gi of g
        assert gi * d.params // d.grads == a  # which lies in parameter piece a of p
        assert d.position_of_optim_piece(t // d.optim, k) == t
    for block in d.rows("block"):
        assert sorted(d.optim_index(t) for t in block) == list(range(d.optim))


@pytest.mark.parametrize("d", CASES, ids=str)
def test_groups_partition_the_ranks_and_hold_what_their_collective_needs(d):
    for kind in GROUP_KINDS:
        rows = d.rows(kind)
        assert sorted(t for row in rows for t in row) == list(range(d.world)), kind
        assert all(row == sorted(row) for row in rows)
    for row in d.rows("params"):  # consecutive ranks gathering distinct parameter pieces in order
        assert [d.param_index(t) for t in row] == list(range(d.params))
    for row in d.rows("grads"):  # consecutive ranks, distinct gradient pieces
        assert row == list(range(row[0], row[0] + d.grads))
        assert sorted(d.grad_index(t) for t in row) == list(range(d.grads))
    for row in d.rows("split"):  # same gradient piece; in group order the optimizer pieces inside it, in order
        assert len({d.grad_index(t) for t in row}) == 1
        assert [d.optim_index(t) for t in row] == list(range(d.optim_index(row[0]), d.optim_index(row[0]) + len(row)))
    for row in d.rows("replica"):
        assert len({d.optim_index(t) for t in row}) == 1 and len(row) == d.replicas
    for row in d.rows("publish"):  # the optimizer pieces of one parameter piece
        assert len({d.param_index(t) for t in row}) == 1
        assert sorted(d.optim_index(t) for t in row) == list(range(d.param_index(row[0]) * len(row),
                                                                      (d.param_index(row[0]) + 1) * len(row)))


@pytest.mark.parametrize("d", [d for d in CASES if d.world > 1], ids=str)
def test_the_collectives_chunk_orders_land_each_piece_on_its_owner(d):
    """Replay the runtime's collectives on numpy: the reduce-scatter over the gradient group (input permuted when
    1 < p < g) gives each rank its natural gradient piece, and the publish all-gather (output transposed when
    g > p and o > g) rebuilds each parameter piece."""
    n = d.optim * 3  # a padded flat vector of 3 elements per optimizer piece
    flat = np.arange(n)
    size = n // d.grads
    for row in d.rows("grads"):
        send = flat.reshape(d.params, d.grads // d.params, -1).transpose(1, 0, 2).reshape(-1) if d.grad_permuted else flat
        for j, t in enumerate(row):
            received = send[j * size : (j + 1) * size]
            assert (received == flat[d.grad_index(t) * size : (d.grad_index(t) + 1) * size]).all()
    shard, piece = n // d.optim, n // d.params
    for row in d.rows("publish"):
        gathered = np.concatenate([flat[d.optim_index(t) * shard : (d.optim_index(t) + 1) * shard] for t in row])
        if d.publish_permuted:
            gathered = gathered.reshape(d.optim // d.grads, d.grads // d.params, -1).transpose(1, 0, 2).reshape(-1)
        a = d.param_index(row[0])
        assert (gathered == flat[a * piece : (a + 1) * piece]).all()


def test_groups_that_talk_every_micro_batch_are_consecutive():
    """AMSP's point: at p = g = 8 (one node) and o = 64, parameter and gradient groups stay in a node of 8."""
    d = ShardDegrees(8, 8, 64, 128)
    assert all(row[-1] - row[0] == 7 for kind in ("params", "grads") for row in d.rows(kind))
    assert d.size("split") == 8 and d.size("replica") == 2 and d.size("publish") == 8


def test_the_stages_are_points_of_the_space():
    assert ShardDegrees.for_stage(1, 4) == ShardDegrees(1, 1, 4, 4)
    assert ShardDegrees.for_stage(2, 4, 8) == ShardDegrees(1, 4, 4, 8)
    assert ShardDegrees.for_stage(3, 4, 8).replicas == 2
    assert ShardDegrees.resolve(1, 4, 4, grads=2) == ShardDegrees(1, 2, 4, 4)
    assert ShardDegrees.resolve(3, 2, 4, optim=4) == ShardDegrees(2, 2, 4, 4)
    assert ShardDegrees.resolve(3, 4, 4, optim=2) == ShardDegrees(2, 2, 2, 4)  # MiCS: the stage's capped by optim
    assert ShardDegrees.resolve(2, 4, 4, grads=2) == ShardDegrees(1, 2, 4, 4)
    for stage in (1, 2, 3):
        assert ShardDegrees.for_stage(stage, 4, 8).matches_stage(stage)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mixed", [False, True])
def test_memory_formula_of_the_stages_is_the_general_one_at_their_degrees(stage, mixed):
    d = ShardDegrees.for_stage(stage, 8) if stage else ShardDegrees(1, 1, 1, 8)
    assert zero_model_states(8000, stage, 8, mixed) == sharded_model_states(8000, d.params, d.grads, d.optim, mixed)
    amsp = sharded_model_states(8000, 1, 2, 8, mixed)
    w = 2 if mixed else 4
    assert (amsp.parameters, amsp.gradients, amsp.optimizer) == (w * 8000, w * 4000, (12 if mixed else 8) * 1000)


@pytest.mark.parametrize("degrees, message", [
    ((3, 3, 3, 4), "shard_params = 3 must divide the 4"),
    ((1, 1, 8, 4), "shard_optim = 8 must divide the 4"),
    ((2, 1, 4, 4), "each must divide the next"),
    ((1, 4, 2, 4), "each must divide the next"),
])
def test_bad_degrees_are_refused_by_name(degrees, message):
    with pytest.raises(ConfigError, match=message):
        ShardDegrees(*degrees).validate()


@pytest.mark.parametrize("sections, message", [
    ({"data_parallel": {"shard_grads": 2}}, "shard_grads sets a ZeRO sharding degree: set data_parallel.zero_stage"),
    ({"data_parallel": {"shard": 2, "zero_stage": 1, "shard_optim": -1}}, "shard_optim = -1: use a positive degree"),
    ({"data_parallel": {"shard": 2, "zero_stage": 1, "shard_grads": 2}, "pipeline_parallel": {"degree": 2}},
     "leave them at 0 or 1 with pipelining"),
])
def test_configs_with_bad_degrees_fail_before_any_work(job, sections, message):
    from parity.harness import with_changes

    with pytest.raises(ConfigError, match=message):
        with_changes(job, **sections)


@pytest.mark.parametrize("data_parallel, message", [
    ({"shard": 4, "zero_stage": 1, "shard_optim": 3}, "shard_optim = 3 must divide the 4"),
    ({"shard": 4, "zero_stage": 1, "shard_params": 4, "shard_grads": 2}, "each must divide the next"),
    ({"shard": 4, "zero_stage": 3, "shard_optim": 4, "shard_params": 2, "quantized_weights": True},
     "ZeRO\\+\\+ .* works on one shard group"),
])
def test_degrees_that_do_not_fit_the_ranks_are_refused_with_the_mesh(job, data_parallel, message):
    from fivefold.parallel.mesh import dims_for
    from parity.harness import with_changes

    with pytest.raises(ConfigError, match=message):
        dims_for(with_changes(job, data_parallel=data_parallel), 4)


@pytest.mark.parametrize("d", [d for d in CASES if d.world in (8, 12)], ids=str)
def test_sizes_and_spans_are_those_of_the_rows(d):
    for kind in GROUP_KINDS:
        for row in d.rows(kind):
            assert len(row) == d.size(kind) and row[-1] - row[0] + 1 == d.span(kind), kind
