"""Pipeline schedules as pure per-rank instruction streams (no torch.distributed).

A schedule is data: for each pipeline rank, the ordered list of what it does in one optimizer
step. The executor runs it, the simulator (simulate.py) checks it and times it, the timeline
plot draws it. p ranks hold p x v stages; stage s lives on rank s % p (with v > 1 each rank
holds v non-adjacent "virtual" stages, Narayanan et al. 2021).

    gpipe        all forwards, then all backwards (Huang et al. 2019): m micro-batches in flight.
    1f1b         p - r - 1 warm-up forwards on rank r, then one forward / one backward in turn,
                 then the remaining backwards (PipeDream-Flush, Narayanan et al. 2019/2021):
                 at most p - r micro-batches in flight.
    interleaved  1F1B over v virtual stages per rank, micro-batches taken p at a time per chunk
                 (Megatron-LM's interleaved schedule): bubble (p-1)/(v m) of the ideal time.
    zb-h1        1F1B with the backward split into input gradient (I) and weight gradient (W);
                 W passes wait and fill the idle slots (Qi et al. 2023, "Zero Bubble Pipeline
                 Parallelism", schedule ZB-H1): with equal F, I, W times the bubble falls from
                 (p-1)(F+I+W) to (p-1)(F+I-W), with 1F1B's peak of in-flight micro-batches.

Communication instructions are derived from the compute order: a forward of stage s > 0 is
preceded by receiving its activation from stage s-1's rank and a forward of s < S-1 followed by
sending it on; backwards mirror this with gradients. Every stream ends with REDUCE_GRADS
(data-parallel gradient sync) and OPTIMIZER_STEP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import lru_cache
from fivefold.errors import ConfigError


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    RECV_ACT = "recv_act"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    SEND_GRAD = "send_grad"
    REDUCE_GRADS = "reduce_grads"
    OPTIMIZER_STEP = "optimizer_step"


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Instruction:
    op: Op
    microbatch: int = -1
    stage: int = -1  # the (virtual) stage computed, or the local stage a message belongs to
    peer: int = -1  # the other rank of a send or receive

    def __str__(self) -> str:
        if self.op in COMPUTE:
            return f"{self.op.value}{self.microbatch}@s{self.stage}"
        if self.peer >= 0:
            return f"{self.op.value}(mb{self.microbatch}, s{self.stage}, peer {self.peer})"
        return self.op.value


@dataclass(frozen=True)
class PipelineShape:
    """p ranks, m micro-batches per step, v virtual stages per rank."""

    ranks: int
    microbatches: int
    virtual: int = 1

    def __post_init__(self) -> None:
        for name in ("ranks", "microbatches", "virtual"):
            if getattr(self, name) < 1:
                raise ConfigError(f"pipeline {name} = {getattr(self, name)}: must be a positive integer")

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks


def check_schedule(name: str, shape: PipelineShape) -> None:
    """Raise ValueError, naming the setting, when `name` cannot run on `shape`."""
    if name not in SCHEDULES:
        raise ConfigError(f"pipeline_parallel.schedule = {name!r} is not one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        if shape.virtual < 2:
            raise ConfigError("the interleaved schedule needs at least 2 virtual stages per rank (pipeline_parallel.virtual >= 2)")
        if shape.microbatches % shape.ranks:
            raise ConfigError(f"the interleaved schedule takes micro-batches {shape.ranks} at a time: "
                             f"make the micro-batch count ({shape.microbatches}) a multiple of pp ({shape.ranks})")
    elif shape.virtual != 1:
        raise ConfigError(f"pipeline_parallel.schedule = {name} runs one stage per rank: set pipeline_parallel.virtual = 1 or use interleaved")


# ----------------------------------------------------------------------------- compute orders
def _gpipe(shape: PipelineShape, rank: int) -> list[tuple[Op, int, int]]:
    m = shape.microbatches
    return [(Op.FORWARD, i, rank) for i in range(m)] + [(Op.BACKWARD, i, rank) for i in range(m)]


def _one_f_one_b(shape: PipelineShape, rank: int) -> list[tuple[Op, int, int]]:
    m = shape.microbatches
    warmup = min(shape.ranks - rank - 1, m)
    order = [(Op.FORWARD, i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(Op.FORWARD, warmup + i, rank), (Op.BACKWARD, i, rank)]
    return order + [(Op.BACKWARD, i, rank) for i in range(m - warmup, m)]


def _interleaved(shape: PipelineShape, rank: int) -> list[tuple[Op, int, int]]:
    p, v, m = shape.ranks, shape.virtual, shape.microbatches
    total = m * v  # (micro-batch, chunk) pairs this rank computes, each forward and backward

    def microbatch(k: int) -> int:  # micro-batches go p at a time through each chunk in turn
        return (k // (p * v)) * p + k % p

    def forward(k: int):
        return Op.FORWARD, microbatch(k), ((k // p) % v) * p + rank

    def backward(k: int):
        return Op.BACKWARD, microbatch(k), (v - 1 - (k // p) % v) * p + rank

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


@lru_cache(maxsize=64)
def _zero_bubble_h1(shape: PipelineShape) -> tuple[tuple[tuple[Op, int, int], ...], ...]:
    """ZB-H1 built by list scheduling with unit F, I, W times, as the paper's figure.

    Each rank, whenever free, runs the first of: an input-gradient pass whose gradient has
    arrived (it unblocks the previous stage); a forward whose input has arrived, while fewer
    than p - r micro-batches hold activations (F done, I not: 1F1B's bound, so at most p - r
    after it) and fewer than 2p - r - 1 hold any state (F done, W not); a pending weight-gradient
    pass. Unbounded W delay gives the same bubble but lets the W state of every
    micro-batch pile up; a tighter bound than 2p - r - 1 brings bubble back.
    """
    p, m = shape.ranks, shape.microbatches
    clock = [0] * p
    forward_done = [[None] * m for _ in range(p)]  # time the forward of (rank, mb) finished
    input_done = [[None] * m for _ in range(p)]
    next_forward, next_input, weights_done = [0] * p, [0] * p, [0] * p
    pending_weight: list[list[int]] = [[] for _ in range(p)]
    order: list[list[tuple[Op, int, int]]] = [[] for _ in range(p)]
    idle = (float("inf"),)

    def candidate(r: int) -> tuple:
        """(start, priority, rank, op, microbatch) of what rank r would run next; `idle` if nothing is ready."""
        best = idle
        i = next_input[r]
        if i < m and i < next_forward[r]:
            ready = forward_done[r][i] if r == p - 1 else input_done[r + 1][i]
            if ready is not None:
                best = (max(clock[r], ready), 0, r, Op.BACKWARD_INPUT, i)
        f = next_forward[r]
        if f < m and f - next_input[r] < p - r and f - weights_done[r] < 2 * p - r - 1:
            ready = 0 if r == 0 else forward_done[r - 1][f]
            if ready is not None:
                best = min(best, (max(clock[r], ready), 1, r, Op.FORWARD, f))
        if pending_weight[r]:
            best = min(best, (clock[r], 2, r, Op.BACKWARD_WEIGHT, pending_weight[r][0]))
        return best

    # A pass on rank r changes only what r and its neighbours can run next (r + 1 waits on r's forwards,
    # r - 1 on its input gradients), so only their candidates are recomputed; the earliest start wins, ties
    # go to the priority order above, then to the lower rank.
    candidates = [candidate(r) for r in range(p)]
    for _ in range(3 * m * p):
        start, _, r, op, mb = min(candidates)
        clock[r] = start + 1
        order[r].append((op, mb, r))
        if op == Op.FORWARD:
            forward_done[r][mb] = clock[r]
            next_forward[r] += 1
        elif op == Op.BACKWARD_INPUT:
            input_done[r][mb] = clock[r]
            next_input[r] += 1
            pending_weight[r].append(mb)
        else:
            pending_weight[r].pop(0)
            weights_done[r] += 1
        for q in (r - 1, r, r + 1):
            if 0 <= q < p:
                candidates[q] = candidate(q)
    return tuple(tuple(o) for o in order)


def compute_order(name: str, shape: PipelineShape, rank: int) -> list[tuple[Op, int, int]]:
    """(op, micro-batch, stage) of every compute pass rank `rank` runs, in order."""
    check_schedule(name, shape)
    if name == "gpipe":
        return _gpipe(shape, rank)
    if name == "1f1b":
        return _one_f_one_b(shape, rank)
    if name == "interleaved":
        return _interleaved(shape, rank)
    return list(_zero_bubble_h1(shape)[rank])


# ----------------------------------------------------------------------------- with communication
def schedule(name: str, shape: PipelineShape, rank: int) -> list[Instruction]:
    """Rank `rank`'s whole instruction stream for one optimizer step."""
    last = shape.stages - 1
    stream: list[Instruction] = []
    for op, mb, stage in compute_order(name, shape, rank):
        if op == Op.FORWARD:
            if stage > 0:
                stream.append(Instruction(Op.RECV_ACT, mb, stage, shape.rank_of(stage - 1)))
            stream.append(Instruction(op, mb, stage))
            if stage < last:
                stream.append(Instruction(Op.SEND_ACT, mb, stage, shape.rank_of(stage + 1)))
        elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            if stage < last:
                stream.append(Instruction(Op.RECV_GRAD, mb, stage, shape.rank_of(stage + 1)))
            stream.append(Instruction(op, mb, stage))
            if stage > 0:
                stream.append(Instruction(Op.SEND_GRAD, mb, stage, shape.rank_of(stage - 1)))
        else:
            stream.append(Instruction(op, mb, stage))
    return stream + [Instruction(Op.REDUCE_GRADS), Instruction(Op.OPTIMIZER_STEP)]


