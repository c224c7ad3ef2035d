"""Uneven expert routing from a measured load: the rows each rank sends each expert-parallel rank, and
what that costs a MoE block.

Input is a run's `moe_load` (metrics.jsonl: each MoE layer's assignments per expert over a step, as
parallel/expert_placement.py `load_from_metrics` reads it). A rank's tokens are taken to choose the
experts in that proportion, under the runtime's contiguous placement of experts on EP ranks, so every
rank sends EP rank j the load's share of its k rows per token for j's experts (capped by the capacity
factor). The row exchanges of parallel/expert_parallel.py then carry a bytes-per-pair matrix (out to
the experts, and its transpose home), priced as the runtime's pairwise exchange (comm/cost.py
`uneven_all_to_all`), and the routed experts of the busiest EP rank compute its rows. The planner
(`fivefold plan --expert-load`) and the simulator (`fivefold simulate --expert-load`) read the same
rows from here.
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


def expert_rows_by_load(model: ModelConfig, config: JobConfig, d,
                        load: dict[str, list[float]]) -> dict[int, list[float]]:
    """Per MoE layer, the rows one rank sends each expert-parallel rank when its tokens choose experts in
    proportion to `load` (layer -> assignments per expert). A rank holds k rows per token; with a capacity
    factor no expert takes more than its capacity's share of them (model/moe.py `expert_capacity`, per
    whole sequence), which balanced routing never reaches. With EPLB's replicas (`expert_parallel.replicas`) the
    experts sit where the runtime places them and each replicated expert's rows split evenly over its copies."""
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
        values = load.get(str(layer))
        if values is None or len(values) != model.n_experts or not all(0 <= v < math.inf for v in values) \
                or not sum(values) > 0:
            raise ConfigError(f"--expert-load has no load of {model.n_experts} experts for MoE layer {layer} (finite, "
                              "not negative, not all zero): use the metrics of a run of the same model (moe_load records)")
        per_expert = [min(wanted * v / sum(values), cap) for v in values]
        placement = placements[layer] if placements else contiguous_placement(model.n_experts, d.ep)
        # EPLB: an expert's rows are spread evenly over its replicas (the runtime's (k + rank) mod replicas)
        out[layer] = expected_rank_load(per_expert, placement)
    return out


def exchange_matrices(rows_to: list[float], row_bytes: int) -> tuple[Matrix, Matrix]:
    """The bytes [i][j] EP rank i sends EP rank j: out to the experts (every rank sends `rows_to[j]` rows to j),
    and home (its transpose)."""
    sent = tuple(round(r) * row_bytes for r in rows_to)
    out = (sent,) * len(rows_to)
    return out, tuple(zip(*out))


def busiest_received(rows_to: list[float], row_bytes: int) -> int:
    """Bytes the busiest EP rank receives in one dispatch (every rank sends it the same share)."""
    return len(rows_to) * max(round(r) * row_bytes for r in rows_to)


def imbalance(rows: dict[int, list[float]]) -> float:
    """The most rows an EP rank receives over the mean, the worst MoE layer's (1 for balanced routing)."""
    return max((max(r) * len(r) / sum(r) for r in rows.values() if sum(r)), default=1.0)
