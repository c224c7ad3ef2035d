"""The process groups ZeRO runs on, for any sharding degrees of parameters, gradients and optimizer states.

`parallel/shard_layout.py` says which positions of the data-parallel x context group form each
group (params, grads, split, replica, publish, block); this module turns those positions into
torch.distributed groups of global ranks, reusing the mesh's own groups where they coincide (so
plain ZeRO over dp_shard x cp with dp_replicate replicas creates no group of its own), and builds
the 2-D device mesh (replicas x optimizer pieces) that checkpoints place each rank's shard on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fivefold.parallel.shard_layout import GROUP_KINDS, ShardDegrees


@dataclass
class ZeroGroups:
    """This rank's ZeRO groups (None where a group has one rank) and its position in the dp x cp group."""

    degrees: ShardDegrees
    position: int
    params: dist.ProcessGroup | None = None
    grads: dist.ProcessGroup | None = None
    split: dist.ProcessGroup | None = None
    replica: dist.ProcessGroup | None = None
    publish: dist.ProcessGroup | None = None
    block: dist.ProcessGroup | None = None
    block_rows: list[list[int]] | None = None  # global ranks of every block (ZeRO++ builds its groups inside them)

    @classmethod
    def over(cls, shard_group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None,
             stage: int) -> "ZeroGroups":
        """ZeRO `stage` over `shard_group` (the whole group when None), replicated over `replicate_group`."""
        shards = dist.get_world_size(shard_group) if shard_group is not None else 1
        replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        degrees = ShardDegrees.for_stage(stage, shards, shards * replicas)
        position = (dist.get_rank(replicate_group) if replicate_group is not None else 0) * shards + \
            (dist.get_rank(shard_group) if shard_group is not None else 0)
        whole = {kind: shard_group if degrees.size(kind) > 1 else None for kind in GROUP_KINDS}
        whole["replica"] = replicate_group
        rows = [dist.get_process_group_ranks(shard_group)] if shard_group is not None else [[dist.get_rank()]]
        return cls(degrees, position, block_rows=rows, **whole)


def build_zero_groups(mesh, degrees: ShardDegrees) -> ZeroGroups:
    """Every rank's ZeRO groups from the mesh's dp x cp rank table (collective: all ranks call it alike)."""
    table = mesh.rank_table("dp_cp").tolist()
    known = {}
    for name in ("dp_shard_cp", "dp_replicate", "dp_cp"):
        rows = sorted(sorted(row) for row in mesh.rank_table(name).tolist())
        known.setdefault(str(rows), name)
    groups = {}
    for kind in GROUP_KINDS:
        rows = [[row[i] for i in positions] for row in table for positions in degrees.rows(kind)]
        if len(rows[0]) == 1:
            groups[kind] = None
        elif str(sorted(rows)) in known:
            groups[kind] = mesh.group(known[str(sorted(rows))])
        else:
            groups[kind] = mesh.subgroup(rows)
    block_rows = [[row[i] for i in positions] for row in table for positions in degrees.rows("block")]
    return ZeroGroups(degrees, mesh.local_rank("dp_cp"), block_rows=block_rows, **groups)


def checkpoint_mesh(mesh, degrees: ShardDegrees) -> DeviceMesh:
    """A 2-D device mesh (replicas, optimizer pieces) whose coordinate (block, k) is the rank holding optimizer piece
    k in block `block`, so a DTensor [Replicate(), Shard(0)] places each rank's shard where it belongs. For the
    stages' own degrees this is the mesh's (dp_replicate, dp_shard x cp); other degrees get a mesh of their own
    (collective)."""
    shards = mesh.dims.dp_shard * mesh.dims.cp
    natural = degrees.optim == shards and all(degrees.optim_index(t) == t % shards for t in range(degrees.world))
    if natural:
        return mesh.device_mesh["dp_replicate", "dp_shard_cp"]
    table = mesh.rank_table("dp_cp")
    order = [degrees.position_of_optim_piece(block, k) for block in range(degrees.replicas) for k in range(degrees.optim)]
    grid = table[:, order].reshape(-1, degrees.replicas, degrees.optim)
    full = DeviceMesh(mesh.device_mesh.device_type, grid, mesh_dim_names=("zero_rest", "zero_replica", "zero_shard"))
    return full["zero_replica", "zero_shard"]

