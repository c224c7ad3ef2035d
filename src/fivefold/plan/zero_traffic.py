"""Bytes one rank sends per optimizer step in ZeRO-3's collectives, plain or with ZeRO++ (Wang et al. 2023).

Each collective counts its ring-form volume, as the runtime's counter does (parallel/zero_pp.py
ZeroTraffic): (p - 1)/p of the vector for an all-gather, reduce-scatter or all-to-all over p
ranks, 2 (p - 1)/p for an all-reduce. Per step, with N shard ranks on K nodes of L, m micro-
batches, w bytes per weight, r per reduced gradient, q = bits/8 + 4/block per quantised value:

    forward all-gather    blocks every micro-batch, the rest (embedding, norm, head) once:
                          (N-1)/N x w x (m B + R), qwZ: q(8) in place of w
    backward all-gather   blocks every micro-batch: m (N-1)/N w B; hpZ: m (h-1)/h w B, within a node
    reduce-scatter        every unit every micro-batch: m (N-1)/N r (B + R);
                          qgZ: m q (B + R) [(L-1)/L within the node + (K-1)/K / L across the nodes]
    replica all-reduce    hybrid sharding, once: 2 (D-1)/D r (B + R)/N over the D replicas

B and R are the parameters of the blocks and of the rest held by this rank (its tensor/pipeline
part); the vectors are the flat groups padded to a multiple of N, and under qwZ/qgZ each row to
a multiple of the block, so counts are exact when `groups` gives the runtime's flat group sizes.
`sharded_step_bytes` counts the same for any sharding degrees of parameters, gradients and optimizer
states (ZeRO-1/2/3, MiCS, AMSP; no ZeRO++).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroShape:
    """The ZeRO-3 group geometry and options that decide its traffic."""

    shards: int  # N
    nodes: int = 1  # K: nodes the shard group spans (N = K x L)
    hpz: int = 1
    quantized_weights: bool = False
    gradient_bits: int = 0
    block: int = 256
    weight_bytes: int = 4
    reduce_bytes: int = 4
    replicas: int = 1
    replicas_span_nodes: bool = True

    @property
    def per_node(self) -> int:
        return self.shards // self.nodes


def quantized_parts(elements: int, bits: int, block: int) -> tuple[int, int]:
    """(code bytes, fp32 scale bytes) of one row of `elements` values quantised in blocks (parallel/zero_pp.py
    quantize_rows): the row is padded to a multiple of the block."""
    padded = -(-elements // block) * block
    return padded * bits // 8, 4 * (padded // block)


def quantized_bytes(elements: int, bits: int, block: int) -> int:
    """Bytes on the wire for one quantised row: codes plus scales."""
    return sum(quantized_parts(elements, bits, block))


def zero3_step_bytes(groups: list[tuple[int, bool]], shape: ZeroShape, micro_batches: int) -> dict[tuple[str, bool], int]:
    """{(phase, over a group spanning nodes): bytes this rank sends per step} for ZeRO-3 over flat `groups`
    [(elements, belongs to a transformer block)], as parallel/zero.py runs it."""
    n, k, m = shape.shards, shape.nodes, micro_batches
    per_node, cross = shape.per_node, k > 1
    out: dict[tuple[str, bool], int] = {}

    def add(phase: str, over_nodes: bool, p: int, vector: int, times: int = 1, factor: int = 1) -> None:
        if p > 1:
            key = (phase, over_nodes)
            out[key] = out.get(key, 0) + times * (factor * (p - 1) * vector // p)

    for elements, block in groups:
        shard = -(-elements // n)
        padded = shard * n
        if shape.quantized_weights:
            gathered = n * quantized_bytes(shard, 8, shape.block)
        else:
            gathered = padded * shape.weight_bytes
        add("forward all-gather", cross, n, gathered, m if block else 1)
        if block:
            if shape.hpz > 1:
                add("backward all-gather", False, shape.hpz, padded * shape.weight_bytes, m)
            else:
                add("backward all-gather", cross, n, gathered, m)
        if shape.gradient_bits:
            add("reduce-scatter", False, per_node, per_node * quantized_bytes(k * shard, shape.gradient_bits, shape.block), m)
            add("reduce-scatter", True, k, k * quantized_bytes(shard, shape.gradient_bits, shape.block), m)
        else:
            add("reduce-scatter", cross, n, padded * shape.reduce_bytes, m)
        add("replica all-reduce", shape.replicas_span_nodes, shape.replicas, shard * shape.reduce_bytes, factor=2)
    return out


def sharded_step_bytes(groups: list[tuple[int, bool]], params: int, grads: int, optim: int, world: int,
                       spans: dict[str, bool], micro_batches: int, weight_bytes: int = 4,
                       reduce_bytes: int = 4) -> dict[tuple[str, bool], int]:
    """{(phase, over a group spanning nodes): bytes this rank sends per step} with parameters, gradients and
    optimizer states sharded over p | g | o of `world` ranks (parallel/shard_layout.py), as parallel/zero.py runs
    it; `spans` says which kinds of group cross nodes. Per flat group of n elements, padded to P = o ceil(n/o):

        forward all-gather        p > 1, over p: w P, blocks every micro-batch, the rest once
        backward all-gather       p > 1, over p: w P, blocks every micro-batch
        reduce-scatter            g > 1, over g: r P every micro-batch
        optimizer reduce-scatter  over o/g, once: r P (g = 1: the whole gradient), r P/g (g > 1)
        replica all-reduce        over D/o, once: 2 r P/o
        parameter all-gather      over o/p, once: w P/p
    """
    m, out = micro_batches, {}

    def add(phase: str, kind: str, size: int, vector: int, times: int = 1, factor: int = 1) -> None:
        if size > 1:
            key = (phase, spans.get(kind, False))
            out[key] = out.get(key, 0) + times * (factor * (size - 1) * vector // size)

    for elements, block in groups:
        padded = -(-elements // optim) * optim
        add("forward all-gather", "params", params, padded * weight_bytes, m if block else 1)
        if block:
            add("backward all-gather", "params", params, padded * weight_bytes, m)
        add("reduce-scatter", "grads", grads, padded * reduce_bytes, m)
        add("optimizer reduce-scatter", "split", optim // grads, padded // grads * reduce_bytes)
        add("replica all-reduce", "replica", world // optim, padded // optim * reduce_bytes, factor=2)
        add("parameter all-gather", "publish", optim // params, padded // params * weight_bytes)
    return out
