"""Search over layouts: enumerate, reject with a reason, rank the rest by predicted step time.

For a fixed global batch (sequences per optimizer step) on N accelerators, each candidate picks
tp (powers of two up to the accelerators of a node and the heads), pp (dividing the blocks),
cp, ep (MoE models), dp = N / (tp pp cp), a ZeRO stage (sharded over all of dp), CPU offload,
recomputation, the micro-batch (the rest of the batch is accumulation, the pipeline's micro-
batches) and, with pp > 1, the schedule (1f1b, interleaved with 2 virtual stages, zb-h1, gpipe).
Sequence parallelism is on whenever tp > 1 (it only saves memory and moves the same bytes).

Each candidate is a `JobConfig` checked by the runtime's own validation (the rejection reason is
its error's setting: "tensor_parallel.degree", "pipeline_parallel.schedule", ...), then by memory
(the planner's estimate over the accelerator's capacity: "memory"); a pipelined candidate over
the cap first gets its blocks moved off its fullest ranks (`fit_stages`: an uneven split, the
DAPPLE-style memory-aware stage planning); the survivors are ranked by predicted step time. The best ZeRO layouts are then tried again with other
sharding degrees of parameters, gradients and optimizer states (`degree_options`: each of P, G, OS
over 1, the ranks of one node, or all of dp x cp; AMSP's scale-aware choice, MiCS), and those that
fit join the ranking. Last, each of the best pipelined layouts whose data-parallel replicas and
stages could not all share a node is priced with the pipeline inside data parallelism as well
(`placement_options`: pipeline_parallel.placement = inner, one pipeline's stages on neighbouring
ranks and the gradient reduction across nodes), the stage placement the runtime builds.
The winner is written as a complete TOML file that `train` loads unchanged.

The data-parallel rules (which read none of recomputation, micro-batch or schedule) are checked once
for each family of layouts differing only in those, so a refused family is counted without being built.
Every candidate's memory is estimated before its time, and pipeline simulations are shared
between candidates with the same (schedule, pp, micro-batches, virtual stages) and stage-time
ratios, so a 1,024-GPU search over tens of thousands of candidates takes seconds; the first pass is shared
by forked worker processes (plan/workers.py), each candidate keeping its place so the merge is exact.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from dataclasses import dataclass, field

from fivefold.config.schema import JobConfig
from fivefold.errors import ConfigError
from fivefold.plan.cluster import ClusterSpec
from fivefold.plan.estimate import Estimate, PipelineRuns, estimate, model_for

SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("gpipe", 1))


@dataclass
class SearchResult:
    ranked: list[tuple[JobConfig, Estimate]]
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> one full message
    considered: int = 0
    rebalanced: int = 0  # pipelined layouts that fit only with blocks moved off their fullest rank
    degree_options: int = 0  # the best ZeRO layouts tried again with other P/G/OS sharding degrees
    placements: int = 0  # the best pipelined layouts tried again with the pipeline inside data parallelism
    workers: int = 1  # processes that priced the first pass


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def reason_of(message: str) -> str:
    """The setting a runtime error names first ("tensor_parallel.degree = 3 must ..." -> tensor_parallel.degree)."""
    found = re.search(r"\b([a-z_]+\.[a-z_]+)\b", message)
    return found.group(1) if found else message.split(":")[0][:40]


def candidates(base: JobConfig, gpus: int, cluster: ClusterSpec, global_batch: int, offload: bool = True,
               vocab_size: int = 0, refuse_families: bool = True):
    """Every layout of the space, as JobConfigs (not yet validated otherwise), or as a `Refused` family whose
    data-parallel settings the runtime refuses. Pipelined ones carry their stage split explicitly
    (pipeline_parallel.layers_per_stage, the cost-balanced split of pipeline/stages.py). refuse_families=False
    yields every layout one by one (the slow reference the tests compare with)."""
    from fivefold.parallel.pipeline.stages import plan_stages

    model = base.model
    sized = model_for(base, vocab_size) if model.vocab_size == 0 else model
    splits: dict[int, list[int]] = {}

    def split_for(stages: int) -> list[int]:
        if stages not in splits:
            try:
                splits[stages] = [len(s) for s in plan_stages(sized, base.train.seq_len, stages, None,
                                                              base.pipeline_parallel.balance)]
            except ConfigError:
                splits[stages] = []  # more stages than blocks: the runtime's check names it
        return splits[stages]

    tps = [t for t in _powers_of_two(min(cluster.accelerators_per_node, gpus)) if gpus % t == 0]
    pps = [p for p in _divisors(gpus) if p <= model.n_layers]
    cps = [c for c in _powers_of_two(min(8, gpus)) if gpus % c == 0]
    eps = [e for e in _divisors(gpus) if model.n_experts and model.n_experts % e == 0] if model.n_experts else [1]
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        micro_batches = [b for b in _powers_of_two(per_replica) if per_replica % b == 0]
        schedules = SCHEDULES if pp > 1 else (("1f1b", 1),)
        recomputes = ("none", "selective", "full")
        for ep, zero, off in itertools.product(eps, (0, 1, 2, 3), (False, True) if offload else (False,)):
            if off and zero == 0:
                continue
            family = []  # the layouts that differ only in recomputation, micro-batch and schedule
            for recompute, micro, (schedule, virtual) in itertools.product(recomputes, micro_batches, schedules):
                layers = split_for(pp * virtual) if pp > 1 else []
                family.append((recompute, micro, per_replica // micro, schedule, virtual, layers))
            shared = _family(base, tp, cp, dp, ep, zero, off)
            if refuse_families:  # the runtime's data-parallel rules read none of what varies inside a family
                try:
                    _member(shared, pp, *family[0]).validate_data_parallel()
                except ConfigError as exc:
                    yield Refused(len(family), exc)
                    continue
            for member in family:
                yield _member(shared, pp, *member)


@dataclass(frozen=True)
class Refused:
    """`count` candidates of `candidates` refused together by one runtime check (`error`)."""

    count: int
    error: ConfigError


def _family(base: JobConfig, tp: int, cp: int, dp: int, ep: int, zero: int, offload: bool) -> JobConfig:
    """The sections a family of layouts shares (one object each, for all its members)."""
    r = dataclasses.replace
    return r(base,
             data_parallel=r(base.data_parallel, replicate=1 if zero else dp, shard=dp if zero else 1, zero_stage=zero,
                             offload=offload, param_dtype=_param_dtype(base, zero)),
             tensor_parallel=r(base.tensor_parallel, degree=tp, sequence_parallel=tp > 1),
             context_parallel=r(base.context_parallel, degree=cp),
             expert_parallel=r(base.expert_parallel, degree=ep))


def _member(family: JobConfig, pp: int, recompute: str, micro: int, accum: int, schedule: str, virtual: int,
            layers: list[int]) -> JobConfig:
    r = dataclasses.replace
    return r(family,
             train=r(family.train, micro_batch_size=micro, grad_accum_steps=accum, recompute=recompute),
             # tp > 1 always comes with sequence parallelism here, whose stage messages are already split over tp
             pipeline_parallel=r(family.pipeline_parallel, degree=pp, schedule=schedule, virtual=virtual,
                                 layers_per_stage=list(layers), scatter_gather=False))


def fit_stages(config: JobConfig, found: Estimate, gpus: int, cluster: ClusterSpec, efficiency: float = 0.5,
               vocab_size: int = 0, runs: PipelineRuns | None = None,
               expert_load: dict[str, list] | None = None) -> tuple[JobConfig, Estimate] | None:
    """Pipeline planning under a memory cap: move blocks, one at a time, off the pipeline rank furthest over the
    accelerator's memory (1F1B's first ranks hold the most micro-batches in flight, the last the logits) to the
    neighbouring stage whose rank has the most room, until every rank fits. With interleaving (v virtual stages
    per rank, stage s on rank s mod p) the block leaves the over-full rank's largest stage for the stage before
    or after it, which another rank holds. Returns the uneven split (as an explicit
    pipeline_parallel.layers_per_stage, which the runtime runs as written) with its estimate, or None.

    Tried only where it can work: an explicit split, some rank with room, and the ranks' total within their caps."""
    pipe = config.pipeline_parallel
    cap, ranks = found.capacity, found.per_pp_rank
    if pipe.degree == 1 or not pipe.layers_per_stage or min(m.total for m in ranks) >= cap \
            or sum(m.total for m in ranks) > cap * len(ranks):
        return None
    pp, split, seen = pipe.degree, list(pipe.layers_per_stage), set()
    while tuple(split) not in seen:
        seen.add(tuple(split))
        over = max(range(len(ranks)), key=lambda r: ranks[r].total)
        moves = [(stage, to) for stage in range(over, len(split), pp) if split[stage] > 1
                 for to in (stage - 1, stage + 1) if 0 <= to < len(split) and to % pp != over]
        if not moves:
            return None
        stage, to = min(moves, key=lambda move: (-split[move[0]], ranks[move[1] % pp].total))
        split[stage] -= 1
        split[to] += 1
        moved = dataclasses.replace(config, pipeline_parallel=dataclasses.replace(pipe, layers_per_stage=list(split)))
        found = estimate(moved, gpus, cluster, efficiency, vocab_size, runs, time_if_over=False, simulate=False,
                         expert_load=load_for(moved, expert_load))
        if found.fits:
            return moved, found
        ranks = found.per_pp_rank
    return None


