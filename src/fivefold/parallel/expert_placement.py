"""Load-aware expert placement (EPLB, as DeepSeek-V3's expert-parallel load balancer): replicate hot experts
and place the replicas so that every expert-parallel rank gets about the same share of the tokens.

Input: each expert's measured load (assignments per step, from a run's metrics.jsonl `moe_load`), the
expert-parallel degree ep and the slots per rank S = E / ep + extra (`expert_parallel.replicas`).

    replicate   start with one replica per expert; give the ep x S - E spare slots one by one to the
                expert whose load per replica is highest (a replica takes load / replicas)
    place       replicas in decreasing load per replica, each to the rank with the least load so far
                among those with a free slot and no replica of that expert yet (longest-processing-
                time-first greedy)

The runtime sends each assignment of an expert to one of its replicas, spread evenly (the k-th
assignment a rank sends to an expert goes to replica (k + rank) mod replicas), and sums the replicas'
gradients over the ranks holding them, so replicas stay identical. `imbalance` is max / mean of the
ranks' expected load: the figure the placement is judged by.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fivefold.errors import ConfigError


def replica_counts(load: list[float], slots: int, cap: int) -> list[int]:
    """Replicas per expert filling `slots` (>= number of experts) by highest load per replica, at most `cap` each."""
    if not len(load) <= slots <= cap * len(load):
        raise ValueError(f"{slots} slots cannot hold {len(load)} experts of at most {cap} replicas each")
    counts = [1] * len(load)
    for _ in range(slots - len(load)):
        hottest = max((e for e in range(len(load)) if counts[e] < cap), key=lambda e: (load[e] / counts[e], -e))
        counts[hottest] += 1
    return counts


def place_experts(load: list[float], ep: int, slots_per_rank: int) -> list[list[int]]:
    """Each rank's experts (ascending; a replicated expert on several ranks, at most once per rank)."""
    n = len(load)
    if ep * slots_per_rank < n:
        raise ValueError(f"ep {ep} x {slots_per_rank} slots cannot hold {n} experts")
    counts = replica_counts(load, ep * slots_per_rank, cap=ep)  # at most one replica of an expert per rank
    replicas = sorted(((load[e] / counts[e], e) for e in range(n) for _ in range(counts[e])), key=lambda r: (-r[0], r[1]))
    ranks: list[list[int]] = [[] for _ in range(ep)]
    totals = [0.0] * ep
    for share, expert in replicas:
        free = [r for r in range(ep) if len(ranks[r]) < slots_per_rank and expert not in ranks[r]]
        best = min(free, key=lambda r: (totals[r], r))
        ranks[best].append(expert)
        totals[best] += share
    return [sorted(r) for r in ranks]


def replica_holders(placement: list[list[int]]) -> dict[int, list[int]]:
    """Expert -> the ranks holding a copy of it, ascending, for every expert the placement holds."""
    holders: dict[int, list[int]] = {}
    for rank, experts in enumerate(placement):
        for e in experts:
            holders.setdefault(e, []).append(rank)
    return holders


def expected_rank_load(load: list[float], placement: list[list[int]]) -> list[float]:
    """Each rank's share of `load` (per expert) when an expert's load splits evenly over its copies."""
    holders = replica_holders(placement)
    return [sum(load[e] / len(holders[e]) for e in experts) for experts in placement]


def imbalance(load: list[float], placement: list[list[int]]) -> float:
    """max / mean of the ranks' expected load under `placement` (1.0 is perfect)."""
    per_rank = expected_rank_load(load, placement)
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0


def contiguous_placement(n_experts: int, ep: int) -> list[list[int]]:
    """Without a load trace: rank r holds experts r*E/ep .. (r+1)*E/ep - 1."""
    per = n_experts // ep
    return [list(range(r * per, (r + 1) * per)) for r in range(ep)]


def load_from_metrics(path: str | Path, last: int = 10, setting: str = "expert_parallel.load_from") -> dict[str, list[float]]:
    """Each MoE layer's mean load over the last `last` logged steps of a run's metrics.jsonl (`setting`: the
    option that named it, for the errors)."""
    records = _records(path, setting, "moe_load")
    if not records:
        raise ConfigError(f"{setting} = {path} holds no moe_load records (log a MoE run first)")
    records = records[-last:]
    out = {}
    for layer in records[-1]:
        rows = [r[layer] for r in records if layer in r]
        if not all(_is_load(row) and len(row) == len(rows[0]) for row in rows):
            raise ConfigError(f"{setting} = {path}: the moe_load of layer {layer} is not one list of finite, "
                              "non-negative counts per expert in every record: use an unedited metrics.jsonl")
        out[layer] = [sum(values) / len(rows) for values in zip(*rows)]
    return out


def routing_from_metrics(path: str | Path, last: int = 10, setting: str = "--expert-load") -> dict[str, list]:
    """A run's routing as `fivefold plan/simulate --expert-load` replays it (plan/expert_load.py): per MoE layer
    one load list per expert-parallel position (`moe_load_by_ep_rank`, the mean of the last `last` logged steps),
    where the run recorded them (expert parallelism, 2026-11-28 on); else `load_from_metrics`' mean load."""
    records = _records(path, setting, "moe_load_by_ep_rank")[-last:]
    if not records:
        return load_from_metrics(path, last, setting)
    out = {}
    for layer in records[-1]:
        tables = [r[layer] for r in records if layer in r]
        if not all(isinstance(t, list) and len(t) == len(tables[0]) >= 2 and all(_is_load(row) and
                   len(row) == len(tables[0][0]) for row in t) for t in tables):
            raise ConfigError(f"{setting} = {path}: the moe_load_by_ep_rank of layer {layer} is not one list of "
                              "finite, non-negative counts per expert for each of two or more expert-parallel "
                              "positions in every record: use an unedited metrics.jsonl")
        out[layer] = [[sum(values) / len(tables) for values in zip(*rows)] for rows in zip(*tables)]
    return out


def _records(path: str | Path, setting: str, key: str) -> list[dict]:
    """The `key` entries (dicts) of a run's metrics.jsonl, in order (`path`: the file or the run's folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{setting} = {path}: no such metrics.jsonl (a run's output folder or its "
                          "metrics.jsonl, from a run of the same model)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{setting} = {path}: cannot read it as a metrics.jsonl ({exc})") from exc
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get(key), dict):
            records.append(record[key])
    return records


def _is_load(row: object) -> bool:
    return isinstance(row, list) and bool(row) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in row)


def placements_for(layers: list[int], n_experts: int, ep: int, replicas: int, load_from: str) -> dict[int, list[list[int]]]:
    """Every MoE layer's placement: load-aware with `replicas` spare slots per rank, or contiguous."""
    if not replicas:
        return {layer: contiguous_placement(n_experts, ep) for layer in layers}
    loads = load_from_metrics(load_from)
    out = {}
    for layer in layers:
        load = loads.get(str(layer))
        if load is None or len(load) != n_experts:
            raise ConfigError(f"expert_parallel.load_from has no load of {n_experts} experts for MoE layer {layer}: "
                              "use metrics of a run of the same model")
        try:
            out[layer] = place_experts(load, ep, n_experts // ep + replicas)
        except ValueError as exc:
            raise ConfigError(f"expert_parallel.replicas = {replicas}: {exc}") from exc
    return out
