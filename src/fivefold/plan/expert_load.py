"""Uneven expert routing from a measured load: the rows each rank sends each expert-parallel rank, and
what that costs a MoE block.

Input is a run's routing (metrics.jsonl, parallel/expert_placement.py `routing_from_metrics`): per MoE layer
either one list, the assignments per expert of the whole step (`moe_load`), which every rank's tokens are
taken to follow, or one list per expert-parallel position (`moe_load_by_ep_rank`: the assignments made by
the tokens of the ranks at EP position i), so that the routing differs from rank to rank. EP rank i of a
layout routes by position i's list (i mod the positions recorded when the run had fewer; when it had more,
the mean of the positions p with p mod ep = i). Under the runtime's contiguous placement of experts on EP
ranks, rank i sends EP rank j its list's share of its k rows per token for j's experts (capped by the
capacity factor). The row exchanges of parallel/expert_parallel.py then carry a bytes-per-pair matrix (out
to the experts, and its transpose home), priced as the runtime's pairwise exchange (comm/cost.py
`uneven_all_to_all`), and the routed experts of the busiest EP rank compute its rows. The planner
(`fivefold plan --expert-load`) and the simulator (`fivefold simulate --expert-load`) read the same rows
from here.
"""

from __future__ import annotations

import math

from fivefold.config.schema import JobConfig
from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig

Matrix = tuple[tuple[int, ...], ...]  # an uneven all-to-all: [i][j] the bytes member i sends member j


def routed_rows(model: ModelConfig, config: JobConfig, d) -> int:
    """Assignments one rank routes per MoE layer and micro-batch: k per token it holds (its micro-batch's
    sequences after the cp split, and its tp share of them under sequence parallelism). `d` is the layout's
    plan/estimate.py Degrees (not imported: the estimate imports this module)."""
    t = config.train
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1
    return model.moe_top_k * t.micro_batch_size * (t.seq_len // d.cp) // (d.tp if sp else 1)


Rows = list[list[float]]  # [i][j] the rows EP rank i sends EP rank j (one MoE layer, one micro-batch)


def expert_rows_by_load(model: ModelConfig, config: JobConfig, d,
                        load: dict[str, list]) -> dict[int, Rows]:
    """Per MoE layer, the rows each EP rank i sends each EP rank j when its tokens choose experts in proportion
    to `load` (layer -> assignments per expert, or one such list per EP position of the measured run: see the
    module docstring). A rank holds k rows per token; with a capacity factor no expert takes more than its
    capacity's share of them (model/moe.py `expert_capacity`, per whole sequence), which balanced routing never
    reaches. With EPLB's replicas (`expert_parallel.replicas`) the experts sit where the runtime places them and
    each replicated expert's rows are dealt over its copies as the runtime deals them (`_dealt`)."""
    from fivefold.model.moe import expert_capacity
    from fivefold.parallel.expert_placement import contiguous_placement, expected_rank_load, placements_for

    if not model.n_experts or d.ep < 2:
        raise ConfigError("--expert-load changes only how rows cross expert-parallel ranks: it needs a MoE model "
                          "with expert_parallel.degree >= 2")
    ep = config.expert_parallel
    placements = placements_for(model.moe_layers, model.n_experts, d.ep, ep.replicas, ep.load_from) \
        if ep.replicas else None  # EPLB: the placement the runtime computes from its load_from
    seq = config.train.seq_len
    wanted = routed_rows(model, config, d)
    capacity = expert_capacity(model, seq)
    cap = wanted * capacity / (model.moe_top_k * seq) if capacity else float("inf")
    out = {}
    for layer in model.moe_layers:
        sources = _sources(load.get(str(layer)), model.n_experts, layer)
        placement = placements[layer] if placements else contiguous_placement(model.n_experts, d.ep)
        rows = []
        for rank, values in enumerate(_by_rank(sources, d.ep)):
            per_expert = [min(wanted * v / sum(values), cap) for v in values]
            rows.append(_dealt(per_expert, placement, rank) if placements else expected_rank_load(per_expert, placement))
        out[layer] = rows
    return out


def check_expert_load(model: ModelConfig, load: dict[str, list]) -> None:
    """ConfigError unless `load` routes every MoE layer of `model` (before a search prices layouts under it)."""
    if not model.n_experts:
        raise ConfigError("--expert-load routes a mixture-of-experts model's rows: the model has no experts "
                          "(set model.n_experts, or leave out --expert-load)")
    for layer in model.moe_layers:
        _sources(load.get(str(layer)), model.n_experts, layer)


def _dealt(per_expert: list[float], placement: list[list[int]], rank: int) -> list[float]:
    """The rows EP rank `rank` sends each EP rank under EPLB's placement, dealt as the runtime deals them
    (parallel/expert_parallel.py `physical_slots`): its k-th row for an expert with R copies goes to copy
    (k + rank) mod R, the copies in rank order; each expert's rows are whole (rounded) first."""
    from fivefold.parallel.expert_placement import replica_holders

    out = [0.0] * len(placement)
    for expert, holders in replica_holders(placement).items():
        n, copies = round(per_expert[expert]), len(holders)
        for c, holder in enumerate(holders):
            first = (c - rank) % copies  # the first k with (k + rank) mod copies = c
            out[holder] += (n - 1 - first) // copies + 1 if first < n else 0
    return out


def _per_position(values: object) -> bool:
    """Whether a layer's load is one list per expert-parallel position (else one list for every rank)."""
    return isinstance(values, list) and bool(values) and all(isinstance(v, list) for v in values)


def load_positions(load: dict[str, list]) -> int:
    """How many expert-parallel positions a load describes (1: one list per layer, every rank routes by it)."""
    return max((len(v) if _per_position(v) else 1 for v in load.values()), default=1)


def describe_routing(load: dict[str, list]) -> str:
    """Which routing a report replays: the positions' own loads, or the step's load for every rank."""
    positions = load_positions(load)
    return (f"each of its {positions} expert-parallel positions routing by its own load (moe_load_by_ep_rank)"
            if positions > 1 else "every rank routing by its mean load per expert (moe_load)")


def _sources(values: object, experts: int, layer: int) -> list[list[float]]:
    """A layer's load as a list of per-source lists (one list: every rank routes by it)."""
    sources = values if _per_position(values) else [values]
    for row in sources:
        if not isinstance(row, list) or len(row) != experts or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf for v in row) or not sum(row) > 0:
            raise ConfigError(f"--expert-load has no load of {experts} experts for MoE layer {layer} (finite, not "
                              "negative, not all zero, for the layer or for each expert-parallel position): use the "
                              "metrics of a run of the same model (moe_load, moe_load_by_ep_rank records)")
    return sources