def load_for(config: JobConfig, expert_load: dict[str, list] | None) -> dict[str, list] | None:
    """A measured expert load (plan/expert_load.py) for the layouts it changes: those with expert parallelism
    (the others exchange no rows)."""
    return expert_load if expert_load is not None and config.expert_parallel.degree > 1 else None


def _rank_key(pair: tuple[JobConfig, Estimate]) -> tuple[float, int]:
    """Fastest first; of equally fast layouts (the same to three significant digits), the least memory first."""
    found = pair[1]
    return float(f"{found.time.total:.3g}"), found.memory.total


def _param_dtype(base: JobConfig, zero: int) -> str:
    """bf16 compute weights under ZeRO when the run computes in bf16 (or asked for them); DDP keeps fp32."""
    wanted = base.train.dtype == "bf16" or base.data_parallel.param_dtype == "bf16"
    return "bf16" if zero and wanted else "fp32"


def degree_options(config: JobConfig, gpus: int, cluster: ClusterSpec, every_divisor: bool = False) -> list[JobConfig]:
    """ZeRO layouts with other sharding degrees of parameters, gradients and optimizer states over the same dp x cp
    ranks D (AMSP / MiCS, parallel/shard_layout.py): every p | g | o | D drawn from {1, the dp x cp ranks of one
    node, D} (or every divisor of D), without the config's own degrees. Pipelined layouts keep p = g = 1 (the
    runtime's rule); ZeRO++ layouts are left alone (one shard group)."""
    from fivefold.parallel.shard_layout import stage_degrees

    z, d = config.data_parallel, None
    if z.mode != "ddp" or not z.zero_stage or z.quantized_weights or z.hpz_partition > 1 or z.gradient_bits:
        return []
    try:
        from fivefold.plan.estimate import degrees_of, zero_degrees

        d = degrees_of(config, gpus)
        own = zero_degrees(config, d)
    except ConfigError:
        return []
    world = d.dp * d.cp
    in_node = max(n for n in _divisors(world) if n * d.tp <= max(cluster.accelerators_per_node, d.tp))
    sizes = _divisors(world) if every_divisor else sorted({1, in_node, world})
    out = []
    for p, g, o in itertools.product(sizes, repeat=3):
        if g % p or o % g or o < 2 or (d.pp > 1 and g > 1) or (p, g, o) == (own.params, own.grads, own.optim):
            continue
        stage = 3 if p > 1 else 2 if g > 1 else 1
        dp = dataclasses.replace(z, zero_stage=stage, shard_params=p, shard_grads=g, shard_optim=o)
        try:
            stage_degrees(dp, d.dp_shard * d.cp, world)
        except ConfigError:
            continue
        out.append(dataclasses.replace(config, data_parallel=dp))
    return out


