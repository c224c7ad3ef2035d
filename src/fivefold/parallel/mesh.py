"""Parallel dimensions and the device mesh they define.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp), tp innermost:
consecutive global ranks form a tensor-parallel group, so with tp <= GPUs per node a TP group
never leaves a node (its all-reduces are the most frequent and the largest). Then context,
then data (sharded, then replicated), then pipeline outermost, whose point-to-point traffic is
the lightest and can cross the slowest links. Expert parallelism borrows ranks from
dp_shard x cp (it must divide that product) and adds no ranks of its own.

The mesh is a `torch.distributed.device_mesh.DeviceMesh` with these names, plus three flattened
dimensions: `dp` = (dp_replicate, dp_shard), over which batches are split; `dp_cp` =
(dp_replicate, dp_shard, cp), over which gradients are summed and the loss is token-weighted
(context-parallel ranks hold the same weights and different tokens); and `dp_shard_cp` =
(dp_shard, cp), over which ZeRO shards model states (as torchtitan's FSDP does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fivefold.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} = {getattr(self, name)}: must be a positive integer")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel dims multiply to pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                f"x cp {self.cp} x tp {self.tp} = {product}, but the world size is {self.world_size}: "
                "make the product equal the number of processes (--nproc-per-node x nodes)"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"parallel.ep = {self.ep} must divide dp_shard x cp = {self.dp_shard * self.cp} (experts borrow those ranks)"
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways each global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def describe_degrees(self) -> str:
        """The degrees in one line, for logs: 'dp 2 x cp 2 x tp 1 x pp 1'."""
        return " x ".join(f"{name} {value}" for name, value in
                          (("dp", self.dp), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp)))

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major, tp innermost)."""
        coords = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        coords["dp"] = coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]
        return {name: coords[name] for name in (*MESH_DIMS, "dp")}

    def describe(self) -> str:
        """The rank grid, one line per (pp, dp_replicate) block, for logs and docs."""
        lines = [f"world {self.world_size} = " + " x ".join(f"{n} {getattr(self, n)}" for n in MESH_DIMS)]
        per_block = self.dp_shard * self.cp * self.tp
        for block in range(self.world_size // per_block):
            ranks = list(range(block * per_block, (block + 1) * per_block))
            lines.append(f"  block {block}: ranks {ranks}")
        return "\n".join(lines)


@dataclass
class Mesh:
    """The DeviceMesh over MESH_DIMS, and the flattened data-parallel mesh kept beside it."""

    dims: ParallelDims
    device_mesh: DeviceMesh
    flattened: dict[str, DeviceMesh]

    def _sub(self, name: str) -> DeviceMesh:
        return self.flattened[name] if name in self.flattened else self.device_mesh[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self._sub(name).get_group()

    def local_rank(self, name: str) -> int:
        return self._sub(name).get_local_rank()

    def ranks(self, name: str) -> list[int]:
        return dist.get_process_group_ranks(self.group(name))

    def rank_table(self, name: str) -> torch.Tensor:
        """Global ranks of every group along mesh dimension `name`: one row per group, in group-rank order."""
        table = self.device_mesh.mesh.movedim(MESH_DIMS.index(name), -1)
        return table.reshape(-1, table.shape[-1])


def build_mesh(dims: ParallelDims, device_type: str) -> Mesh:
    """Build the mesh (needs an initialised process group; every rank must call this)."""
    device_mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
    flattened = {
        "dp": device_mesh["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_cp": device_mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        "dp_shard_cp": device_mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
    }
    return Mesh(dims, device_mesh, flattened)
