"""The planner's estimate of one layout: memory per rank by component and step time by phase.

Input is a `JobConfig` (the same object `train` runs) and a number of accelerators on a
`ClusterSpec`. Degrees come from the runtime's own `dims_for`, the pipeline split from its
`plan_stages`, and the layout is validated by the runtime's own checks first, so a layout the
planner accepts is one `train` accepts.

Memory per rank (bytes), for every pipeline rank; the report takes the largest:

    parameters, gradients, optimizer   ZeRO accounting (plan/memory.py) of the rank's Ψ
                                       (plan/parameters.py): dense Ψ over dp_shard x cp, routed
                                       experts over EDP; offload moves the optimizer part (fp32
                                       masters and moments) to host memory
    activations                        the block formula (plan/activations.py) on s / cp tokens,
                                       times the blocks of one stage, times the micro-batches the
                                       schedule keeps in flight (the schedule simulator's peak on
                                       this rank's real instruction stream); 4 bytes per element
                                       (fp32), 2 under bf16, plus under autocast over fp32 weights a
                                       dense block's fp32 tensors and per-matmul casts (measured exact
                                       under tp and SP, q/k norms included; estimated for MLA, MoE
                                       MLPs, context parallelism and compiled blocks)
    weight copies                      bf16 autocast over fp32 weights: one bf16 copy of the weights the
                                       rank's blocks and head multiply by (the pipeline executor's
                                       micro-batches share it: one autocast region per step)
    gradients at the peak              one micro-batch on one stage: left out of the total, which holds
                                       instead how far backward climbs above the loss's backward
                                       (`backward_climb`: gradients made, activations freed)
    logits                             the last stage's fp32 logits and their gradient,
                                       2 x 4 x b x s/cp x V_t/t; with the chunked head (chunk c)
                                       4 x b x s/cp + 2 x 4 x c x V_t/t (`logits_bytes`)
    buffers                            ZeRO-3's gathered block (two with prefetch); MoE dispatch
                                       rows (the expected k x tokens x h x 4 in and out)

Step time (seconds) = pipeline makespan + exposed data-parallel communication:

    compute     forward FLOPs of a stage's blocks (2 x matmul parameters x tokens at the
                accelerator's peak x efficiency, the attention core 4 q s per token at peak x the
                attention efficiency, split by tp and cp; with the width law each GEMM at
                efficiency x n / (n + half_width), n = min(K, N) of its weight slice, plan/gemms.py; a MoE
                block's routed expert GEMMs at the expert efficiency when one is given; the head on the last stage), plus the bytes the blocks write outside their
                matmuls (the kept activations, the logits) at its memory bandwidth, plus the
                accelerator's fixed pass_overhead_us per block (a MoE block's by its operators over a
                dense block's, plan/operators.py; under the grouped kernel plus expert_group_us per
                expert the rank holds and grouped call, plan/expert_host.py); backward twice the forward;
                `full` recompute adds a forward to every backward, `selective` the attention
                core's
    optimizer   AdamW reads 16 and writes 12 bytes per parameter it updates (its ZeRO shard) at the
                accelerator's optimizer rate (default: the memory bandwidth), plus its cost per tensor
                updated (parameter tensors; ZeRO's flat groups), on the busiest pipeline rank
    tp          4 all-reduces of b s/cp h per block and micro-batch (ring, on the link the tp group
                spans), 6 with full recompute; not overlapped; plus those outside the blocks (the
                vocab-parallel embedding's and head's, the loss's three, under SP each norm's and the
                MoE router's and shared experts' weight-gradient sums)
    cp          ring attention passes K and V around cp ranks (cp - 1 steps forward, twice that in
                backward), overlapped with the attention core: only the excess is exposed
    ep          per MoE block and pass: the counts' all-to-all (forward only) and 2 of the rows (k per
                token held, out and home) over the EP group; with etp > 1, 2 of etp x the rows over
                the ETP group (its gather and reduce-scatter); balanced routing; the routing
                statistics' all-reduce per micro-batch and the routing report's per step
    pipeline    the schedule simulator run on the schedule's own instruction streams with these
                per-stage times and the activation send time as latency: its makespan includes
                the bubble
    dp          over dp x cp on the link the group spans (routed experts: a second instance over
                their expert-data-parallel group): DDP / ZeRO-1 reduce once in the last
                micro-batch's backward (under a pipeline after the schedule, exposed), ZeRO-2 reduce-scatters in every micro-batch's, ZeRO-3
                also gathers weights in each forward and backward; ZeRO-1/2 gather the updated
                weights after the step; ZeRO's collectives one per flat group (the runtime's);
                only what a pass cannot hide (at least a bucket) counts
    offload     ZeRO-Offload's gradient shard down and weight shard up over the host link

The estimate is a model: its formulas are listed in docs/planner.md with what each is checked
against. Model states are exact against the runtime; the time model's measured error on this machine
(benchmarks/plan_vs_measured.py) is in docs/planner.md.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from fivefold.comm.cost import Link, native_collective, uneven_all_to_all
from fivefold.plan.ring_schedule import ring_pass_seconds
from fivefold.config.schema import JobConfig
from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.plan.activations import (ActivationShape, ExpertRows, autocast_extra_elements, moe_autocast_extra_elements,
                                      block_activation_elements, moe_block_activation_elements)
from fivefold.plan.cluster import Accelerator, ClusterSpec
from fivefold.plan.efficiency import Efficiency, as_efficiency
from fivefold.plan.gemms import block_gemms, core_narrowest, head_gemm
from fivefold.plan.expert_load import busiest_received, exchange_matrices, expert_rows_by_load, imbalance, routed_rows
from fivefold.plan.flops import flops_per_token
from fivefold.plan.memory import nvme_host_bytes, sharded_model_states, zero_model_states
from fivefold.plan.expert_host import group_seconds
from fivefold.plan.operators import operator_ratio, ring_attention_operators, ring_host_share
from fivefold.plan.parameters import (RankParameters, first_block, block_norm_parameters, block_parameters, expert_values, experts_per_rank, flat_group_sizes, padded_vocab,
                                      powersgd_shares, priority_slice_bytes, rank_parameters, rank_tensors)

if TYPE_CHECKING:
    from fivefold.parallel.pipeline.simulate import CoreSharing


LAYOUT_SECTIONS = ("train", "data_parallel", "tensor_parallel", "context_parallel", "pipeline_parallel", "expert_parallel")


@dataclass(frozen=True)
class Degrees:
    dp: int
    dp_shard: int
    tp: int
    cp: int
    pp: int
    ep: int
    etp: int
    replicas: int = 0  # EPLB's spare expert slots per expert-parallel rank (expert_parallel.replicas)
    placement: str = "outer"  # pipeline_parallel.placement (parallel/mesh.py RANK_ORDERS)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def pp_stride(self) -> int:
        """Global ranks between neighbouring pipeline stages: a stage's dp x cp x tp ranks (outer) or cp x tp (inner)."""
        return self.cp * self.tp * (self.dp if self.placement == "outer" else 1)

    @property
    def pp_span(self) -> int:
        """Consecutive ranks holding one pipeline (its stages' messages cross the link this span needs): the
        whole job when the pipeline is outermost."""
        return self.world if self.placement == "outer" else self.pp * self.cp * self.tp

    def fibre_span(self, span: int) -> int:
        """A span of `span` consecutive ranks in one stage's (dp, cp, tp) numbering, as global ranks: the same when
        the pipeline is outermost; inside data parallelism a step of dp jumps over the other stages (pp x cp x tp
        ranks)."""
        block = self.cp * self.tp
        if self.placement == "outer" or self.pp == 1 or span <= block:
            return span
        return (span - 1) // block * self.pp * block + (span - 1) % block + 1

    def describe(self) -> str:
        parts = [f"dp {self.dp}", f"tp {self.tp}", f"pp {self.pp}", f"cp {self.cp}"]
        if self.ep * self.etp > 1:
            parts.append(f"ep {self.ep}" + (f" x etp {self.etp}" if self.etp > 1 else ""))
        return " x ".join(parts) + (" (pipeline inside dp)" if self.placement == "inner" and self.pp > 1 else "")


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank needs on the accelerator, by component, and what offload keeps on the host."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    host: int = 0
    parameter_count: int = 0  # Ψ on this rank (its tensor / pipeline / expert part, before ZeRO)
    buckets: int = 0  # DDP's flat gradient buckets (a second copy of the gradients, in gradient_comm.reduce_dtype)
    nvme: int = 0  # NVMe offload: the optimizer states in this rank's swap file (host keeps the slot ring)
    weight_copies: int = 0  # bf16 autocast over fp32 weights: the bf16 copy of the weights its forward multiplies by
    # the gradients appear only in backward, after the loss's (`backward_climb`): counted in the states, not in the
    # total, which instead holds how far backward climbs above the loss's backward (0 where it never does)
    gradients_after_peak: bool = False
    backward_climb: int = 0

    def __post_init__(self) -> None:
        # sums set once as plain attributes (not fields): a search reads them from some 250,000 rank memories, and
        # functools.cached_property took a lock on each first read (6% of the first pass under the profiler)
        states = self.parameters + self.gradients + self.optimizer
        object.__setattr__(self, "model_states", states)
        object.__setattr__(self, "total", states - (self.gradients - self.backward_climb if self.gradients_after_peak else 0)
                           + self.activations + self.logits + self.buffers + self.buckets + self.weight_copies)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by phase (compute and exposed communication; the bubble is idle time)."""

    compute: float
    tp: float
    cp: float
    ep: float
    pp_comm: float
    bubble: float
    dp: float
    offload: float = 0.0  # optimizer shard's gradients down to the host and weights back up
    optimizer: float = 0.0  # the AdamW step, memory-bound

    @cached_property
    def total(self) -> float:
        return (self.compute + self.tp + self.cp + self.ep + self.pp_comm + self.bubble + self.dp + self.offload
                + self.optimizer)


@dataclass
class Estimate:
    degrees: Degrees
    gpus: int
    memory: RankMemory  # the rank needing the most
    memory_rank: int  # its pipeline rank
    per_pp_rank: list[RankMemory]
    time: StepTime | None  # None: not estimated (over the memory cap in a search)
    tokens_per_step: int
    model_flops_per_step: float
    peak_flops: float
    capacity: int  # accelerator bytes
    notes: list[str] = field(default_factory=list)
    server: RankMemory | None = None  # parameter servers (data_parallel.mode = ps): the one holding the most
    expert_imbalance: float | None = None  # under a measured expert load: the most rows an EP rank receives / the mean

    @property
    def fits(self) -> bool:
        return max(self.memory.total, self.server.total if self.server else 0) <= self.capacity

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.time.total

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.time.total * self.gpus * self.peak_flops)

    def to_dict(self) -> dict:
        return {"degrees": dataclasses.asdict(self.degrees), "gpus": self.gpus, "fits": self.fits,
                "capacity_bytes": self.capacity, "memory_bytes": dataclasses.asdict(self.memory) | {"total": self.memory.total},
                "memory_pp_rank": self.memory_rank,
                "step_seconds": dataclasses.asdict(self.time) | {"total": self.time.total},
                "tokens_per_step": self.tokens_per_step, "tokens_per_second": self.tokens_per_second,
                "mfu": self.mfu, "notes": self.notes} | \
            ({"server_memory_bytes": dataclasses.asdict(self.server) | {"total": self.server.total}} if self.server else {}) | \
            ({"expert_imbalance": self.expert_imbalance} if self.expert_imbalance is not None else {})


def model_for(config: JobConfig, vocab_size: int = 0) -> ModelConfig:
    """The model with its vocabulary known: the config's, the given one, or the byte/BPE tokenizer's."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 0:
        raise ConfigError(f"--vocab-size {vocab_size!r}: must be a whole number of tokens >= 0 (0: the tokenizer's)")
    if config.model.vocab_size:
        return config.model
    model = dataclasses.replace(config.model)
    if model.vocab_size == 0:
        model.vocab_size = vocab_size or {"byte": 257, "bpe": config.data.bpe_vocab_size}.get(config.data.tokenizer, 0)
        if not model.vocab_size:
            raise ConfigError(f"the vocabulary comes from data.tokenizer = {config.data.tokenizer}: give --vocab-size")
    return model


def compute_dtype(config: JobConfig) -> str:
    """The dtype the matmuls run in: bf16 under autocast (train.dtype) or with ZeRO's bf16 compute weights."""
    z = config.data_parallel
    return "bf16" if config.train.dtype == "bf16" or (z.zero_stage and z.param_dtype == "bf16") else "fp32"


def weight_element(config: JobConfig) -> int:
    """Bytes per weight element the collectives move: ZeRO's bf16 compute weights (param_dtype), else fp32."""
    z = config.data_parallel
    return 2 if z.zero_stage and z.param_dtype == "bf16" else 4


def degrees_of(config: JobConfig, gpus: int) -> Degrees:
    """The runtime's checks, then the degrees (`dims_for`): an infeasible layout raises ConfigError with the reason."""
    from fivefold.parallel.expert_parallel import check_expert_parallel, token_fiber_size
    from fivefold.parallel.mesh import dims_for
    from fivefold.parallel.validate import check_config

    config.validate(LAYOUT_SECTIONS)  # a loaded config's other sections were checked by load_config
    check_config(config)
    dims = dims_for(config, gpus)
    ep, tp = config.expert_parallel, config.tensor_parallel
    check_expert_parallel(config.model, ep.degree, ep.alltoall, token_fiber_size(dims, tp.sequence_parallel and tp.degree > 1),
                          ep.tensor, config.data_parallel.zero_stage if config.data_parallel.mode == "ddp" else 0)
    return Degrees(dims.dp, dims.dp_shard, dims.tp, dims.cp, dims.pp, ep.degree, ep.tensor, ep.replicas, dims.placement)


def zero_degrees(config: JobConfig, d: Degrees):
    """The ShardDegrees ZeRO runs with (parallel/shard_layout.py), or None without ZeRO."""
    from fivefold.parallel.shard_layout import stage_degrees

    z = config.data_parallel
    if z.mode != "ddp" or not z.zero_stage:
        return None
    return stage_degrees(z, d.dp_shard * d.cp, d.dp * d.cp)