def placement_options(config: JobConfig, gpus: int, cluster: ClusterSpec) -> list[JobConfig]:
    """The layout with its pipeline stages placed the other way (pipeline_parallel.placement, parallel/mesh.py),
    where that moves a group into or out of a node: data parallelism beside a pipeline, on more than one node, with
    room in a node beside a tp x cp block. Elsewhere both placements price alike."""
    pipe = config.pipeline_parallel
    block = config.tensor_parallel.degree * config.context_parallel.degree
    if pipe.degree == 1 or gpus <= cluster.accelerators_per_node or gpus == pipe.degree * block \
            or block >= cluster.accelerators_per_node:
        return []
    other = "inner" if pipe.placement == "outer" else "outer"
    return [dataclasses.replace(config, pipeline_parallel=dataclasses.replace(pipe, placement=other))]


def choose_degrees(config: JobConfig, gpus: int, cluster: ClusterSpec, efficiency: float = 0.5, vocab_size: int = 0,
                   every_divisor: bool = True) -> list[tuple[JobConfig, Estimate]]:
    """The config and its other sharding degrees (degree_options) that fit the accelerator's memory, fastest
    first: AMSP's scale-aware choice of P/G/OS degrees under a memory cap."""
    runs, out = PipelineRuns(), []
    for option in [config, *degree_options(config, gpus, cluster, every_divisor)]:
        found = estimate(option, gpus, cluster, efficiency, vocab_size, runs, time_if_over=False)
        if found.fits:
            out.append((option, found))
    return sorted(out, key=_rank_key)