def all_schedules(name: str, shape: PipelineShape) -> dict[int, list[Instruction]]:
    return {rank: schedule(name, shape, rank) for rank in range(shape.ranks)}


def ideal_bubble(name: str, shape: PipelineShape) -> float:
    """Bubble time over ideal (bubble-free) time, Narayanan et al. 2021, for equal stage costs.

    gpipe, 1f1b: (p-1)/m; interleaved: (p-1)/(v m); zb-h1 with F = I = W: (p-1)/(3m).
    """
    p, m, v = shape.ranks, shape.microbatches, shape.virtual
    if name == "interleaved":
        return (p - 1) / (v * m)
    if name == "zb-h1":
        return (p - 1) / (3 * m)
    return (p - 1) / m


def peak_in_flight(name: str, shape: PipelineShape, rank: int) -> int:
    """(micro-batch, stage) pairs `rank` holds activations for at its peak, read off the compute orders above:
    gpipe m; 1f1b and zb-h1 min(m, p - rank); interleaved min(m v, 2 (p - rank - 1) + (v - 1) p + 1).
    Tests check it against the simulator's count."""
    p, m, v = shape.ranks, shape.microbatches, shape.virtual
    if name == "gpipe":
        return m
    if name == "interleaved":
        return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
    return min(m, p - rank)
