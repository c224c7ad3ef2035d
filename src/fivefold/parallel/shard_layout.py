"""Independent sharding degrees for parameters, gradients and optimizer states (AMSP, MiCS, HSDP).

ZeRO's stages shard the optimizer states (OS), then the gradients (G), then the parameters (P) over
one group of N ranks. AMSP (Chen et al. 2023, "AMSP: Reducing Communication Overhead of ZeRO for
Efficient LLM Training") treats the three as independent: each has its own sharding degree, and
the states are replicated over the ranks that degree leaves. MiCS (Zhang et al. 2022) is the case
p = g = o < D (shard within a partition group, replicate across), torchtitan's HSDP the same with
the groups taken from the mesh. The stages are points of the space:

    ZeRO-1 (1, 1, N)     ZeRO-2 (1, N, N)     ZeRO-3 (N, N, N)     MiCS / HSDP (s, s, s)

Degrees p | g | o | D over the D ranks of the data-parallel x context group, in that group's rank
order t. Blocks of o consecutive ranks each hold one whole copy of the optimizer states; within a
block, position u = t mod o is written in mixed radix

    u = c·g + b·p + a        a < p,  b < g/p,  c < o/g

and the rank holds parameter piece a of p, gradient piece a·(g/p) + b of g and optimizer piece
a·(o/p) + b·(o/g) + c of o (pieces of the flat group in natural order). Each piece lies inside
the larger pieces the same rank holds, and the two groups that communicate every micro-batch are
consecutive ranks (within one node when the degree fits in it); only the once-per-step groups
are strided. The groups (positions in the dp x cp group):

    params   p consecutive ranks (same u // p): all-gather the weights before forward and backward
    grads    g consecutive ranks: reduce-scatter each micro-batch's gradient (chunks sent in position
             order b, a: a transpose of the natural order when 1 < p < g)
    split    the o/g ranks of a block with the same a, b (stride g): reduce-scatter the accumulated
             gradient piece into optimizer pieces, once per step
    replica  the D/o ranks with the same u in every block (stride o): all-reduce the optimizer piece
    publish  the o/p ranks of a block with the same a (stride p): all-gather updated optimizer pieces
             into the parameter piece (they arrive in order c, b; natural order is b, c)
    block    the o ranks of a block: the gradient norm's sum of squares

This module is the arithmetic only (no torch), shared by the runtime (parallel/zero.py), the planner
and the simulator.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fivefold.errors import ConfigError

GROUP_KINDS = ("params", "grads", "split", "replica", "publish", "block")


@dataclass(frozen=True)
class ShardDegrees:
    """Ranks each of parameters, gradients and optimizer states is sharded over, within `world` ranks."""

    params: int
    grads: int
    optim: int
    world: int

    @classmethod
    def for_stage(cls, stage: int, shards: int, world: int | None = None) -> "ShardDegrees":
        """ZeRO `stage` over `shards` ranks, replicated over world / shards (default: no replicas)."""
        world = shards if world is None else world
        return cls(shards if stage >= 3 else 1, shards if stage >= 2 else 1, shards if stage >= 1 else 1, world)

    @classmethod
    def resolve(cls, stage: int, shards: int, world: int, params: int = 0, grads: int = 0,
                optim: int = 0) -> "ShardDegrees":
        """The stage's degrees with any of `params`, `grads`, `optim` (data_parallel.shard_*) set. One left at 0 takes
        the stage's, capped at the next one's (stage 3 with optim = 2 is MiCS over 2: 2 / 2 / 2)."""
        base = cls.for_stage(stage, shards, world)
        optim = optim or base.optim
        grads = grads or min(base.grads, optim)
        degrees = cls(params or min(base.params, grads), grads, optim, world)
        degrees.validate()
        return degrees

    def validate(self) -> None:
        names = {"shard_params": self.params, "shard_grads": self.grads, "shard_optim": self.optim}
        for name, degree in names.items():
            if degree < 1 or self.world % degree:
                divisors = [d for d in range(1, self.world + 1) if self.world % d == 0]
                raise ConfigError(f"data_parallel.{name} = {degree} must divide the {self.world} data-parallel x "
                                  f"context-parallel ranks: use one of {divisors}")
        if self.grads % self.params or self.optim % self.grads:
            raise ConfigError(
                f"data_parallel.shard_params / shard_grads / shard_optim = {self.params} / {self.grads} / {self.optim}: "
                "each must divide the next (parameters sharded at most as finely as gradients, gradients at most as "
                "finely as optimizer states, so every rank's optimizer piece lies inside its gradient and parameter "
                "pieces): e.g. 1 / 2 / 4")

    def matches_stage(self, stage: int) -> bool:
        """Whether these are ZeRO `stage`'s own degrees over `optim` ranks."""
        return self == ShardDegrees.for_stage(stage, self.optim, self.world)

    @property
    def replicas(self) -> int:
        return self.world // self.optim

    @property
    def uniform(self) -> bool:
        """One group shards everything (ZeRO-3 / MiCS / HSDP)."""
        return self.params == self.grads == self.optim

    def describe(self) -> str:
        replicas = f", {self.replicas} replicas" if self.replicas > 1 else ""
        return f"P/G/OS sharded over {self.params}/{self.grads}/{self.optim} of {self.world} ranks{replicas}"

    # --------------------------------------------------------------- a rank's pieces
    def digits(self, t: int) -> tuple[int, int, int]:
        """(a, b, c) of position t: u = t mod o = c·g + b·p + a."""
        u = t % self.optim
        return u % self.params, (u // self.params) % (self.grads // self.params), u // self.grads

    def param_index(self, t: int) -> int:
        return self.digits(t)[0]

    def grad_index(self, t: int) -> int:
        a, b, _ = self.digits(t)
        return a * (self.grads // self.params) + b

    def optim_index(self, t: int) -> int:
        a, b, c = self.digits(t)
        return a * (self.optim // self.params) + b * (self.optim // self.grads) + c

    def position_of_optim_piece(self, block: int, index: int) -> int:
        """The position holding optimizer piece `index` in block `block` (inverse of optim_index)."""
        a, rest = divmod(index, self.optim // self.params)
        b, c = divmod(rest, self.optim // self.grads)
        return block * self.optim + c * self.grads + b * self.params + a

    @property
    def grad_permuted(self) -> bool:
        """Whether the gradient reduce-scatter sends chunks out of natural order (transpose p x g/p)."""
        return 1 < self.params < self.grads

    @property
    def publish_permuted(self) -> bool:
        """Whether the publish all-gather receives pieces out of natural order (transpose o/g x g/p)."""
        return self.grads > self.params and self.optim > self.grads

    # ---------------------------------------------------------------------- groups
    def rows(self, kind: str) -> list[list[int]]:
        """Every group of `kind` (GROUP_KINDS) as positions 0 .. world-1, each row in ascending order."""
        o, g, p, world = self.optim, self.grads, self.params, self.world
        if kind == "params":
            return [list(range(s, s + p)) for s in range(0, world, p)]
        if kind == "grads":
            return [list(range(s, s + g)) for s in range(0, world, g)]
        if kind == "block":
            return [list(range(s, s + o)) for s in range(0, world, o)]
        if kind == "split":
            return [list(range(s + j, s + o, g)) for s in range(0, world, o) for j in range(g)]
        if kind == "publish":
            return [list(range(s + a, s + o, p)) for s in range(0, world, o) for a in range(p)]
        if kind == "replica":
            return [list(range(u, world, o)) for u in range(o)]
        raise ValueError(f"unknown group kind {kind!r}: one of {GROUP_KINDS}")

    def size(self, kind: str) -> int:
        """Ranks in each group of `kind`."""
        return {"params": self.params, "grads": self.grads, "split": self.optim // self.grads,
                "replica": self.replicas, "publish": self.optim // self.params, "block": self.optim}[kind]

    def span(self, kind: str) -> int:
        """Consecutive positions a group of `kind` stretches over (its first to its last member)."""
        stride = {"params": 1, "grads": 1, "block": 1, "split": self.grads, "publish": self.params,
                  "replica": self.optim}[kind]
        return (self.size(kind) - 1) * stride + 1

    def group_of(self, kind: str, t: int) -> list[int]:
        return next(row for row in self.rows(kind) if t in row)


def stage_degrees(dp, shards: int, world: int) -> ShardDegrees:
    """The degrees a DataParallelConfig asks for: zero_stage's over `shards` (dp_shard x cp) within `world` (dp x cp)
    ranks, each shard_* override applied; ZeRO++ needs one group for everything."""
    zero_pp = dp.quantized_weights or dp.hpz_partition > 1 or dp.quantized_gradients != "none"
    return _stage_degrees(dp.zero_stage, shards, world, dp.shard_params, dp.shard_grads, dp.shard_optim, zero_pp,
                          dp.hpz_partition)


@functools.lru_cache(maxsize=4096)  # a planner search resolves the same few degrees tens of thousands of times
def _stage_degrees(stage: int, shards: int, world: int, params: int, grads: int, optim: int, zero_pp: bool,
                   hpz_partition: int) -> ShardDegrees:
    degrees = ShardDegrees.resolve(stage, shards, world, params, grads, optim)
    if zero_pp and not degrees.uniform:
        raise ConfigError(f"ZeRO++ (quantized_weights, hpz_partition, quantized_gradients) works on one shard group for "
                          f"parameters, gradients and optimizer states, but {degrees.describe()}: leave "
                          "data_parallel.shard_params / shard_grads / shard_optim equal (or at 0)")
    if zero_pp and degrees.optim % hpz_partition:
        raise ConfigError(f"data_parallel.hpz_partition = {hpz_partition} must divide the shard degree {degrees.optim}")
    return degrees


def config_degrees(config, dims) -> ShardDegrees | None:
    """The ZeRO degrees of a JobConfig on ParallelDims `dims` (None without ZeRO)."""
    dp = config.data_parallel
    if dp.mode != "ddp" or dp.zero_stage == 0:
        return None
    return stage_degrees(dp, dims.dp_shard * dims.cp, dims.dp_replicate * dims.dp_shard * dims.cp)