@dataclass
class _Priced:
    """A share of the first pass: each candidate by its place in `candidates`' order, so that shares priced in
    different processes merge into what one process pricing them in order finds."""

    ranked: list[tuple[int, JobConfig | None, Estimate]] = field(default_factory=list)  # config: a moved split
    rejected: Counter = field(default_factory=Counter)
    first: dict[str, tuple[int, str]] = field(default_factory=dict)  # reason -> (place, message) of its first
    rebalanced: int = 0

    def reject(self, place: int, reason: str, message: str, count: int = 1) -> None:
        self.rejected[reason] += count
        if reason not in self.first:
            self.first[reason] = (place, message)

    def merge(self, other: _Priced) -> None:
        self.ranked += other.ranked
        self.rejected += other.rejected
        for reason, (place, message) in other.first.items():
            if reason not in self.first or place < self.first[reason][0]:
                self.first[reason] = (place, message)
        self.rebalanced += other.rebalanced


def _price(share: list[tuple[int, JobConfig]], gpus: int, cluster: ClusterSpec, efficiency: float, vocab_size: int,
           runs: PipelineRuns, expert_load: dict[str, list] | None = None) -> _Priced:
    """The first pass over a share of the candidates: the runtime's checks, memory, a split moved to fit
    (`fit_stages`), and the step time with the pipeline's closed-form bubble."""
    out = _Priced()
    for place, config in share:
        try:
            found = estimate(config, gpus, cluster, efficiency, vocab_size, runs, time_if_over=False, simulate=False,
                             expert_load=load_for(config, expert_load))
        except ConfigError as exc:
            out.reject(place, reason_of(str(exc)), str(exc))
            continue
        if not found.fits:
            moved = fit_stages(config, found, gpus, cluster, efficiency, vocab_size, runs, expert_load)
            if moved is not None:
                out.rebalanced += 1
                out.ranked.append((place, *moved))
                continue
            out.reject(place, "memory", f"{found.memory.total / 2**30:.1f} GiB per rank over the "
                                        f"{found.capacity / 2**30:.0f} GiB of a {cluster.accelerator.name}")
            continue
        out.ranked.append((place, None, found))
    return out