def _expert_dp(config: JobConfig, d: Degrees) -> int:
    """Ranks of the routed experts' data-parallel group (EDP): the ranks holding a stage's distinct tokens
    (dp x cp, x tp under sequence parallelism) over ep x etp."""
    return max(d.dp * d.cp * (d.tp if config.tensor_parallel.sequence_parallel and d.tp > 1 else 1) // (d.ep * d.etp), 1)


def optimizer_shard(params: RankParameters, config: JobConfig, d: Degrees) -> float:
    """Parameters the rank's optimizer updates: ZeRO shards the dense ones over its optimizer degree and the routed
    experts over their expert-data-parallel group."""
    deg = zero_degrees(config, d)
    if deg is None:
        return params.total
    return params.dense / deg.optim + params.experts / _expert_dp(config, d)


# ---------------------------------------------------------------------------------------------- memory
def _model_states(params: RankParameters, config: JobConfig, d: Degrees) -> tuple[int, int, int]:
    z = config.data_parallel
    if z.mode == "ps":  # a worker holds fp32 weights and gradients; AdamW lives on the servers
        return 4 * params.total, 4 * params.total, 0
    mixed = z.zero_stage > 0 and z.param_dtype == "bf16"
    deg = zero_degrees(config, d)
    dense = (sharded_model_states(params.dense, deg.params, deg.grads, deg.optim, mixed, z.offload) if deg
             else zero_model_states(params.dense, 0, 1, mixed))
    routed = zero_model_states(params.experts, z.zero_stage, _expert_dp(config, d) if z.zero_stage else 1, mixed,
                               z.offload)
    return (dense.parameters + routed.parameters, dense.gradients + routed.gradients, dense.optimizer + routed.optimizer)


def autocast_copies(config: JobConfig) -> bool:
    """Whether the matmuls run under bf16 autocast over fp32 weights: then the forward casts the weights it
    multiplies by to bf16 and autograd keeps those copies until backward (autocast caches a cast for one
    autocast region: the pipeline executor keeps one region over a step's compute, so its micro-batches in
    flight share one copy), and RMSNorm and the residual stream keep fp32 tensors."""
    z = config.data_parallel
    return config.train.dtype == "bf16" and not (z.zero_stage and z.param_dtype == "bf16")


def weight_copy_bytes(config: JobConfig, model: ModelConfig, d: Degrees, blocks: dict[bool, int], in_flight: int,
                      last: bool, held: int) -> int:
    """Bytes of bf16 weight copies a rank's autograd graphs keep under autocast (`autocast_copies`).

    The matmul weights of `blocks` (dense and MoE block counts: attention, dense and shared MLPs, and the
    routed experts' under the loop kernel (not the router's, which runs in fp32), whose Linear layers autocast casts; the grouped kernel's stacks are
    activations, `moe_mlp_elements`; not the norms') count once for each of `in_flight` micro-batches keeping
    their own.
    They do not count under full recomputation, whose forward keeps nothing, nor under train.compile, whose
    graphs cast the weights again in backward (on an H200 a compiled 1B step's peak came within 0.2% without
    them). On the last stage the head's weight counts once for each of `held` micro-batches, except with the
    chunked head, which casts one chunk at a time."""
    if not autocast_copies(config):
        return 0
    t = config.train
    weights = 0
    if t.recompute != "full" and not t.compile:  # inductor recasts a weight in backward rather than keep it
        weights += sum(count * block_cast_elements(config, model, d, moe) * in_flight
                       for moe, count in blocks.items() if count)
    if last and not t.loss_chunk_tokens:
        weights += held * padded_vocab(model.vocab_size, d.tp) // d.tp * model.dim
    return 2 * weights


def block_cast_elements(config: JobConfig, model: ModelConfig, d: Degrees, moe: bool) -> int:
    """The weights of one block (dense False, MoE True) autocast casts to bf16 on this rank: its matmuls', the
    routed experts' only under the loop kernel, not the norms' nor the fp32 router's."""
    block = block_parameters(model, first_block(model, moe), d.tp, d.ep, d.etp, d.replicas)
    routed = block.experts if model.n_experts and expert_rows(config, model, d).kernel == "loop" else 0
    router = model.n_experts * model.dim if moe else 0  # the router runs in fp32: nothing cast
    return block.dense - block_norm_parameters(model, d.tp) - router + routed


def head_parallel(config: JobConfig, d: Degrees) -> int:
    """The ranks context parallelism splits the heads over (the Ulysses group: cp for ulysses, context_parallel.heads
    for 2d, 1 for the ring)."""
    if d.cp == 1:
        return 1
    from fivefold.parallel.context_parallel import ContextParallelLayout

    cp = config.context_parallel
    return ContextParallelLayout.for_method(cp.method, d.cp, cp.heads).heads


def token_id_bytes(tokens: int, tp: int) -> int:
    """What the embedding keeps for backward from one micro-batch of `tokens` (this rank's): the token ids (int64),
    and under tensor parallelism (the vocabulary-parallel embedding) its ids shifted into this rank's rows and the
    bool mask of those outside them; the shifted ids stand in for the batch's, so 8 + 1 bytes a token."""
    return tokens * (9 if tp > 1 else 8)


def recompute_working_bytes(config: JobConfig, model: ModelConfig, d: Degrees, kinds: dict[bool, int],
                            whole: dict[bool, int]) -> dict[bool, int]:
    """Under full recomputation, the bytes one block holds beyond its kept input (`kinds`) while its backward runs,
    per block kind (dense False, MoE True): its forward runs again first and keeps what a forward without
    recomputation keeps (`whole`), and under bf16 autocast that block's weight copies, until the block's backward
    frees them. One block at a time, so a rank's peak has its largest block's on top of every kept input."""
    casts = autocast_copies(config) and not config.train.compile
    return {moe: whole[moe] - kept + (2 * block_cast_elements(config, model, d, moe) if casts else 0)
            for moe, kept in kinds.items()}


def backward_climb(config: JobConfig, model: ModelConfig, d: Degrees, kinds: dict[bool, int],
                   copies: dict[bool, int], logits: int, working: dict[bool, int], rope: int) -> int | None:
    """How far a rank's backward climbs above the loss's backward, in bytes, where that can be walked: one
    micro-batch, one stage, plain DDP (or none); None elsewhere (the gradients then count whole: an upper bound).

    Gradients are set to None after each step, so the total without them stands for the loss's backward (the kept
    activations, the weight copies and the logits term, `logits` bytes, or a larger recomputed block's working
    set). The walk then follows backward: the logits term goes and the head's gradient comes (fp32, with its bf16
    copy while it is cast: 6 V h bytes, 4 V h after); each block, last layer first, holds its recomputed working
    set (`working`, under full recomputation) while it creates its fp32 gradients, then frees its kept
    activations and weight copies (`kinds`, `copies` per block; the RoPE tables, `rope` bytes, which every block
    counts, are the stage's one pair, freed after its last block); the embedding's gradient comes last (4 V h,
    accumulated into the head's when tied). The climb is how far the highest of those levels rises above the
    total without gradients. Measured on an H200 (docs/planner.md): 1B and 3B steps (recomputation none,
    selective, full; compiled; the chunked head) never climb, and peak within 0.11 GiB of that total; a MoE step
    under full recomputation, whose expert gradients outweigh its logits, climbs."""
    t, z = config.train, config.data_parallel
    if d.pp > 1 or t.grad_accum_steps > 1 or z.mode != "ddp" or z.zero_stage:
        return None
    vocab_rows = padded_vocab(model.vocab_size, d.tp) // d.tp * model.dim
    gradients = {moe: 4 * block_parameters(model, first_block(model, moe), d.tp, d.ep, d.etp, d.replicas).total
                 for moe in kinds}
    highest, level = 6 * vocab_rows, 4 * vocab_rows
    for layer in reversed(range(model.n_layers)):
        moe = model.is_moe_layer(layer) if model.n_experts else False
        highest = max(highest, level + working.get(moe, 0) + gradients[moe])
        level += gradients[moe] - (kinds[moe] - rope) - copies.get(moe, 0)
    highest = max(highest, level - rope + 4 * vocab_rows)
    loss_backward = max([logits, *working.values()])  # what the total without gradients holds at the top
    return max(0, highest - loss_backward)


def _block_activations(model: ModelConfig, layer: int, shape: ActivationShape, rows: ExpertRows) -> int:
    if model.is_moe_layer(layer):
        return moe_block_activation_elements(model, shape, rows)
    return block_activation_elements(model, shape)


def expert_rows(config: JobConfig, model: ModelConfig, d: Degrees) -> ExpertRows:
    """What one rank's MoE layer keeps and computes per micro-batch under balanced routing: its assignments
    (`dispatch_rows`), as many rows received by its experts (etp x them after the ETP gather), and the expert
    kernel the runtime resolves (model/moe.py resolve_expert_kernel)."""
    from fivefold.model.moe import resolve_expert_kernel

    if not model.n_experts:
        return ExpertRows()
    assignments = dispatch_rows(model, config, d)
    kernel = resolve_expert_kernel(config.expert_parallel.kernel, model.dim, model.expert_hidden_dim // d.etp,
                                   2 if compute_dtype(config) == "bf16" else 4)
    return ExpertRows(assignments, assignments * d.etp, d.ep, d.etp, kernel)


def busiest_expert_rows(config: JobConfig, model: ModelConfig, d: Degrees, by_load: dict[int, list[list[float]]]) -> ExpertRows:
    """`expert_rows` under a measured load (plan/expert_load.py `expert_rows_by_load`): the most assignments one EP
    rank routes and the most rows one EP rank's experts receive (etp x them after the ETP gather), each the worst
    over the MoE layers, so that the memory is the busiest EP rank's."""
    balanced = expert_rows(config, model, d)
    sent = max(round(sum(source)) for rows in by_load.values() for source in rows)  # k per token, less drops
    received = max(busiest_received(rows, 1) for rows in by_load.values())  # whole rows per pair, as they are sent
    return dataclasses.replace(balanced, assignments=sent, rows=received * d.etp)


class PipelineRuns:
    """The schedules' instruction streams and their simulations, shared by the estimates of one search (with the
    search's model FLOP count, pipeline ranks' parameter counts and explicit stage splits).

    A makespan scales with its costs, so runs are kept per schedule shape and cost *ratios* (rounded
    to 0.1%): candidates that differ only in ZeRO stage or offload, or in absolute speed, share one run."""

    def __init__(self) -> None:
        self._streams: dict = {}
        self._runs: dict = {}
        self._flops: dict = {}
        self._parameters: dict = {}
        self._splits: dict = {}

    def rank_parameters(self, config: JobConfig, model: ModelConfig, key: tuple, layers: list[int],
                        first: bool, last: bool, d: Degrees) -> RankParameters:
        """plan/parameters.py's Ψ of a pipeline rank, counted once per (blocks held, MoE blocks held, first, last)
        and degrees for the model of the search's candidates (`config.model`, which they share, kept so its id
        stays its own; `model` is it with the vocabulary known)."""
        memo = (id(config.model), model.vocab_size, key, d.tp, d.ep, d.etp, d.pp > 1, d.replicas)
        if memo not in self._parameters or self._parameters[memo][0] is not config.model:
            self._parameters[memo] = (config.model, rank_parameters(model, layers, first, last, d.tp, d.ep, d.etp,
                                                                    pipelined=d.pp > 1, replicas=d.replicas))
        return self._parameters[memo][1]

    def stage_split(self, model: ModelConfig, seq_len: int, stages: int, layers_per_stage: list[int] | None,
                    balance: str) -> list[list[int]]:
        """pipeline/stages.py `plan_stages`, an explicit split (a search's candidates all carry one) made once per
        (block counts, layers, stages): it depends on nothing else. The split is shared: read it, never change it."""
        from fivefold.parallel.pipeline.stages import plan_stages

        if not layers_per_stage:
            return plan_stages(model, seq_len, stages, layers_per_stage, balance)
        key = (tuple(layers_per_stage), model.n_layers, stages)
        if key not in self._splits:
            self._splits[key] = plan_stages(model, seq_len, stages, layers_per_stage, balance)
        return self._splits[key]

    def flops_per_token(self, model: ModelConfig, seq_len: int) -> int:
        """plan/flops.py's count for `model`, counted once per model object of the search (its candidates
        share one; the object is kept, so its id stays its own)."""
        key = (id(model), seq_len)
        if key not in self._flops or self._flops[key][0] is not model:
            self._flops[key] = (model, flops_per_token(model, seq_len))
        return self._flops[key][1]

    def streams(self, schedule: str, pp: int, m: int, virtual: int) -> dict:
        from fivefold.parallel.pipeline.schedules import PipelineShape, all_schedules

        key = (schedule, pp, m, virtual)
        if key not in self._streams:
            self._streams[key] = all_schedules(schedule, PipelineShape(pp, m, virtual))
        return self._streams[key]

    def run(self, schedule: str, pp: int, m: int, virtual: int, costs=None) -> tuple[float, dict[int, int], float]:
        """(makespan, peak in-flight pairs per rank, busy over given work) of the schedule with `costs` (unit
        costs when None). The last is 1 unless the ranks share a host's cores (`Costs.sharing`): then a pass
        beside idle ranks runs faster than its given time.

        Past `saturation` micro-batches a schedule is in its steady state: every further group of pp
        micro-batches adds the same time and no activations (GPipe's peak is all m), so long runs are
        simulated at two saturated lengths and extrapolated linearly (tests check this against full runs)."""
        from fivefold.parallel.pipeline.simulate import Costs

        unit = costs.forward if costs is not None else 1.0
        ratio = (Costs() if costs is None else
                 Costs(1.0, costs.backward / unit, costs.backward_input / unit, costs.backward_weight / unit,
                       costs.latency / unit, costs.stage_scale, costs.sharing))
        rounded = tuple(round(x, 3) for x in (ratio.backward, ratio.backward_input, ratio.backward_weight, ratio.latency))
        scale = tuple(round(x, 3) for x in ratio.stage_scale)
        key = (schedule, pp, m, virtual, rounded, scale, ratio.sharing)
        if key not in self._runs:
            cap = saturation(pp, virtual)
            if m <= cap + pp:
                self._runs[key] = self._simulate(schedule, pp, m, virtual, ratio)
            else:
                short, longer = self._simulate(schedule, pp, cap, virtual, ratio), \
                    self._simulate(schedule, pp, cap + pp, virtual, ratio)
                per_group = longer[0] - short[0]
                peak = {r: m for r in short[1]} if schedule == "gpipe" else longer[1]
                self._runs[key] = (short[0] + (m - cap) / pp * per_group, peak, longer[2])
        makespan, peak, busy_share = self._runs[key]
        return makespan * unit, peak, busy_share

    def _simulate(self, schedule: str, pp: int, m: int, virtual: int, costs) -> tuple[float, dict[int, int], float]:
        from fivefold.parallel.pipeline.simulate import simulate

        sim = simulate(self.streams(schedule, pp, m, virtual), costs)
        return sim.makespan, sim.peak_in_flight, sum(sim.busy.values()) / max(sum(sim.work.values()), 1e-300)


def core_sharing(config: JobConfig, d: Degrees, cluster: ClusterSpec) -> CoreSharing | None:
    """The pipeline simulation's CoreSharing when the job's ranks share one CPU host's cores
    (`accelerator.shared_cores`, the job within one node), else None: `replicas` ranks (dp x tp x cp x
    ep copies) run each pipeline rank's passes, each with the runtime's threads (train.threads, else
    cores // ranks on the node, setup.py `threads_per_rank`), at the host's measured
    `oversubscribed_efficiency`."""
    from fivefold.parallel.pipeline.simulate import CoreSharing

    cores = cluster.accelerator.shared_cores
    if not cores or d.world > cluster.accelerators_per_node:
        return None
    threads = config.train.threads or max(1, cores // d.world)
    return CoreSharing(cores, d.world // d.pp, threads, cluster.accelerator.oversubscribed_efficiency)


def host_sharing(config: JobConfig, gpus: int, cluster: ClusterSpec) -> CoreSharing | None:
    """Parameter servers on one CPU host (`accelerator.shared_cores`): all `gpus` ranks share its cores, the rates
    were measured with every rank computing, and a role computes while the other waits (`CoreSharing.speed`)."""
    from fivefold.parallel.pipeline.simulate import CoreSharing

    cores = cluster.accelerator.shared_cores
    if not cores or gpus > cluster.accelerators_per_node:
        return None
    return CoreSharing(cores, 1, config.train.threads or max(1, cores // gpus), cluster.accelerator.oversubscribed_efficiency)


def saturation(pp: int, virtual: int) -> int:
    """A micro-batch count (a multiple of pp) past which every schedule here is in its steady state."""
    return 2 * pp * virtual + 2 * pp


def _in_flight(config: JobConfig, d: Degrees) -> dict[int, int]:
    """Micro-batch x stage pairs each pipeline rank holds activations for at its peak (1 without a pipeline)."""
    if d.pp == 1:
        return {0: 1}
    from fivefold.parallel.pipeline.schedules import PipelineShape, peak_in_flight

    pipe = config.pipeline_parallel
    shape = PipelineShape(d.pp, config.train.grad_accum_steps, pipe.virtual)
    return {r: peak_in_flight(pipe.schedule, shape, r) for r in range(d.pp)}


def logits_bytes(tokens: int, vocab: int, held: int, chunk: int = 0, compiled_element: int = 0) -> int:
    """Bytes of the loss's logits on the last stage: `held` micro-batches' fp32 log-probabilities kept for
    backward plus, while the loss's backward runs, the gradient of the log-probabilities and the fp32 logits'
    gradient it makes from them (tokens x this rank's vocabulary each: 12 N V with one held, as measured on an
    H100 and an H200 at N = 8,192, V = 32,000, docs/gpu.md); with the chunked head
    (train.loss_chunk_tokens = c) 4 bytes per token kept (the log-sum-exp) and one chunk's fp32 logits
    and gradient live (ops/linear_cross_entropy.py). With the compiled loss (train.compile without tensor
    parallelism, `compiled_element` = the logits' bytes per value) the logits themselves are kept in their
    dtype with 8 bytes per token (max and log-sum-exp), and their gradient, in that dtype, is live."""
    if chunk:
        return held * 4 * tokens + 2 * 4 * min(chunk, tokens) * vocab
    if compiled_element:
        return held * (compiled_element * vocab + 8) * tokens + compiled_element * tokens * vocab
    return (held + 2) * 4 * tokens * vocab


def final_norm_bytes(tokens: int, dim: int, held: int, sp_degree: int = 1) -> int:
    """Bytes the final RMSNorm keeps for each of the `held` micro-batches on the last stage (fp32, as it computes):
    its input, 1/rms and normalised output on this rank's tokens (1/t of them under sequence parallelism), and
    its output as the head's input (all the tokens, gathered under sequence parallelism)."""
    return held * 4 * ((2 * dim + 1) * (tokens // sp_degree) + dim * tokens)


def memory_per_rank(config: JobConfig, model: ModelConfig, d: Degrees, split: list[list[int]],
                    runs: PipelineRuns | None = None, routed: ExpertRows | None = None) -> list[RankMemory]:
    """Every rank's memory by component. routed: what a MoE layer keeps and computes per micro-batch on every rank
    (default `expert_rows`, balanced routing; under a measured load `busiest_expert_rows`)."""
    t = config.train
    runs = runs or PipelineRuns()
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1
    shape = ActivationShape(t.micro_batch_size, t.seq_len // d.cp, d.tp, sp, t.recompute, head_parallel(config, d))
    element = 2 if compute_dtype(config) == "bf16" else 4
    in_flight = _in_flight(config, d)
    # the last stage keeps each finished micro-batch's fp32 log-probabilities until its backward (GPipe: all m
    # of them), and two logits-sized gradients are live while a loss's backward runs
    held = t.grad_accum_steps if d.pp > 1 and config.pipeline_parallel.schedule == "gpipe" else 1
    rows = routed or expert_rows(config, model, d)
    received = routed.rows // routed.etp if routed is not None and routed.rows else 0  # busiest EP rank's dispatch
    # bytes per block; under bf16 autocast an eager block's fp32 tensors and per-matmul casts on top
    # (`autocast_extra_elements`, a MoE block's `moe_autocast_extra_elements`; under context parallelism too), not under
    # train.compile, whose fused kernels keep what inductor's partitioner picks (on an H200 a compiled 1B step's
    # peak came within 0.2% of 2 bytes per element)
    autocast = autocast_copies(config)
    eager = autocast and not t.compile

    def kept(moe: bool, shape: ActivationShape) -> int:
        layer = first_block(model, moe)
        extra = moe_autocast_extra_elements(model, shape, rows) if moe else autocast_extra_elements(model, shape)
        return element * _block_activations(model, layer, shape, rows) + (2 * extra if eager else 0)

    kinds = {moe: kept(moe, shape) for moe in (False, True) if first_block(model, moe) >= 0}
    working = {}
    if t.recompute == "full":
        whole = dataclasses.replace(shape, recompute="none")
        working = recompute_working_bytes(config, model, d, kinds, {moe: kept(moe, whole) for moe in kinds})
    states: dict[tuple, tuple[int, int, int, int]] = {}  # pipeline ranks holding alike blocks hold alike states
    out = []
    z = config.data_parallel
    tokens = t.micro_batch_size * (t.seq_len // d.cp)
    compiled_loss = element if t.compile and d.tp == 1 and not t.loss_chunk_tokens else 0  # parallel/compile.py
    last_logits = (logits_bytes(tokens, padded_vocab(model.vocab_size, d.tp) // d.tp, held, t.loss_chunk_tokens,
                                compiled_loss)
                   + final_norm_bytes(tokens, model.dim, held, d.tp if sp else 1))
    # every block counts the RoPE tables (fp32 cos and sin of the rank's positions) it keeps, but a stage's blocks
    # share one pair per micro-batch: the stage's forward computes them once
    rope = (4 if eager else element) * 2 * shape.seq_len * model.rope_dim  # as `kinds` counts them (fp32 under autocast)
    alike: dict[tuple, RankMemory] = {}  # (states key, activation and copy bytes) -> the rank's memory (no NVMe)
    copies_of: dict[tuple, int] = {}  # states key -> the rank's bf16 weight copies
    block_copies = {moe: weight_copy_bytes(config, model, d, {moe: 1}, 1, False, 0) for moe in kinds}
    climb = backward_climb(config, model, d, kinds, block_copies, last_logits, working, rope)
    for rank in range(d.pp):
        stages, first, last = _rank_stages(split, d.pp, rank)
        if model.n_experts:
            layers = [layer for s in stages for layer in split[s]]
            moe = [layer for layer in layers if model.is_moe_layer(layer)]
            key = (len(layers), len(moe), first, last)
            per_stage = max(sum(kinds[model.is_moe_layer(layer)] for layer in split[s]) - (len(split[s]) - 1) * rope
                            for s in stages)
            rank_blocks = {False: len(layers) - len(moe), True: len(moe)}
        else:  # a dense rank's states depend only on how many blocks it holds (built only when first seen)
            layers, moe = None, []
            if len(split) == d.pp:  # one stage per rank
                blocks = most = len(split[rank])
            else:
                blocks, most = sum(len(split[s]) for s in stages), max(len(split[s]) for s in stages)
            key = (blocks, 0, first, last)
            per_stage = most * kinds[False] - (most - 1) * rope
            rank_blocks = {False: blocks}
        if key not in states or z.nvme_path:
            layers = layers if layers is not None else [layer for s in stages for layer in split[s]]
        if key not in states:
            params = runs.rank_parameters(config, model, key, layers, first, last, d)
            states[key] = (*_model_states(params, config, d), _buffers(config, model, d, layers, moe, sp, first, last, received),
                           params.total,
                           ddp_bucket_bytes(config, model, params, d))
        # with interleaving a rank's peak (micro-batch, stage) pairs spread over its stages: the largest bounds each
        activations = per_stage * in_flight[rank]
        if working:  # one block recomputed at a time, after the loss's backward has freed the logits term
            extra = max(working[moe] for moe, count in rank_blocks.items() if count)
            activations += max(0, extra - last_logits) if last else extra
        if first:  # each micro-batch in flight on the first stage (at most all of them) keeps its token ids
            activations += min(in_flight[rank], t.grad_accum_steps) * token_id_bytes(tokens, d.tp)
        # the pipeline executor runs a step's compute in one autocast region: its micro-batches share one copy of
        # each weight of the rank's stages; a single stage's micro-batches run one after another
        if autocast and key not in copies_of:  # ranks of one key hold alike blocks and head
            copies_of[key] = weight_copy_bytes(config, model, d, rank_blocks, 1, last, 1)
        copies = copies_of.get(key, 0)
        if not z.nvme_path and (key, activations, copies) in alike:
            out.append(alike[(key, activations, copies)])
            continue
        p, g, o, buffers, count, buckets = states[key]
        host = o if z.offload else 0
        nvme = 0
        if z.nvme_path:
            nvme, host = o, nvme_host_bytes([-(-_largest_group(model, layers, count, d) // (d.dp_shard * d.cp))],
                                            z.nvme_sub_group)
        logits = last_logits if last else 0
        memory = RankMemory(p, g, 0 if z.offload else o, activations, logits, buffers, host, count, buckets, nvme,
                            copies, climb is not None, climb or 0)
        alike[(key, activations, copies)] = memory
        out.append(memory)
    return out


def _largest_group(model: ModelConfig, layers: list[int], total: int, d: Degrees) -> int:
    """Parameters of the largest ZeRO flat group on a rank (at most): its largest block, or what is not in a
    block (embedding, head, final norm)."""
    blocks = [block_parameters(model, layer, d.tp, d.ep, d.etp, d.replicas).total for layer in layers]
    return max([*blocks, total - sum(blocks)])


def server_loads(model: ModelConfig, servers: int, workers: int) -> list[tuple[int, int]]:
    """(elements, parameter tensors) each parameter server holds: the runtime's own balance
    (parallel/parameter_server.py ServerLayout, largest tensor first to the least loaded server) over the model's
    parameters."""
    from fivefold.model import build_model
    from fivefold.parallel.parameter_server import ServerLayout

    sizes = [p.numel() for p in build_model(model).parameters() if p.requires_grad]  # meta device: shapes only
    layout = ServerLayout.balance(sizes, workers, servers)
    return [(sum(sizes[i] for i in layout.owned(s)), len(layout.owned(s))) for s in range(servers)]


def server_shards(model: ModelConfig, servers: int, workers: int) -> list[int]:
    """Elements each parameter server holds (`server_loads`)."""
    return [elements for elements, _ in server_loads(model, servers, workers)]


def server_memory(config: JobConfig, shard: int, workers: int) -> RankMemory:
    """A server rank: its fp32 weights, their gradients (set from the summed push at each step) and AdamW's two
    moments; bsp receives every worker's push into a buffer of its own and sums them into one more, asp / ssp
    receive one push at a time."""
    buffers = 4 * shard * (workers + 1 if config.parameter_server.sync == "bsp" else 1)
    return RankMemory(4 * shard, 4 * shard, 8 * shard, 0, 0, buffers, parameter_count=shard)


def _parameter_server_time(config: JobConfig, loads: list[tuple[int, int]], workers: int, gpus: int,
                           cluster: ClusterSpec) -> tuple[float, float, float]:
    """(push + pull seconds, the pusher's own clipping, the servers' update seconds) per step, `loads` each server's
    (elements, tensors). The
    busiest server takes every worker's push of its shard (W x 4 x shard bytes in) and answers every pull (as many
    out), over the link spanning the job (servers are the last ranks); a worker waits for both, after its backward.
    bsp sums W pushes (read 4 W x shard bytes at memory bandwidth), takes the gradient norm and clips the sum
    (`Accelerator.clip_seconds`) and runs AdamW once over the shard (the accelerator's optimizer rate and cost per
    tensor); asp and ssp run it per push, each worker having clipped its own whole gradient before pushing. The
    slowest server's update."""
    shard = max(elements for elements, _ in loads)
    comm = 2 * workers * cluster.link_for(gpus).message(4 * shard)
    clip = 0.0
    if config.parameter_server.sync != "bsp":  # parallel/parameter_server.py: the pusher clips
        clip = cluster.accelerator.clip_seconds(sum(elements for elements, _ in loads), config.train.max_grad_norm > 0)
    return comm, clip, max(server_update_seconds(config, elements, tensors, workers, cluster.accelerator)
                           for elements, tensors in loads)


def server_update_seconds(config: JobConfig, elements: int, tensors: int, workers: int, accelerator: Accelerator) -> float:
    """One server's work per step on its shard (`_parameter_server_time`): bsp sums the W pushes, clips and steps
    once; asp / ssp step once per push."""
    bsp = config.parameter_server.sync == "bsp"
    bandwidth = accelerator.streaming_bytes_per_second
    summing = 4 * workers * elements / bandwidth if bandwidth else 0.0
    clip = accelerator.clip_seconds(elements, config.train.max_grad_norm > 0) if bsp else 0.0
    return summing + clip + (1 if bsp else workers) * accelerator.optimizer_seconds(elements, tensors)


def ddp_bucket_bytes(config: JobConfig, model: ModelConfig, params: RankParameters, d: Degrees) -> int:
    """DDP (zero_stage 0) copies every gradient into flat buckets in `gradient_comm.reduce_dtype` to all-reduce
    them (parallel/data_parallel.py make_buckets): the dense part's when dp x cp > 1, the routed experts' when
    their expert-data-parallel group (the ranks holding a stage's distinct tokens over ep x etp) has more than
    one rank; plus what gradient compression keeps from step to step (`codec_state_bytes`). ZeRO reduces in its
    own flat groups."""
    z = config.data_parallel
    if z.zero_stage or z.mode != "ddp":
        return 0
    element = 2 if config.gradient_comm.reduce_dtype == "bf16" else 4
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1
    edp = d.dp * d.cp * (d.tp if sp else 1) // (d.ep * d.etp)
    parts = [(params.dense, d.dp * d.cp, False), (params.experts, edp, True)]
    return sum(element * values + codec_state_bytes(config, model, d, values, ranks, experts)
               for values, ranks, experts in parts if values and ranks > 1)


def codec_state_bytes(config: JobConfig, model: ModelConfig, d: Degrees, values: int, ranks: int, experts: bool) -> int:
    """fp32 state a gradient codec keeps per DDP instance of `values` gradients over `ranks` ranks
    (comm/compression.py; one bucket, the bucket padded to ranks x block for the two-phase codecs): `sign`'s error
    feedback on the workers' vector and the chunk owner's (N + N / ranks), `topk`'s residual (n), PowerSGD's error
    per compressed matrix and its warm-start Q (`powersgd_factors`); `int8` keeps none."""
    g = config.gradient_comm
    if g.compression == "sign":
        padded = _codec_padded(g, values, ranks)
        return 4 * (padded + padded // ranks)
    if g.compression == "topk":
        return 4 * values
    if g.compression == "powersgd":
        return round(4 * values * powersgd_shares(model, d.tp, d.etp, g.powersgd_rank)[experts][2])
    return 0


def _buffers(config: JobConfig, model: ModelConfig, d: Degrees, layers: list[int], moe: list[int], sp: bool,
             first: bool, last: bool, received: int = 0) -> int:
    """ZeRO-3's gathered weights: the current and the prefetched block, and the rest of the model (embedding,
    final norm, head: gathered before the forward, freed after the step); and the MoE dispatch rows in and out
    (`dispatch_buffer_rows` of k per token, or of `received`: the busiest EP rank's under a measured load)."""
    t, buffers = config.train, 0
    if config.data_parallel.mode == "ps":  # the step's flat push (gradients) and pull (new weights) copies
        buffers += 2 * 4 * rank_parameters(model, layers, True, True).total
    deg = zero_degrees(config, d)
    if deg is not None and deg.params > 1 and layers:
        weight = 2 if config.data_parallel.param_dtype == "bf16" else 4
        kinds = ({False} if len(moe) < len(layers) else set()) | ({True} if moe else set())
        biggest = max(block_parameters(model, first_block(model, k), d.tp, d.ep, d.etp, d.replicas).total for k in kinds)
        buffers += 2 * weight * biggest
        buffers += weight * rank_parameters(model, [], first, last, d.tp, d.ep, d.etp, d.pp > 1, d.replicas).total
        if config.data_parallel.hpz_partition > 1:  # hpZ: 1/h of every block's weights, from its forward to its backward
            blocks = sum(block_parameters(model, layer, d.tp, d.ep, d.etp, d.replicas).total for layer in layers)
            buffers += weight * blocks // config.data_parallel.hpz_partition
    if moe and d.ep * d.etp > 1:
        rows = received or model.moe_top_k * t.micro_batch_size * (t.seq_len // d.cp) // (d.tp if sp else 1)
        buffers += dispatch_buffer_rows(rows, d.etp) * model.dim * 4
    return buffers


def dispatch_buffer_rows(rows: int, etp: int) -> int:
    """Rows one MoE layer's dispatch holds at once beyond what backward keeps (parallel/expert_parallel.py), for
    `rows` received per EP rank: the rows it sends and receives (2 x rows, balanced); with expert tensor
    parallelism the gather's input, its etp-fold repeat and the etp x rows it gathers (1 + 2 etp), an upper bound
    of the reduce-scatter's etp x rows in and out. Measured by tests/distributed/test_activation_memory.py."""
    return (2 if etp == 1 else 1 + 2 * etp) * rows


# ---------------------------------------------------------------------------------------------- time
def _block_forward_flops(model: ModelConfig, layer: int, tokens: int, seq: int, d: Degrees, sp: bool) -> float:
    """Forward FLOPs of one block on one rank: 2 x its matmul parameters per token (MoE: the active experts)
    plus the attention core, for `tokens` tokens of sequences of `seq` (before the cp split). A MoE layer runs
    outside the tensor-parallel region (parallel/tensor_parallel.py): on this rank's tokens under sequence
    parallelism, on all of them (each tp rank alike) without it."""
    full = block_parameters(model, layer)
    matmul = full.dense - 2 * model.dim
    outside = 0  # the MoE layer's matmul parameters a token passes through: router, shared and its k experts
    if model.is_moe_layer(layer):
        replicated = model.dim * model.n_experts + 3 * model.dim * model.shared_hidden_dim + \
            (model.dim if model.moe_shared_gate else 0)
        matmul -= replicated
        outside = replicated + routed_parameters_per_token(model, layer)
    return (2 * matmul * tokens / (d.tp * d.cp) + 2 * outside * tokens / (d.cp * (d.tp if sp else 1))
            + _attention_core_flops(model, tokens, seq, d))


def routed_parameters_per_token(model: ModelConfig, layer: int) -> int:
    """The routed experts' matmul parameters one token passes through in MoE layer `layer`: k of E experts."""
    return block_parameters(model, layer).experts * model.moe_top_k // model.n_experts


def _attention_core_flops(model: ModelConfig, tokens: int, seq: int, d: Degrees) -> float:
    """Forward FLOPs of one block's attention core on one rank: q k^T and the product with v (MLA: both on the
    one width the core pads q, k and v to, model/mla.py; MFU counts the unpadded model FLOPs)."""
    if model.attention == "mla":
        width = 2 * model.n_heads * max(model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim)
        return 2 * width * seq * tokens / (d.tp * d.cp)
    return 4 * model.q_dim * seq * tokens / (d.tp * d.cp)


@dataclass(frozen=True)
class PassCosts:
    """Seconds of one micro-batch's forward pass on one rank, before any communication: a block's
    (matmuls at the achieved rate, the attention core at its own, plus the bytes it writes outside them at
    the memory bandwidth) by kind (False: dense, True: MoE), the attention core's share of it, and the last
    stage's head and loss; `routed`: the routed experts' matmuls within a MoE block, at balanced routing (the
    part that grows on a rank that receives more rows)."""

    block: dict[bool, float]
    core: float
    head: float
    routed: float = 0.0


def dispatch_rows(model: ModelConfig, config: JobConfig, d: Degrees) -> int:
    """Rows one rank sends to the experts per MoE layer and micro-batch under balanced routing: k per token it
    holds, fewer where the capacity factor (model/moe.py, per whole sequence) keeps less than k/E of a sequence
    per expert."""
    from fivefold.model.moe import expert_capacity

    t = config.train
    wanted = routed_rows(model, config, d)
    capacity = expert_capacity(model, t.seq_len)
    if capacity:
        return min(wanted, wanted * capacity * model.n_experts // (model.moe_top_k * t.seq_len))
    return wanted


def _expert_parallel_block(config: JobConfig, model: ModelConfig, d: Degrees, element: int,
                           cluster: ClusterSpec, rows_to: list[list[float]] | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block's exchanges (parallel/expert_parallel.py), balanced routing:
    the per-expert counts (forward only) and the rows (k per token this rank holds) out and home over the EP
    group; with etp > 1 the count tables gathered (forward only) and the rows gathered and reduce-scattered over
    the ETP group (etp x the rows each way). rows_to (a measured load, plan/expert_load.py): [i][j] the rows EP
    rank i sends EP rank j; the row exchanges are then uneven (priced as the runtime's pairwise exchange) and the
    ETP exchanges carry the busiest EP rank's rows."""
    if not model.n_experts or d.ep * d.etp == 1:
        return 0.0, 0.0
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1
    rows = dispatch_rows(model, config, d) * model.dim * element
    received = rows if rows_to is None or not rows else busiest_received(rows_to, model.dim * element)
    stride = 1 if sp else d.tp  # the EP group's ranks are etp apart in the token fiber
    seconds, counts = 0.0, 0.0
    if d.ep > 1:
        link = cluster.collective_link("all_to_all", d.fibre_span((d.ep - 1) * d.etp * stride + 1))
        counts = native_collective("all_to_all", 8 * model.n_experts, d.ep, link)
        if rows_to is None or not rows:
            seconds += 2 * native_collective("all_to_all", rows, d.ep, link)
        else:
            out, home = exchange_matrices(rows_to, model.dim * element)
            seconds += uneven_all_to_all(out, link) + uneven_all_to_all(home, link)
    if d.etp > 1:
        span = d.fibre_span((d.etp - 1) * stride + 1)
        counts += native_collective("all_gather", 8 * model.n_experts * d.etp, d.etp, cluster.collective_link("all_gather", span))
        seconds += 2 * native_collective("all_to_all", d.etp * received, d.etp, cluster.collective_link("all_to_all", span))
    return seconds + counts, seconds


def pass_costs(config: JobConfig, model: ModelConfig, d: Degrees, cluster: ClusterSpec,
               efficiency: float | Efficiency) -> PassCosts:
    """The forward costs every step-time model here shares (the planner's step_time, the simulator's workload)."""
    t, eff = config.train, as_efficiency(efficiency)
    peak = cluster.accelerator.peak_flops(compute_dtype(config))
    rate = peak * eff.matmul
    tokens, seq = t.micro_batch_size * t.seq_len, t.seq_len
    core_flops = _attention_core_flops(model, tokens, seq, d)
    core = core_flops / (peak * eff.core_share(core_narrowest(model)))
    bandwidth = cluster.accelerator.streaming_bytes_per_second
    written = _written_per_block(model, config, d) if bandwidth else {}
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1
    overhead = cluster.accelerator.pass_overhead_us * 1e-6  # a dense block's; a MoE block's by its operators
    ring = ring_operators(config, model, d, cluster) if overhead else 0.0  # ring attention's own, a dense block's share
    rows = expert_rows(config, model, d)
    routed = operator_ratio(model, rows.kernel) if overhead and model.n_experts else 1.0
    groups = group_seconds(cluster.accelerator.expert_group_us, experts_per_rank(model, d.ep, d.replicas),
                           rows.kernel) if model.n_experts else 0.0  # per expert slot the rank's grouped GEMMs run over
    fixed = {False: overhead * (1 + ring), True: overhead * (routed + ring) + groups}
    moe = first_block(model, True)
    if eff.half_width:  # the width law: each GEMM at its own share (plan/gemms.py)
        gemms = {kind: block_gemms(model, layer, tokens, d.tp, d.cp, sp, d.etp)
                 for kind in (False, True) if (layer := first_block(model, kind)) >= 0}

        def seconds(g) -> float:
            return g.flops / (peak * (eff.expert_share(g.narrowest) if g.routed else eff.share(g.narrowest)))

        matmuls = {kind: sum(seconds(g) for g in found) for kind, found in gemms.items()}
        head_gemm_ = head_gemm(model, tokens, d.tp, d.cp)
        head = head_gemm_.flops / (peak * eff.share(head_gemm_.narrowest))
        routed = sum(seconds(g) for g in gemms.get(True, ()) if g.routed)
    else:
        matmuls = {kind: (_block_forward_flops(model, layer, tokens, seq, d, sp) - core_flops) / rate
                   for kind in (False, True) if (layer := first_block(model, kind)) >= 0}
        head = 2 * padded_vocab(model.vocab_size, d.tp) * model.dim * tokens / (d.tp * d.cp) / rate
        routed = 2 * routed_parameters_per_token(model, moe) * tokens / (d.cp * (d.tp if sp else 1)) / rate \
            if moe >= 0 else 0.0
        if eff.experts and routed:  # the routed GEMMs at their own share
            slower = routed * (eff.matmul / eff.experts - 1)
            matmuls[True] += slower
            routed += slower
    block = {kind: seconds + core + (written[kind] / bandwidth if bandwidth else 0.0) + fixed[kind]
             for kind, seconds in matmuls.items()}
    if bandwidth:
        head += 2 * 4 * tokens // d.cp * padded_vocab(model.vocab_size, d.tp) // d.tp / bandwidth
    costs = PassCosts(block, core, head, routed)
    if eff.profile is None:
        return costs
    profile = eff.profile  # measured passes (plan/profile.py), carried to this layout by the model's ratio
    profile.check_model(model, compute_dtype(config), t.compile, t.loss_chunk_tokens,
                        expert_rows(config, model, d).kernel if model.n_experts else "")
    measured = dataclasses.replace(config, train=dataclasses.replace(t, micro_batch_size=profile.micro_batch_size,
                                                                       seq_len=profile.seq_len),
                                   tensor_parallel=dataclasses.replace(config.tensor_parallel, sequence_parallel=False))
    one = Degrees(1, 1, 1, 1, 1, 1, 1)
    return profiled_costs(profile, costs, pass_costs(measured, model, one, cluster, dataclasses.replace(eff, profile=None)))


def ring_operators(config: JobConfig, model: ModelConfig, d: Degrees, cluster: ClusterSpec) -> float:
    """The host work ring attention adds to each block (context parallelism with a ring: `ring` and `2d`), as a share
    of a dense block's: the operators it dispatches (plan/operators.py `ring_attention_operators`) and, on a host
    whose accelerator measured it, its own Python beside them (`ring_host_share`); 0 without a ring."""
    if d.cp == 1:
        return 0.0
    from fivefold.parallel.context_parallel import ContextParallelLayout

    cp = config.context_parallel
    layout = ContextParallelLayout.for_method(cp.method, d.cp, cp.heads, cp.inner_ring, cp.placement)
    return ring_attention_operators(model, layout.ring, layout.inner) + \
        ring_host_share(model, layout.ring, cluster.accelerator.ring_step_operators)


def profiled_costs(profile, modelled: PassCosts, at_profile: PassCosts) -> PassCosts:
    """A layout's PassCosts from a measured profile (plan/profile.py ComputeProfile): each measured part times the
    model's seconds for the layout's shard (`modelled`) over its seconds for what was measured (`at_profile`: one
    rank, the profiled shape); the routed experts keep their modelled share of the MoE block."""
    def scale(measured: float, model: float, base: float) -> float:
        return measured * model / base if base > 0 else model

    block = {moe: scale(profile.moe_block if moe else profile.block, seconds, at_profile.block[moe])
             for moe, seconds in modelled.block.items()}
    routed = modelled.routed * block[True] / modelled.block[True] if modelled.block.get(True) else 0.0
    return PassCosts(block, scale(profile.core, modelled.core, at_profile.core),
                     scale(profile.head, modelled.head, at_profile.head), routed)


def step_time(config: JobConfig, model: ModelConfig, d: Degrees, split: list[list[int]], cluster: ClusterSpec,
              efficiency: float | Efficiency, runs: PipelineRuns | None = None,
              expert_rows: dict[int, list[list[float]]] | None = None) -> StepTime:
    """expert_rows: per MoE layer the rows each EP rank sends each EP rank under a measured load
    (plan/expert_load.py `expert_rows_by_load`); None: balanced routing."""
    from fivefold.parallel.pipeline.simulate import Costs

    t = config.train
    b, seq, m = t.micro_batch_size, t.seq_len, t.grad_accum_steps
    element = 2 if compute_dtype(config) == "bf16" else 4
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1
    links = cluster.links()
    # per (virtual) stage: forward compute seconds of one micro-batch, and its exposed tp / cp / ep seconds
    forward, comm_tp, comm_cp, comm_ep, comm_ep_back, attn_core, comm_cp_back = [], [], [], [], [], [], []
    comm_tp_back = []
    edge_fwd, edge_bwd = [], []  # per stage: tensor parallelism outside the blocks' regions (_tensor_parallel_edges)
    statistics = []  # per stage: the MoE layers' routing statistics (once per micro-batch: forward, or its recompute)
    if sp:  # per region, an all-gather entering and a reduce-scatter leaving, instead of one all-reduce leaving
        def tp_collective(n: float) -> float:
            return (native_collective("all_gather", n, d.tp, cluster.collective_link("all_gather", d.tp)) +
                    native_collective("reduce_scatter", n, d.tp, cluster.collective_link("reduce_scatter", d.tp)))
    else:
        def tp_collective(n: float) -> float:
            return native_collective("all_reduce", n, d.tp, cluster.collective_link("all_reduce", d.tp))
    activation_bytes = b * (seq // d.cp) * model.dim * element
    costs = pass_costs(config, model, d, cluster, efficiency)
    # one block's exposed tp seconds (dense, MoE) and cp seconds are the same on every stage
    block_tp = tp_collective(activation_bytes) if d.tp > 1 else 0.0
    # a MoE block's MLP runs outside the tensor-parallel region: only its attention region's collectives
    overlap = sp and config.tensor_parallel.comm_overlap
    kind_tp = {moe: _overlapped_tp_block(model, d, costs.block[moe], costs.core, activation_bytes, cluster, moe)
               if overlap else block_tp / (2 if moe else 1) for moe in costs.block}
    # overlapped rings hide behind twice the matmul in backward
    kind_tp_back = {moe: _overlapped_tp_block(model, d, 2 * costs.block[moe], 2 * costs.core, activation_bytes, cluster,
                                              moe) if overlap else kind_tp[moe] for moe in costs.block}
    # arrival skew (ClusterSpec.sync_delay): per block pass, (forward, backward) waits of its tp, cp and ep syncs
    waits = {moe: block_sync_waits(config, d, cluster, costs.block[moe], moe) for moe in costs.block}
    # the attention's other all-reduces (q/k norms, whole weights), once per block (kind_tp is per half: x 2)
    attention_calls = [sum(native_collective("all_reduce", n, d.tp, cluster.collective_link("all_reduce", d.tp))
                           for n in calls) for calls in attention_all_reduces(config, model, d)]
    for moe in costs.block:
        kind_tp[moe] += attention_calls[0] / 2
        kind_tp_back[moe] += attention_calls[1] / 2
    for moe, (fwd, bwd) in waits.items():  # a MoE block's tp half is per block; kind_tp is per half (x 2)
        kind_tp[moe] += fwd[0] / 2
        kind_tp_back[moe] += bwd[0] / 2
    block_cp, block_cp_back = _context_parallel_block(config, model, d, costs.core, element, cluster)
    edge = _tensor_parallel_edges(config, model, d, cluster, activation_bytes)
    routing = _routing_collectives(config, model, d, cluster)
    # per MoE layer: its exchanges' (forward, backward) seconds, and the busiest EP rank's extra routed compute
    # under a measured load (plan/expert_load.py; balanced routing: the same for every layer, no extra)
    rows_to = expert_rows or {}
    balanced = _expert_parallel_block(config, model, d, element, cluster)
    row_bytes = model.dim * element
    dispatched = dispatch_rows(model, config, d) * row_bytes if model.n_experts else 0
    block_ep = {layer: _expert_parallel_block(config, model, d, element, cluster, rows) for layer, rows in rows_to.items()}
    routed_extra = {layer: costs.routed * (busiest_received(rows, row_bytes) / dispatched - 1) if dispatched else 0.0
                    for layer, rows in rows_to.items()}
    for stage, layers in enumerate(split):
        moe_layers = [layer for layer in layers if model.is_moe_layer(layer)] if model.n_experts else []
        counts = ((False, len(layers) - len(moe_layers)), (True, len(moe_layers)))  # (MoE?, blocks of that kind)
        forward.append(sum(costs.block[m] * n for m, n in counts if n)
                       + sum(routed_extra.get(layer, 0.0) for layer in moe_layers)
                       + (costs.head if stage == len(split) - 1 else 0.0))
        attn_core.append(costs.core * len(layers))
        comm_tp.append(sum(kind_tp[m] * n for m, n in counts if n))
        comm_tp_back.append(sum(kind_tp_back[m] * n for m, n in counts if n))
        edge_fwd.append((edge.embedding_forward if stage == 0 else 0.0) + (edge.head_forward if stage == len(split) - 1 else 0.0))
        edge_bwd.append((edge.embedding_backward if stage == 0 else 0.0) + (edge.head_backward if stage == len(split) - 1 else 0.0)
                        + edge.norms_backward * len(layers) + routing.replicas_backward * len(moe_layers))
        statistics.append(routing.statistics * len(moe_layers))
        comm_cp.append(sum((block_cp + waits[m][0][1]) * n for m, n in counts if n))
        comm_cp_back.append(sum((block_cp_back + waits[m][1][1]) * n for m, n in counts if n))
        comm_ep.append(sum(block_ep.get(layer, balanced)[0] for layer in moe_layers) + len(moe_layers) * waits[True][0][2]
                       if moe_layers else 0.0)
        comm_ep_back.append(sum(block_ep.get(layer, balanced)[1] for layer in moe_layers)
                            + len(moe_layers) * waits[True][1][2] if moe_layers else 0.0)
    recompute = {"none": 0.0, "selective": 1.0, "full": 1.0}[t.recompute]
    full = t.recompute == "full"
    stage_fwd = [f + 2 * tpc + ep + cp + e + (0.0 if full else r)
                 for f, tpc, ep, cp, e, r in zip(forward, comm_tp, comm_ep, comm_cp, edge_fwd, statistics)]
    # backward: twice the compute, the same tp / ep traffic again, cp's backward pass (its all-to-alls' conjugates,
    # the ring's K/V and their gradients); recompute re-runs the forward (selective: the attention core, cp included)
    # full recomputation re-runs the blocks' forward (parallel/recompute.py wraps blocks), not the head's
    blocks_forward = [f - (costs.head if i == len(split) - 1 else 0.0) for i, f in enumerate(forward)]
    stage_bwd = []
    for i in range(len(split)):
        again = blocks_forward[i] + 2 * comm_tp[i] + comm_ep[i] if t.recompute == "full" else recompute * attn_core[i]
        again += recompute * comm_cp[i]
        stage_bwd.append(2 * forward[i] + 2 * comm_tp_back[i] + comm_ep_back[i] + comm_cp_back[i]
                         + again + edge_bwd[i] + (statistics[i] if full else 0.0))
    compute_total = m * sum(forward[i] * 3 + (blocks_forward[i] if t.recompute == "full" else recompute * attn_core[i])
                            for i in range(len(split))) / d.pp
    tp_total = m * sum(2 * c + 2 * cb + (2 * c if t.recompute == "full" else 0) + f + b
                       for c, cb, f, b in zip(comm_tp, comm_tp_back, edge_fwd, edge_bwd)) / d.pp
    cp_total = m * sum((1 + recompute) * c + back for c, back in zip(comm_cp, comm_cp_back)) / d.pp
    # the routing report: after the step, one all-reduce per pipeline rank of its MoE layers' loads
    report = sum(routing.report(sum(model.is_moe_layer(layer) for s in range(r, len(split), d.pp) for layer in split[s]))
                 for r in range(d.pp)) / d.pp if model.n_experts else 0.0
    ep_total = m * sum(c + b + (c if full else 0) + r for c, b, r in zip(comm_ep, comm_ep_back, statistics)) / d.pp + report
    if d.pp > 1:
        pipe = config.pipeline_parallel
        unit_f, unit_b = max(stage_fwd), max(stage_bwd)
        scale = tuple(max(f / unit_f, bw / unit_b) for f, bw in zip(stage_fwd, stage_bwd))
        # a message between stages: the whole activation, or 1/tp of it (sequence parallelism; scatter/gather,
        # whose receivers then all-gather the pieces over tp before the compute that needs them)
        scatter = pipe.scatter_gather and d.tp > 1
        send = links.link_for(d.pp_span).message(activation_bytes // (d.tp if sp or scatter else 1))
        if scatter:
            send += native_collective("all_gather", activation_bytes, d.tp, cluster.collective_link("all_gather", d.tp))
        sharing = core_sharing(config, d, cluster)
        costs = Costs(forward=unit_f, backward=unit_b, backward_input=unit_b / 2, backward_weight=unit_b / 2,
                      latency=send, stage_scale=scale, sharing=sharing)
        if runs is None and sharing is None:  # the closed form: the slowest stage's work, stretched by the ideal bubble
            from fivefold.parallel.pipeline.schedules import PipelineShape, ideal_bubble

            ideal = m * pipe.virtual * (unit_f + unit_b) * max(scale)
            makespan = ideal * (1 + ideal_bubble(pipe.schedule, PipelineShape(d.pp, m, pipe.virtual))) \
                + 2 * (d.pp - 1) * send
        else:
            makespan, _, busy_share = (runs or PipelineRuns()).run(pipe.schedule, d.pp, m, pipe.virtual, costs)
            # with shared cores the passes beside idle ranks ran faster than priced: their work took less time
            compute_total, tp_total, cp_total, ep_total = (x * busy_share for x in (compute_total, tp_total, cp_total,
                                                                                    ep_total))
        busy = compute_total + tp_total + cp_total + ep_total
        idle = max(makespan - busy, 0.0)
        pp_comm = min(idle, 2 * m * len(split) / d.pp * send)
        bubble = idle - pp_comm
        pp_comm += _tied_embedding_time(config, model, d, split, cluster)
        # every micro-batch runs under no_sync: the once-per-step reduction waits for the schedule's end
        once_behind = 0.0
    else:
        pp_comm = bubble = 0.0
        once_behind = stage_bwd[0]
    dp_time = _data_parallel_time(config, model, d, split, cluster, stage_fwd[0], stage_bwd[0], once_behind)
    return StepTime(compute_total, tp_total, cp_total, ep_total, pp_comm, bubble, dp_time,
                    _offload_time(config, model, d, split, cluster),
                    _optimizer_time(config, model, d, split, cluster.accelerator) + scalar_time(config, model, d, cluster))


def block_sync_points(config: JobConfig, d: Degrees, moe: bool) -> tuple[int, int, int]:
    """(tp, cp, ep): the sync points a block pass blocks on after a stretch of compute. Tensor parallelism:
    one per region (dense: attention and MLP; MoE: attention only), sequence parallelism's all-gather follows
    the previous region's reduce-scatter with no compute between; context parallelism: one per layer (ring
    attention's first K/V wait or Ulysses' first all-to-all; the steps after it follow short stretches); a MoE
    block with expert parallelism: the dispatch after the attention half and the combine after the experts.
    Overlapped tensor-parallel rings are left out (their waits hide behind the matmul chunks)."""
    tp = 0 if d.tp == 1 or (config.tensor_parallel.sequence_parallel and config.tensor_parallel.comm_overlap) \
        else (1 if moe else 2)
    return tp, int(d.cp > 1), 2 if moe and (d.ep > 1 or d.etp > 1) else 0


def block_sync_waits(config: JobConfig, d: Degrees, cluster: ClusterSpec, forward: float, moe: bool) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Arrival-skew seconds of one block's forward and backward, split (tp, cp, ep): each sync point of
    `block_sync_points` waits `cluster.sync_delay` of the pass's compute shared evenly between them (the
    backward's compute is twice the forward's `forward` seconds). Zero without a measured [arrival]."""
    syncs = block_sync_points(config, d, moe)
    total = sum(syncs)
    if not total or not cluster.arrival.measured:
        return (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)
    groups = (d.tp, d.cp, max(d.ep, d.etp))
    return tuple(tuple(n * cluster.sync_delay(scale * forward / total, p) for n, p in zip(syncs, groups))
                 for scale in (1, 2))


def priority_schedule(config: JobConfig, d: Degrees) -> bool:
    """Does the priority schedule run (parallel/parallelize.py)? Only over a data-parallel group (dp x cp) of two
    or more ranks: alone, a rank keeps the plain step, its norm and its update at the step's end."""
    return config.gradient_comm.schedule == "priority" and d.dp * d.cp > 1


def scalar_groups(config: JobConfig, model: ModelConfig, d: Degrees) -> list[tuple[str, int, str]]:
    """The step's scalar all-reduces, (what, bytes, group), the runtime's: the token count (4 bytes,
    train/trainer.py) over `dp_cp`; the gradient norm's (8 bytes, parallel/gradient_sync.py GradNorm) over ZeRO's
    `shard` block, `tp` and `pp`, and a MoE model's experts' over their `expert_shard` block, `ep`, `etp` and `pp`
    (none under the priority schedule, which takes no norm); the guard's verdict (24 bytes, reliability/guard.py)
    over the `world`. Parameter servers' steps are priced apart. The planner (`step_scalars`) and the simulator
    (sim/workload.py `scalars`) both read this list."""
    if config.data_parallel.mode == "ps":
        return []
    calls = [("token count", 4, "dp_cp")]
    if not priority_schedule(config, d):
        sharded = zero_degrees(config, d) is not None
        calls += [("gradient norm", 8, group) for group in (("shard",) if sharded else ()) + ("tp", "pp")]
        if model.n_experts:
            calls += [("gradient norm", 8, group)
                      for group in (("expert_shard",) if sharded else ()) + ("ep", "etp", "pp")]
    if config.guard.enabled:
        calls.append(("guard", 24, "world"))
    return calls


def step_scalars(config: JobConfig, model: ModelConfig, d: Degrees) -> list[tuple[str, int, int, int]]:
    """`scalar_groups` as (what, bytes, ranks, span of ranks), those over more than one rank."""
    deg = zero_degrees(config, d)
    stage = d.world // d.pp
    sizes = {"dp_cp": (d.dp * d.cp, d.fibre_span(d.dp * d.cp * d.tp)), "tp": (d.tp, d.tp), "pp": (d.pp, d.pp_span),
             "shard": (deg.optim, d.fibre_span(deg.optim * d.tp)) if deg is not None else (1, 1),
             "expert_shard": (_expert_dp(config, d), d.fibre_span(stage)), "ep": (d.ep, d.fibre_span(stage)),
             "etp": (d.etp, d.fibre_span(stage)), "world": (d.world, d.world)}
    calls = [(what, nbytes, *sizes[group]) for what, nbytes, group in scalar_groups(config, model, d)]
    return [call for call in calls if call[2] > 1]


def scalar_time(config: JobConfig, model: ModelConfig, d: Degrees, cluster: ClusterSpec) -> float:
    """Seconds of the step's scalar all-reduces (`step_scalars`), each blocking, at the backend's all-reduce on the
    link its span crosses (a few bytes: its latency); counted in the optimizer phase."""
    return sum(native_collective("all_reduce", nbytes, ranks, cluster.collective_link("all_reduce", span))
               for _, nbytes, ranks, span in step_scalars(config, model, d))


@dataclass(frozen=True)
class RoutingCollectives:
    """Seconds of a MoE layer's small collectives beside its exchanges: its routing statistics' all-reduce for the
    balancing loss, once per micro-batch (model/moe.py), the all-reduces summing the router's and shared experts'
    weight gradients over the tp ranks under sequence parallelism, per backward, and the trainer's routing report
    after the step (train/routing_report.py), one all-reduce per pipeline rank (`report`)."""

    statistics: float = 0.0
    replicas_backward: float = 0.0
    report_link: Link | None = None  # the distinct-token ranks' all-reduce link
    token_ranks: int = 1
    report_values: int = 0  # float64 per MoE layer in the report (`routing_report_values`)

    def report(self, layers: int) -> float:
        """The routing report of a pipeline rank holding `layers` MoE layers: `report_values` float64 each, one
        all-reduce."""
        if not layers or self.report_link is None:
            return 0.0
        return native_collective("all_reduce", layers * self.report_values * 8, self.token_ranks, self.report_link)


def routing_report_values(config: JobConfig, model: ModelConfig, d: Degrees) -> int:
    """float64 per MoE layer in the trainer's routing report (train/routing_report.py): E loads, 4 sums, and with
    ep > 1 and logging.moe_load_by_rank E more per expert-parallel position."""
    positions = d.ep if d.ep > 1 and config.logging.moe_load_by_rank else 0
    return model.n_experts * (1 + positions) + 4


def _routing_collectives(config: JobConfig, model: ModelConfig, d: Degrees, cluster: ClusterSpec) -> RoutingCollectives:
    """The switch loss all-reduces the layer's expert counts (E float64) over the ranks holding the micro-batch's
    distinct tokens (dp x cp, x tp under sequence parallelism), the sequence loss each sequence's counts (b x E
    float32) over the sequence's ranks (cp, x tp under SP); the report sends E + 4 float64 per layer (and with
    ep > 1 the loads by EP position, E x ep more) over the distinct-token ranks, in one all-reduce per pipeline
    rank."""
    if not model.n_experts:
        return RoutingCollectives()
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1

    def all_reduce(n: float, ranks: int, span: int) -> float:
        return native_collective("all_reduce", n, ranks, cluster.collective_link("all_reduce", span))

    tokens = d.dp * d.cp * (d.tp if sp else 1)
    token_span = d.fibre_span(tokens if sp else (tokens - 1) * d.tp + 1)
    statistics = 0.0
    if model.moe_aux_loss == "switch":
        statistics = all_reduce(8 * model.n_experts, tokens, token_span)
    elif model.moe_aux_loss != "none":
        sequence = d.cp * (d.tp if sp else 1)
        statistics = all_reduce(4 * config.train.micro_batch_size * model.n_experts, sequence,
                                sequence if sp else (sequence - 1) * d.tp + 1)
    replicas = 0.0
    if sp:
        element = weight_element(config)
        weights = ([model.shared_hidden_dim * model.dim] * 3 if model.shared_hidden_dim else []) + \
            ([model.dim] if model.shared_hidden_dim and model.moe_shared_gate else []) + [model.n_experts * model.dim]
        replicas = sum(all_reduce(n * element, d.tp, d.tp) for n in weights)
    return RoutingCollectives(statistics, replicas, cluster.collective_link("all_reduce", token_span), tokens,
                              routing_report_values(config, model, d))


@dataclass(frozen=True)
class TensorParallelEdges:
    """Seconds of one micro-batch's tensor-parallel collectives outside the blocks' regions
    (parallel/tensor_parallel.py): the vocab-parallel embedding's, the head's and the vocab-parallel loss's,
    and under sequence parallelism each norm's weight-gradient sum (two per block)."""

    embedding_forward: float = 0.0
    embedding_backward: float = 0.0
    head_forward: float = 0.0
    head_backward: float = 0.0
    norms_backward: float = 0.0  # per block


def _tensor_parallel_edges(config: JobConfig, model: ModelConfig, d: Degrees, cluster: ClusterSpec,
                           activation: float) -> TensorParallelEdges:
    """The embedding sums its vocabulary shards' lookups as it leaves its region (an all-reduce, or with sequence
    parallelism a reduce-scatter; backward: nothing, or an all-gather); the final norm's output enters the
    head's region (nothing, or an all-gather; backward: an all-reduce, or a reduce-scatter and the final norm's
    weight-gradient sum); the loss all-reduces each token's max logit, sum of exponentials and target logit
    (fp32). Until 2026-11-26 the planner left these out; `fivefold simulate` played them."""
    if d.tp == 1:
        return TensorParallelEdges()

    def collective(kind: str, n: float) -> float:
        return native_collective(kind, n, d.tp, cluster.collective_link(kind, d.tp))

    t = config.train
    loss = 3 * collective("all_reduce", t.micro_batch_size * (t.seq_len // d.cp) * 4)
    if not config.tensor_parallel.sequence_parallel:
        return TensorParallelEdges(collective("all_reduce", activation), 0.0, loss, collective("all_reduce", activation))
    norm = collective("all_reduce", model.dim * weight_element(config))
    return TensorParallelEdges(collective("reduce_scatter", activation), collective("all_gather", activation),
                               collective("all_gather", activation) + loss,
                               collective("reduce_scatter", activation) + norm, 2 * norm)


def attention_all_reduces(config: JobConfig, model: ModelConfig, d: Degrees) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes of each all-reduce one block's attention makes over the tensor-parallel group beside its region's
    entry and exit (parallel/tensor_parallel.py), as (forward, backward); full recomputation re-runs the forward
    ones. Weights whole on every rank of the group sum their gradients in backward: a `head` q/k norm's gains
    (Qwen3, head_dim each); with key/value heads replicated over the group (kv_heads % tp) each of wk, wv (and
    their biases) in one slot of a kv_heads-slot buffer; multi-latent attention's down-projections wq_a, wkv_a
    and their norms. A `projection` q/k norm (OLMo 2) all-reduces each norm's local sums of squares (4 bytes
    per token on this rank's s / cp tokens, whole inside the region under sequence parallelism) forward, their
    gradients backward, and with replicated key heads the key gain's gradient in its slot."""
    if d.tp == 1:
        return (), ()
    weight = weight_element(config)
    if model.attention == "mla":
        whole = [(model.kv_lora_rank + model.qk_rope_head_dim) * model.dim, model.kv_lora_rank]
        if model.q_lora_rank:
            whole += [model.q_lora_rank * model.dim, model.q_lora_rank]
        return (), tuple(n * weight for n in whole)
    forward, backward = [], []
    kv_width = model.kv_heads * model.head_size  # a kv-slot buffer's elements per row of the input
    if model.kv_heads % d.tp:
        biases = model.attention_bias != "none"
        backward += [kv_width * model.dim * weight] * 2 + [kv_width * weight] * (2 if biases else 0)
    if model.qk_norm == "head":
        backward += [model.head_size * weight] * 2
    elif model.qk_norm == "projection":
        t = config.train
        sums = t.micro_batch_size * (t.seq_len // d.cp) * 4
        forward += [sums, sums]
        backward += [sums, sums] + ([kv_width * weight] if model.kv_heads % d.tp else [])
    return tuple(forward), tuple(backward)


def _context_parallel_block(config: JobConfig, model: ModelConfig, d: Degrees, core: float, element: int,
                            cluster: ClusterSpec) -> tuple[float, float]:
    """Exposed context-parallel seconds of one block's attention, (forward, backward). Ring: r - 1 K/V blocks pass around a ring of r ranks, point to point, overlapped with the
    attention core (Liu et al.'s ring attention); as a double ring (inner_ring w, LoongTrain), r / w rounds of
    an inner ring, the inner hops on the link their span crosses, the outer on the link all of cp spans.
    Backward sends each block's K/V gradient after it as well; each exchange is posted on the rank's own thread
    (`Accelerator.post_seconds`). What a pass exposes is walked in the runtime's
    order of posts and waits (plan/ring_schedule.py; until 2026-11-26 afternoon a closed form that hid a
    round's hops behind the whole round's core, where the runtime waits for each after one step). Ulysses:
    all-to-alls of q, k and v to heads, one each, and of the output back (Jacobs et al.), not overlapped
    (until 2026-11-26 priced as one all-to-all of q, k and v together: gloo's fixed cost per call is a
    millisecond); 2d: Ulysses over
    `heads` ranks, then a ring over the rest on 1/heads of the heads."""
    cp = config.context_parallel
    if d.cp == 1:
        return 0.0, 0.0
    from fivefold.parallel.context_parallel import ContextParallelLayout

    layout = ContextParallelLayout.for_method(cp.method, d.cp, cp.heads, cp.inner_ring, cp.placement)
    heads = layout.heads
    t = config.train
    local = t.micro_batch_size * (t.seq_len // d.cp)  # tokens a rank holds
    exposed = 0.0
    if heads > 1:  # q, k and v each its own all-to-all (k and v repeated to `heads` kv heads first), the output one
        from fivefold.parallel.context_parallel import _kv_repeats

        q_heads, kv_heads = model.n_heads // d.tp, max(model.kv_heads // d.tp, 1)
        q_bytes = local * q_heads * model.head_size * element
        kv_bytes = local * kv_heads * _kv_repeats(q_heads, kv_heads, heads) * model.head_size * element
        members = [layout.cp_rank(0, h) for h in range(heads)]  # a head group's cp ranks: the span it crosses
        link = cluster.collective_link("all_to_all", (max(members) - min(members) + 1) * d.tp)
        exposed += 2 * native_collective("all_to_all", q_bytes, heads, link) + \
            2 * native_collective("all_to_all", kv_bytes, heads, link)
    ring_ranks, back = layout.ring, exposed
    if ring_ranks > 1:
        kv = 2 * local * heads * model.kv_dim // (d.tp * heads) * element
        inner, rounds = layout.inner_size, layout.outer
        inner_msg = cluster.link_for(layout.inner_span() * d.tp).message(kv)  # the outer ring spans all of cp
        outer_msg = cluster.link_for(d.cp * d.tp).message(kv)
        posting = cluster.accelerator.post_seconds(kv)
        forward = ring_pass_seconds(inner, rounds, core / ring_ranks, inner_msg, outer_msg, False, posting) - core
        backward = ring_pass_seconds(inner, rounds, 2 * core / ring_ranks, inner_msg, outer_msg, True, posting) - 2 * core
        back = exposed + backward  # the all-to-alls' conjugates, then the ring's backward pass
        exposed += forward
    return exposed, back


def _written_per_block(model: ModelConfig, config: JobConfig, d: Degrees) -> dict[bool, int]:
    """Bytes one block's forward writes to memory outside its matmuls, per micro-batch: the tensors it keeps
    for backward (docs/activation_memory.md's count, no recomputation), each written once; backward reads
    and writes them again (twice the forward, as for the FLOPs)."""
    t = config.train
    sp = config.tensor_parallel.sequence_parallel and d.tp > 1
    shape = ActivationShape(t.micro_batch_size, t.seq_len // d.cp, d.tp, sp, "none", head_parallel(config, d))
    element = 2 if compute_dtype(config) == "bf16" else 4
    rows = expert_rows(config, model, d)
    return {moe: element * _block_activations(model, layer, shape, rows) for moe in (False, True)
            if (layer := first_block(model, moe)) >= 0}


def tied_embedding_pair(model: ModelConfig, d: Degrees, split: list[list[int]], pp_group: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks of `pp_group` (one pipeline, in stage order) whose tied embedding copies are summed at reduce_grads:
    the first stage's and the last stage's (parallel/pipeline/stages.py `tied_embedding_rows`); () when the
    embedding is not tied or there is no pipeline (or were one rank to hold both stages)."""
    last = (len(split) - 1) % d.pp
    if not model.tie_embeddings or d.pp == 1 or last == 0:
        return ()
    return (pp_group[0], pp_group[last])


def tied_embedding_bytes(model: ModelConfig, d: Degrees, config: JobConfig) -> int:
    """Bytes of the tied embedding's gradient on one rank: its vocabulary rows (1/tp of the padded vocabulary under
    tensor parallelism) x dim, in the weights' dtype."""
    return padded_vocab(model.vocab_size, d.tp) // d.tp * model.dim * weight_element(config)


def _tied_embedding_time(config: JobConfig, model: ModelConfig, d: Degrees, split: list[list[int]],
                         cluster: ClusterSpec) -> float:
    """The all-reduce summing the first and last stages' tied embedding gradients: blocking, after the last backward."""
    pair = tied_embedding_pair(model, d, split, tuple(range(0, d.pp * d.pp_stride, d.pp_stride)))
    if not pair:
        return 0.0
    return native_collective("all_reduce", tied_embedding_bytes(model, d, config), 2,
                             cluster.collective_link("all_reduce", pair[1] - pair[0] + 1))


def _rank_stages(split: list[list[int]], pp: int, rank: int) -> tuple[range, bool, bool]:
    """The (virtual) stages pipeline rank `rank` holds (rank, rank + pp, ...), and whether they include the first
    (embedding) and the last (final norm and head)."""
    return range(rank, len(split), pp), rank == 0, (len(split) - 1) % pp == rank


def _pipeline_ranks(model: ModelConfig, d: Degrees, split: list[list[int]]):
    """(blocks, first, last) of each pipeline rank unlike those before it (ranks holding alike blocks take alike
    optimizer steps)."""
    seen = set()
    for rank in range(d.pp):
        stages, first, last = _rank_stages(split, d.pp, rank)
        layers = [layer for s in stages for layer in split[s]]
        key = (len(layers), sum(map(model.is_moe_layer, layers)) if model.n_experts else 0, first, last)
        if key not in seen:
            seen.add(key)
            yield layers, first, last


def _optimizer_time(config: JobConfig, model: ModelConfig, d: Degrees, split: list[list[int]],
                    accelerator: Accelerator) -> float:
    """AdamW on the accelerator, on the busiest pipeline rank: 28 bytes per parameter it updates (read weight,
    gradient and both moments, write weight and moments; `optimizer_shard`) at the accelerator's optimizer rate,
    plus its fixed cost per tensor (parameter tensors; under ZeRO the flat groups, each rank updating its shard of
    every group), after the gradient norm and clipping over the same gradients (`Accelerator.clip_seconds`);
    offload runs both on the host."""
    if config.data_parallel.offload:
        return 0.0
    flat = zero_degrees(config, d) is not None
    clipping = config.train.max_grad_norm > 0
    norm = not priority_schedule(config, d)  # the priority schedule takes no norm (it refuses clipping)

    def seconds(layers: list[int], first: bool, last: bool) -> float:
        shard = optimizer_shard(rank_parameters(model, layers, first, last, d.tp, d.ep, d.etp, pipelined=d.pp > 1,
                                                replicas=d.replicas), config, d)
        tensors = rank_tensors(model, layers, first, last, d.ep, pipelined=d.pp > 1, flat=flat, replicas=d.replicas)
        return accelerator.optimizer_seconds(shard, tensors) + (accelerator.clip_seconds(shard, clipping) if norm else 0.0)

    return max(seconds(layers, first, last) for layers, first, last in _pipeline_ranks(model, d, split))


def _offload_time(config: JobConfig, model: ModelConfig, d: Degrees, split: list[list[int]], cluster: ClusterSpec) -> float:
    """The busiest pipeline rank's optimizer shard to the host and back (`offload_seconds`)."""
    return max(offload_seconds(config, optimizer_shard(rank_parameters(model, layers, first, last, d.tp, d.ep, d.etp,
                                                                       pipelined=d.pp > 1, replicas=d.replicas),
                                                       config, d), cluster)
               for layers, first, last in _pipeline_ranks(model, d, split))


def offload_seconds(config: JobConfig, shard: float, cluster: ClusterSpec) -> float:
    """ZeRO-Offload of a rank's shard of `shard` parameters: its gradients go to host memory and its updated
    weights come back, over the host link (PCIe), not overlapped; the CPU optimizer step itself is not
    counted. NVMe offload (ZeRO-Infinity) adds reading and writing the fp32 master and both moments (12 + 12
    bytes per parameter) through the node's drives, shared by its accelerators; the CPU step hides behind
    that I/O. (The simulator runs the same seconds as a span of the rank's step.)"""
    z = config.data_parallel
    if not z.offload:
        return 0.0
    weight = 2 if z.param_dtype == "bf16" else 4
    seconds = 2 * weight * shard / (cluster.host_bandwidth_gbs * 1e9)
    if z.nvme_path:
        seconds += 2 * 12 * shard * cluster.accelerators_per_node / (cluster.nvme_bandwidth_gbs * 1e9)
    return seconds


def _data_parallel_time(config: JobConfig, model: ModelConfig, d: Degrees, split: list[list[int]], cluster: ClusterSpec,
                        forward: float, backward: float, once_behind: float | None = None) -> float:
    """Exposed data-parallel seconds per step. DDP and ZeRO-1 reduce once, during the last micro-batch's
    backward (DDP all-reduces, natively or with its configured algorithm; ZeRO reduce-scatters), or, under a
    pipeline, whose micro-batches all run under no_sync, after the schedule (`once_behind` = 0: the compute
    the once-per-step reduction hides behind; default `backward`); ZeRO-2
    reduce-scatters in every micro-batch's backward; ZeRO-3 also gathers the weights in each forward and
    backward (prefetched: on an accelerator hidden block by block behind the pass's compute, on a CPU host's
    shared cores exposed; `_zero3_pass_time`); ZeRO's collectives are one per flat group
    (`flat_group_sizes`, `_sharded_time`). ZeRO-1/2 gather the updated weights after the
    step, exposed. What one pass cannot hide is exposed, and never less than the last bucket (ZeRO-1/2: the
    collectives issued after the last block's backward, `_sharded_time`). A gradient codec's
    local work (`Accelerator.codec_seconds`) runs on the communication thread with its messages: hidden with them
    behind backward on an accelerator; on a CPU host whose cores the ranks share (`core_sharing`) backward keeps
    every core busy, so it adds in full."""

    group, experts = d.dp * d.cp, _expert_dp(config, d)
    if group == 1 and experts == 1:
        return 0.0
    once_behind = backward if once_behind is None else once_behind
    z, m, g = config.data_parallel, config.train.grad_accum_steps, config.gradient_comm
    stages = list(range(0, len(split), d.pp))
    layers = [layer for s in stages for layer in split[s]]
    params = rank_parameters(model, layers, True, len(split) == 1, d.tp, d.ep, d.etp, pipelined=d.pp > 1,
                             replicas=d.replicas)
    element = weight_element(config)
    grad_element = 2 if g.reduce_dtype == "bf16" else element
    # the routed experts are a second instance over their expert-data-parallel group (parallel/data_parallel.py)
    dense, routed = params.dense, params.experts
    grad_bytes = dense * grad_element
    span = d.fibre_span(group * d.tp)
    buckets = max(1, int((params.total * grad_element) // (g.bucket_mb * 2**20)))

    def native(collective: str, n: float, ranks: int = group) -> float:
        return native_collective(collective, n, ranks, cluster.collective_link(collective, span))

    def hidden_behind(comm: float, compute: float) -> float:
        return max(comm - compute, comm / buckets)

    if z.zero_stage == 0 and g.compression != "none":
        # every bucket through the codec, the routed experts' over their EDP group
        if g.compression == "powersgd":  # per bucket: P factors and the uncompressed tensors, then Q factors
            shares = powersgd_shares(model, d.tp, d.etp, g.powersgd_rank)
            reduce = sum(buckets * _dense_all_reduce(g, 4 * share * values / buckets, ranks, cluster, span)
                         for values, ranks, kind in ((dense, group, shares[0]), (routed, experts, shares[1]))
                         if values and ranks > 1 for share in kind[:2])
        else:
            reduce = _compressed_reduce_time(g, dense, group, buckets, cluster, span) if group > 1 else 0.0
            reduce += _compressed_reduce_time(g, routed, experts, buckets, cluster, span) \
                if routed and experts > 1 else 0.0
        work = sum(cluster.accelerator.codec_seconds(g.compression, values, ranks)
                   for values, ranks in ((dense, group), (routed, experts)) if values and ranks > 1)
        if core_sharing(config, d, cluster) is not None:  # the host's cores are busy with backward: work adds
            return hidden_behind(reduce, once_behind) + work
        return hidden_behind(reduce + work, once_behind)
    if z.zero_stage == 0:
        if g.schedule == "priority":  # dense DDP only (MoE, pipelines and codecs are refused with it)
            pieces = priority_slice_bytes(model, d.tp, g.bucket_mb, g.slice_mb, grad_element)
            return _priority_time(g, pieces, group, cluster, span, forward, backward)
        expert_reduce = native("all_reduce", routed * grad_element, experts) if routed and experts > 1 else 0.0
        reduce = _dense_all_reduce(g, grad_bytes, group, cluster, span, grad_bytes / buckets) if group > 1 else 0.0
        return hidden_behind(reduce + expert_reduce, once_behind) + replica_gradient_seconds(config, model, d, cluster)
    sizes = flat_group_sizes(model, d.tp, d.etp, d.ep, d.replicas)
    blocks, routed_groups = (Counter(n) for n in sizes.of(layers, False, False))  # a few distinct sizes, many times
    root = Counter(sizes.of([], True, len(split) == 1)[0])
    shared_host = core_sharing(config, d, cluster) is not None
    if z.quantized_weights or z.hpz_partition > 1 or z.gradient_bits:  # the dense groups' ZeRO-3, through ZeRO++
        forward_gather, backward_gather, scatter, root_gather = _zero_pp_times(config, root, blocks, d, cluster)
        last = Counter(sizes.embedding)
        time = m * _zero3_pass_time(forward_gather, backward_gather, scatter(root - last), scatter(blocks), scatter(last),
                                    forward, backward, len(layers), shared_host) + root_gather
    else:
        time = _sharded_time(zero_degrees(config, d), d, cluster, root, blocks, element, grad_element, m, forward,
                             backward, once_behind, len(layers), Counter(sizes.embedding),
                             shared_host) if group > 1 else 0.0
    if routed and experts > 1:  # plain ZeRO at the same stage over the EDP group (the runtime's: no shard_* override)
        from fivefold.parallel.shard_layout import ShardDegrees

        time += _sharded_time(ShardDegrees.resolve(z.zero_stage, experts, experts), d, cluster, Counter(), routed_groups,
                              element, grad_element, m, forward, backward, once_behind,
                              sum(map(model.is_moe_layer, layers)), Counter(), shared_host)
    return time


def replica_gradient_seconds(config: JobConfig, model: ModelConfig, d: Degrees, cluster: ClusterSpec) -> float:
    """EPLB's replicated experts (`expert_parallel.replicas`): after DDP's reduction, each replicated expert's
    gradient is all-reduced over the expert-parallel ranks holding it (parallel/expert_parallel.py
    `ReplicaGradients`), exposed; the busiest EP rank's sum, over the placement the runtime computes from
    `expert_parallel.load_from` (parallel/expert_placement.py `placements_for`)."""
    if not d.replicas or d.ep < 2:
        return 0.0
    from fivefold.parallel.expert_placement import placements_for, replica_holders

    placements = placements_for(model.moe_layers, model.n_experts, d.ep, d.replicas, config.expert_parallel.load_from)
    nbytes = expert_values(model, d.etp) * weight_element(config)
    stride = 1 if config.tensor_parallel.sequence_parallel and d.tp > 1 else d.tp
    link = cluster.collective_link("all_reduce", d.fibre_span((d.ep - 1) * d.etp * stride + 1))
    busiest = 0.0
    for rank in range(d.ep):
        seconds = 0.0
        for placement in placements.values():
            holders = replica_holders(placement)
            seconds += sum(native_collective("all_reduce", nbytes, len(holders[e]), link)
                           for e in placement[rank] if len(holders[e]) > 1)
        busiest = max(busiest, seconds)
    return busiest


def _priority_time(g, pieces: tuple[int, ...], group: int, cluster: ClusterSpec, span: int, forward: float,
                   backward: float) -> float:
    """Exposed seconds of the priority schedule (P3: Jayarajan et al. 2019): every slice (`pieces`, bytes each) is one
    all-reduce after a negotiation all-reduce of the readiness vector (4 bytes per slice, the backend's); slices run
    in next-forward order and each module's update waits only for its own, so the reduction hides behind this step's
    backward and the next step's first forward, and at least one slice (the first module's) stays exposed."""
    negotiate = native_collective("all_reduce", 4 * len(pieces), group, cluster.collective_link("all_reduce", span))
    reduce = sum(_dense_all_reduce(g, n, group, cluster, span, n) + negotiate for n in pieces)
    return max(reduce - backward - forward, reduce / len(pieces))


def _dense_all_reduce(g, nbytes: float, p: int, cluster: ClusterSpec, span: int, chosen_at: float = 0.0) -> float:
    """One all-reduce of `nbytes` over p ranks by gradient_comm.allreduce_algorithm (the backend's on its link for
    the span, or the hand-written algorithm's formula; `auto`: the cheapest at `chosen_at` bytes, a bucket's,
    default the whole)."""
    from fivefold.comm.cost import best_all_reduce, predict

    if nbytes <= 0:
        return 0.0
    if g.allreduce_algorithm == "native":
        return native_collective("all_reduce", nbytes, p, cluster.collective_link("all_reduce", span))
    links = cluster.links()
    algorithm = g.allreduce_algorithm
    if algorithm == "auto":
        algorithm = best_all_reduce(chosen_at or nbytes, p, links)
    return predict(algorithm, nbytes, p, links)


def _codec_padded(g, numel: int, p: int) -> int:
    """A bucket of `numel` values as the two-phase codecs pad it: to a multiple of p x compression_block."""
    return -(-numel // (p * g.compression_block)) * p * g.compression_block


def codec_exchanges(g, numel: int, p: int) -> list[tuple[str, str, int]]:
    """(collective, algorithm, bytes) of one DDP bucket of `numel` values through the int8, sign or top-k codec over
    p ranks (comm/compression.py), in the runtime's order: int8 / sign all-to-all the bucket's codes (bits / 8
    bytes per value, padded) and its fp32 scales (one per block), then all-gather the chunk owners' re-compressed
    sums (the same bytes again); top-k all-gathers every rank's k = ratio x n values and int32 indices."""
    if g.compression == "topk":
        return [("all_gather", "ring", p * 8 * max(1, math.ceil(g.topk_ratio * numel)))]
    padded = _codec_padded(g, numel, p)
    codes, scales = padded * (1 if g.compression == "sign" else 8) // 8, 4 * padded // g.compression_block
    return [(kind, algorithm, n) for kind, algorithm in (("all_to_all", "pairwise"), ("all_gather", "ring"))
            for n in (codes, scales)]


def _compressed_reduce_time(g, numel: int, p: int, buckets: int, cluster: ClusterSpec, span: int) -> float:
    """A step's DDP buckets (`numel` gradients in `buckets` equal buckets) through gradient_comm.compression's codec
    (`codec_exchanges`), each exchange on the backend's link for the span as the simulator prices it; the codecs'
    local work is `Accelerator.codec_seconds`."""
    per = -(-numel // buckets)
    return buckets * sum(native_collective(kind, n, p, cluster.collective_link(kind, span))
                         for kind, _, n in codec_exchanges(g, per, p))


def _sharded_time(deg, d: Degrees, cluster: ClusterSpec, root: Counter, blocks: Counter, element: int,
                  grad_element: int, m: int, forward: float, backward: float, once_behind: float,
                  units: int, last_ready: Counter, shared_host: bool) -> float:
    """Exposed ZeRO seconds per step for sharding degrees p | g | o over D = dp x cp ranks (parallel/shard_layout.py),
    each collective on the links its group spans (members are tp ranks apart on the grid; params, grads and
    blocks are consecutive, split and publish groups strided within a block of o, replicas across blocks).
    Every collective is one per flat group (groups of each size: the `root` module's, embedding, final norm and
    head, and the `blocks`'), as parallel/zero.py issues them:
        per micro-batch  p > 1: all-gather of the blocks' weights over p before forward and backward (prefetched);
                         g > 1: reduce-scatter of the gradients over g (hidden behind backward)
        once             p > 1: all-gather of the root's weights before the first forward, waited for at once
                         (exposed), kept until the step;
                         g = 1: reduce-scatter over the block of o (hidden behind the last backward, or
                         `once_behind`: nothing under a pipeline);
                         g > 1: reduce-scatter of the gradient piece over o/g; all-reduce of the optimizer piece
                         over D/o replicas; all-gather of the updated weights over o/p: all exposed.
    The stages are (1, 1, N), (1, N, N), (N, N, N). Without a gather in the pass (ZeRO-1/2) each group's
    reduce-scatter starts as its unit's backward completes it (parallel/zero.py `_on_grad_ready`), so what the
    backward cannot hide is never less than what is issued after the last block's backward: one of the `units`
    blocks' groups and the `last_ready` groups (the embedding's, complete last), not a DDP bucket's share (ZeRO
    has no buckets; the simulator plays the same calls). ZeRO-3's pass: `_zero3_pass_time` (`shared_host`: the
    ranks share a CPU host's cores, `core_sharing`); until 2026-11-29 it hid down to a DDP bucket's share."""
    units = max(units, 1)  # (a pipeline rank may hold no MoE block)
    stride = d.tp

    def over(kind: str, collective: str, sizes: Counter, element: int, parts: int = 1) -> float:
        size = deg.size(kind)
        if size == 1:
            return 0.0
        link = cluster.collective_link(collective, d.fibre_span(deg.span(kind) * stride))
        return _per_group(sizes, lambda n: native_collective(collective, n * element / parts, size, link))

    def issued_per_group(kind: str, compute: float) -> float:
        return _hidden_per_group(over(kind, "reduce_scatter", groups, grad_element),
                                 over(kind, "reduce_scatter", blocks, grad_element) / units
                                 + over(kind, "reduce_scatter", last_ready, grad_element), compute)

    groups = root + blocks
    gather = over("params", "all_gather", blocks, element)
    if gather:  # ZeRO-3
        per_micro = _zero3_pass_time(gather, gather, *(over("grads", "reduce_scatter", sizes, grad_element)
                                                       for sizes in (root - last_ready, blocks, last_ready)),
                                     forward, backward, units, shared_host)
    else:
        per_micro = issued_per_group("grads", backward)
    once = over("params", "all_gather", root, element)
    if deg.grads == 1:
        once += issued_per_group("split", once_behind)
    else:
        once += over("split", "reduce_scatter", groups, grad_element, deg.grads)
    once += over("replica", "all_reduce", groups, grad_element, deg.optim) + \
        over("publish", "all_gather", groups, element, deg.params)
    return m * per_micro + once


def _hidden_per_group(scatter: float, tail: float, compute: float) -> float:
    """Exposed seconds of reduce-scatters issued group by group as backward completes each (`scatter` in all) behind
    `compute`: never less than the `tail` issued after the last block's backward."""
    return max(scatter - compute, min(tail, scatter)) if scatter else 0.0


def _zero3_pass_time(forward_gather: float, backward_gather: float, early: float, blocks_scatter: float,
                     last_scatter: float, forward: float, backward: float, units: int, shared_host: bool) -> float:
    """Exposed seconds of one micro-batch's ZeRO-3 collectives (plain or ZeRO++): the blocks' gathers before forward
    and backward, and every group's reduce-scatter (`early`: the root's groups ready before the first block's
    backward, the final norm's and an untied head's, queued ahead of that block's gather, which waits for them;
    `blocks_scatter`: the blocks'; `last_scatter`: the embedding's, complete last), over `units` blocks and the
    pass's compute. On an accelerator the runtime's prefetch (the next block's gather at a block's pre-hook: the
    previous block's in backward, ahead of that block's reduce-scatters) hides each gather but a pass's first behind
    the block before it, block by block (a against c: max(0, a - c)); in backward a block's reduce-scatters and the
    next prefetch share the communication thread behind the next block (max(0, r + a - c)), and the last block's
    and the embedding's follow the last backward. On ranks sharing a CPU host's cores gloo moves a prefetched
    gather's bytes on the cores the block's compute holds: every gather is exposed, and the reduce-scatters, behind
    the prefetch, run beside the next block's backward, never less exposed than the last block's and the
    embedding's (ZeRO-1/2's rule, `_sharded_time`). The simulator plays the same calls (sim/workload.py)."""
    units = max(units, 1)
    r = blocks_scatter / units
    tail = r + last_scatter
    if shared_host:
        return forward_gather + backward_gather + early + _hidden_per_group(blocks_scatter + last_scatter, tail, backward)
    a_f, a_b, c_f, c_b = forward_gather / units, backward_gather / units, forward / units, backward / units
    return a_f + (units - 1) * max(0.0, a_f - c_f) + early + a_b + \
        (units > 1) * (max(0.0, a_b - c_b) + max(0.0, r - c_b)) + max(0, units - 2) * max(0.0, r + a_b - c_b) + tail


def _overlapped_tp_block(model: ModelConfig, d: Degrees, block: float, core: float, activation: float,
                         cluster: ClusterSpec, moe: bool) -> float:
    """tensor_parallel.comm_overlap (parallel/tp_overlap.py): one block's exposed tensor-parallel seconds, per
    region of a dense block (the caller counts two). Each of a region's two rings takes t - 1 steps of one
    sequence chunk (alpha + activation/t beta on the tp link) beside 1/t of the matmul it feeds (q, k, v and wo;
    w1, w3 and w2, shared by weight size); a step shows what its transfer takes beyond its matmul, plus its post on
    the rank's thread (`Accelerator.post_seconds`). A MoE
    block's MLP is outside the region: it has no tensor-parallel collective."""
    t = d.tp
    step = cluster.link_for(t).message(activation / t)
    posting = cluster.accelerator.post_seconds(activation / t)  # each exchange posted on the rank's thread
    attention_matmul = block / 2 - core
    q, kv = model.q_dim, model.kv_dim
    shares = [(attention_matmul, (q + 2 * kv) / (2 * q + 2 * kv)), (attention_matmul, q / (2 * q + 2 * kv))]
    if not moe:
        shares += [(block / 2, 2 / 3), (block / 2, 1 / 3)]
    exposed = sum((t - 1) * (posting + max(0.0, step - seconds * share / t)) for seconds, share in shares)
    return exposed / 2


def _zero_pp_times(config: JobConfig, root: Counter, blocks: Counter, d: Degrees,
                   cluster: ClusterSpec) -> tuple[float, float, Callable[[Counter], float], float]:
    """Seconds of ZeRO-3's forward gathers of the blocks, their backward gathers, the reduce-scatters of a set of
    groups (a function of their sizes; per micro-batch) and the root's gather (once a step) with ZeRO++ (parallel/zero_pp.py), one collective (or
    set of them) per flat group (`root`, `blocks`: groups of each size), as the runtime issues them: qwZ gathers
    each group's int8 codes and its fp32 scales (one per block of values) in two all-gathers; hpZ's backward
    gather runs over h ranks of one node; qgZ all-to-alls each group's codes and scales within the node (L ranks)
    and then 1/L of them across the K nodes. Nodes are the cluster's (or gradient_comm.node_size ranks)."""
    from fivefold.plan.zero_traffic import quantized_parts

    z = config.data_parallel
    shards = d.dp_shard * d.cp
    stride = d.tp  # shard-group members are tp ranks apart on the grid
    node = config.gradient_comm.node_size or cluster.accelerators_per_node
    per_node = max(1, min(shards, node // stride))
    nodes = max(1, shards // per_node)
    weight = 2 if z.param_dtype == "bf16" else 4
    reduce = 2 if config.gradient_comm.reduce_dtype == "bf16" else weight

    def native(collective: str, n: float, p: int) -> float:
        return native_collective(collective, n, p, cluster.collective_link(collective, p * stride))

    def gather(n: int) -> float:
        if not z.quantized_weights:
            return native("all_gather", n * weight, shards)
        return sum(native("all_gather", shards * part, shards)
                   for part in quantized_parts(-(-n // shards), 8, z.quantization_block))

    def regather(n: int) -> float:
        return native("all_gather", n * weight, z.hpz_partition) if z.hpz_partition > 1 else gather(n)

    def scatter(n: int) -> float:
        if not z.gradient_bits:
            return native("reduce_scatter", n * reduce, shards)
        shard = -(-n // shards)
        within = sum(native("all_to_all", per_node * part, per_node)
                     for part in quantized_parts(nodes * shard, z.gradient_bits, z.quantization_block))
        across = sum(native_collective("all_to_all", nodes * part, nodes, cluster.link_for(shards * stride))
                     for part in quantized_parts(shard, z.gradient_bits, z.quantization_block)) if nodes > 1 else 0.0
        return within + across

    return (_per_group(blocks, gather), _per_group(blocks, regather), lambda sizes: _per_group(sizes, scatter),
            _per_group(root, gather))


def _per_group(sizes: Counter, seconds: Callable[[int], float]) -> float:
    """A collective's `seconds` (of a group's elements) summed over the flat groups, `sizes` counting the groups of
    each size (ZeRO issues one per group)."""
    return sum(count * seconds(n) for n, count in sizes.items())


# ---------------------------------------------------------------------------------------------- together
def estimate(config: JobConfig, gpus: int, cluster: ClusterSpec, efficiency: float | Efficiency = 0.5,
             vocab_size: int = 0,
             runs: PipelineRuns | None = None, time_if_over: bool = True, simulate: bool = True,
             expert_load: dict[str, list] | None = None) -> Estimate:
    """Memory and step time of `config` on `gpus` accelerators of `cluster` (ConfigError if it cannot run).

    expert_load: each MoE layer's measured assignments per expert (a run's moe_load), or one such list per EP
    position (moe_load_by_ep_rank; plan/expert_load.py): the MoE layers' activations are the busiest EP rank's
    (`busiest_expert_rows`) on every rank, and the expert exchanges
    and the busiest rank's routed experts priced under that routing (plan/expert_load.py), else balanced.

    runs: pipeline simulations (and model FLOP counts) to share between estimates (a search's); simulate=False prices the
    pipeline by the closed-form ideal bubble instead (a search's first pass); time_if_over=False leaves
    the step time out (None) when the memory is over the accelerator's capacity."""

    efficiency = as_efficiency(efficiency)
    cluster.check_size(gpus)
    d = degrees_of(config, gpus)
    model = model_for(config, vocab_size)
    pipe, t = config.pipeline_parallel, config.train
    shared = runs or PipelineRuns()
    split = shared.stage_split(model, t.seq_len, d.pp * pipe.virtual, pipe.layers_per_stage, pipe.balance) \
        if d.pp > 1 else [list(range(model.n_layers))]
    runs = shared if simulate else None
    rows = expert_rows_by_load(model, config, d, expert_load) if expert_load is not None else None
    memory = memory_per_rank(config, model, d, split, shared,
                             busiest_expert_rows(config, model, d, rows) if rows is not None else None)
    first_of: dict[int, int] = {}  # ranks of alike memory share one object: price each once, first rank first
    for rank, held in enumerate(memory):
        first_of.setdefault(id(held), rank)
    worst = max(first_of.values(), key=lambda r: memory[r].total)
    dtype = compute_dtype(config)
    peak = cluster.accelerator.peak_flops(dtype)
    over = memory[worst].total > cluster.memory_bytes
    server = None
    if config.data_parallel.mode == "ps":
        loads = server_loads(model, config.parameter_server.servers, d.dp)
        shard = max(elements for elements, _ in loads)
        server = server_memory(config, shard, d.dp)
        over = over or server.total > cluster.memory_bytes
    time = None if over and not time_if_over else step_time(config, model, d, split, cluster, efficiency, runs, rows)
    if time is not None and server is not None:
        push_pull, clip, update = _parameter_server_time(config, loads, d.dp, gpus, cluster)
        compute = time.compute
        sharing = host_sharing(config, gpus, cluster)
        if sharing is not None:  # the workers compute while the servers wait, and the other way round
            compute /= sharing.speed(d.dp, gpus)
            update /= sharing.speed(gpus - d.dp, gpus)
        ps = config.parameter_server
        if ps.sync == "bsp" or (ps.sync == "ssp" and ps.staleness == 0):  # in lock step: one after another
            time = dataclasses.replace(time, compute=compute, dp=push_pull + clip, optimizer=update)
        else:  # the workers' steady state (sim/asynchronous.py): a worker waits for its own push, update and pull,
            # unless the busiest server, taking each push and then stepping it, one after another, is slower
            own, mine = update / d.dp, push_pull / d.dp
            queue = max(0.0, (push_pull / 2 + update) - (compute + clip + mine + own))
            time = dataclasses.replace(time, compute=compute, dp=clip + mine + queue, optimizer=own)
    tokens = t.micro_batch_size * t.grad_accum_steps * d.dp * t.seq_len
    notes = []
    if cluster.arrival.measured and time is not None and any(
            sum(block_sync_points(config, d, moe)) for moe in (False, True)):
        notes.append("tp / cp / ep comm include the ranks' arrival skew at each blocking collective (the cluster's "
                     "[arrival])")
    return Estimate(d, gpus, memory[worst], worst, memory, time, tokens, shared.flops_per_token(model, t.seq_len) * tokens,
                    peak, cluster.memory_bytes, notes, server, imbalance(rows) if rows is not None else None)