def _by_rank(sources: list[list[float]], ep: int) -> list[list[float]]:
    """The list EP rank i routes by: position i mod len(sources), or with more positions than ranks the mean of
    the positions p with p mod ep = i (each position's list scaled to one rank's rows first, by the proportion)."""
    if len(sources) <= ep:
        return [sources[i % len(sources)] for i in range(ep)]
    out = []
    for i in range(ep):
        picked = [[v / sum(row) for v in row] for row in sources[i::ep]]
        out.append([sum(column) / len(picked) for column in zip(*picked)])
    return out


def exchange_matrices(rows: Rows, row_bytes: int) -> tuple[Matrix, Matrix]:
    """The bytes [i][j] EP rank i sends EP rank j: out to the experts (`rows[i][j]` rows), and home (its
    transpose)."""
    out = tuple(tuple(round(r) * row_bytes for r in source) for source in rows)
    return out, tuple(zip(*out))


def received_rows(rows: Rows) -> list[float]:
    """The rows each EP rank receives in one dispatch (its column's sum)."""
    return [sum(column) for column in zip(*rows)]


def busiest_received(rows: Rows, row_bytes: int) -> int:
    """Bytes the busiest EP rank receives in one dispatch."""
    out, _ = exchange_matrices(rows, row_bytes)
    return max(sum(column) for column in zip(*out))


def imbalance(rows: dict[int, Rows]) -> float:
    """The most rows an EP rank receives over the mean, the worst MoE layer's (1 for balanced routing)."""
    worst = 1.0
    for layer_rows in rows.values():
        received = received_rows(layer_rows)
        if sum(received):
            worst = max(worst, max(received) * len(received) / sum(received))
    return worst