def search(base: JobConfig, gpus: int, cluster: ClusterSpec, global_batch: int, efficiency: float = 0.5,
           vocab_size: int = 0, offload: bool = True, refine: int = 50, workers: int = 1,
           expert_load: dict[str, list] | None = None) -> SearchResult:
    """Rank every feasible layout by predicted step time (fastest first).

    A first pass prices pipelines by the closed-form ideal bubble; the `refine` best are then estimated
    again with the schedule simulator and re-ranked, so the top of the list carries simulated times.
    workers: processes that share the first pass (plan/workers.py; forked on Linux); the result is the same
    for any number. expert_load: a MoE run's measured routing (`fivefold plan --expert-load`), which prices every
    layout with expert parallelism under it (`load_for`): its uneven exchanges, busiest rank's experts and memory."""
    from fivefold.plan.workers import map_shares

    if global_batch < 1:
        raise ConfigError(f"--global-batch = {global_batch}: must be a positive number of sequences")
    if workers < 1:
        raise ConfigError(f"--workers = {workers}: must be at least 1 (processes sharing the search)")
    if base.data_parallel.mode == "ps":
        raise ConfigError("--search ranks all-reduce layouts (every fold, ZeRO 0-3); data_parallel.mode = ps has one "
                          "layout per server count: plan it without --search, or set data_parallel.mode = ddp")
    if expert_load is not None:
        from fivefold.plan.expert_load import check_expert_load

        check_expert_load(model_for(base, vocab_size), expert_load)
    result, runs, priced, todo = SearchResult([]), PipelineRuns(), _Priced(), []
    for place, config in enumerate(candidates(base, gpus, cluster, global_batch, offload, vocab_size)):
        if isinstance(config, Refused):
            result.considered += config.count
            priced.reject(place, reason_of(str(config.error)), str(config.error), config.count)
        else:
            result.considered += 1
            todo.append((place, config))
    shares = map_shares(lambda share: _price(share, gpus, cluster, efficiency, vocab_size, runs, expert_load), todo,
                        workers)
    for share in shares:
        priced.merge(share)
    result.workers = len(shares)
    configs = dict(todo)
    result.ranked = [(moved or configs[place], found) for place, moved, found in sorted(priced.ranked, key=lambda r: r[0])]
    firsts = sorted(priced.first.items(), key=lambda item: item[1][0])  # reasons in the order one pass meets them
    result.rejected = Counter({reason: priced.rejected[reason] for reason, _ in firsts})
    result.examples = {reason: message for reason, (_, message) in firsts}
    result.rebalanced = priced.rebalanced
    if not result.ranked and not result.considered:
        raise ConfigError(f"no layout of {gpus} accelerators splits a global batch of {global_batch} sequences: "
                          "make --global-batch a multiple of a data-parallel degree (e.g. of --gpus)")
    result.ranked.sort(key=_rank_key)
    best = [(config, estimate(config, gpus, cluster, efficiency, vocab_size, runs, expert_load=load_for(config, expert_load)))
            for config, _ in result.ranked[:refine]]
    for config, _ in list(best):  # the best ZeRO layouts again with other P/G/OS sharding degrees (AMSP, MiCS)
        for option in degree_options(config, gpus, cluster):
            result.considered += 1
            result.degree_options += 1
            found = estimate(option, gpus, cluster, efficiency, vocab_size, runs, time_if_over=False,
                             expert_load=load_for(option, expert_load))
            if found.fits:
                best.append((option, found))
            else:
                result.rejected["memory"] += 1
    for config, _ in list(best):  # the stages placed inside data parallelism
        for option in placement_options(config, gpus, cluster):
            result.considered += 1
            result.placements += 1
            best.append((option, estimate(option, gpus, cluster, efficiency, vocab_size, runs,
                                          expert_load=load_for(option, expert_load))))
    result.ranked[:refine] = sorted(best, key=_rank_key)
    return result
