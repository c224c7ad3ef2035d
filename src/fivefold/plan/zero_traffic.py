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
