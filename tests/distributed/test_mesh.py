"""Parallel dims: validation messages, rank layout (tp innermost), and the real DeviceMesh groups."""

import pytest

from fivefold.errors import ConfigError
from fivefold.parallel.mesh import ParallelDims, build_mesh

from distributed.spawn import run_distributed


def test_product_must_equal_world_size():
    with pytest.raises(ConfigError, match=r"= 4, but the world size is 8"):
        ParallelDims(dp_replicate=2, tp=2, world_size=8)
    with pytest.raises(ConfigError, match="tp = 0: must be a positive integer"):
        ParallelDims(tp=0, world_size=4)


def test_coordinates_tp_innermost():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=8)
    assert dims.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "dp": 0}
    assert dims.coordinates(1)["tp"] == 1 and dims.coordinates(1)["dp"] == 0
    assert dims.coordinates(2)["dp_shard"] == 1 and dims.coordinates(2)["dp"] == 1
    assert dims.coordinates(7) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 1, "dp": 3}
    assert "block 1: ranks [4, 5, 6, 7]" in dims.describe()


def _mesh_groups(rank, world_size):
    dims = ParallelDims(dp_replicate=2, dp_shard=2, world_size=world_size)
    mesh = build_mesh(dims, "cpu")
    groups = {name: mesh.ranks(name) for name in ("dp_replicate", "dp_shard", "dp")}
    return groups, dims.coordinates(rank)["dp"], mesh.local_rank("dp")


def test_device_mesh_groups_match_the_layout():
    results = run_distributed(_mesh_groups, 4)
    assert results[0][0] == {"dp_replicate": [0, 2], "dp_shard": [0, 1], "dp": [0, 1, 2, 3]}
    assert results[3][0] == {"dp_replicate": [1, 3], "dp_shard": [2, 3], "dp": [0, 1, 2, 3]}
    assert all(coord == local for _, coord, local in results)


def test_pipeline_inside_data_parallelism_places_stages_on_neighbouring_ranks():
    """placement = inner: ranks run (dp_replicate, dp_shard, pp, cp, tp), so one pipeline's stages are neighbours."""
    dims = ParallelDims(dp_replicate=2, pp=2, tp=2, world_size=8, placement="inner")
    assert dims.order == ("dp_replicate", "dp_shard", "pp", "cp", "tp")
    assert dims.coordinates(2) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "dp": 0}
    assert dims.coordinates(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1, "dp": 1}
    assert dims.rank_grid()[1, 0, 0, 0, 1].item() == 3  # pp 1, tp 1 of the first replica
    assert "block 1: ranks [4, 5]" in dims.describe() and "block 2: ranks [2, 3]" in dims.describe()
    with pytest.raises(ConfigError, match="placement = 'middle'"):
        ParallelDims(placement="middle")


def _placed_groups(rank, world_size, placement):
    dims = ParallelDims(dp_replicate=2, pp=2, world_size=world_size, placement=placement)
    mesh = build_mesh(dims, "cpu")
    groups = {name: mesh.ranks(name) for name in ("pp", "dp", "dp_cp")}
    coords = dims.coordinates(rank)
    return groups, (coords["pp"], coords["dp"]), (mesh.local_rank("pp"), mesh.local_rank("dp"))


@pytest.mark.parametrize("placement,pp_group,dp_group", [("outer", [0, 2], [0, 1]), ("inner", [0, 1], [0, 2])])
def test_device_mesh_follows_the_pipeline_placement(placement, pp_group, dp_group):
    results = run_distributed(_placed_groups, 4, placement)
    assert results[0][0] == {"pp": pp_group, "dp": dp_group, "dp_cp": dp_group}
    assert all(coords == local for _, coords, local in results)
