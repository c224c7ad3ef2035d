"""Split the model by depth into pipeline stages, and cut a rank's stages out of the model.

The p x v stages take contiguous runs of transformer blocks; stage 0 also holds the token
embedding, the last stage the final norm and the output head. The split minimises the most
expensive stage (the pipeline runs at the pace of its slowest stage), with the cost of a
block, of the embedding and of the head measured by either

    flops:   training FLOPs per token (plan/flops.py): a block 6 x its matmul parameters plus
             attention's 12 H Q T; the head 6 V h; the embedding lookup 0 (it is a gather).
    params:  parameters held: a block's, V h for the embedding and for an untied head
             (balances memory rather than time).

`pipeline_parallel.layers_per_stage` overrides the split. Every block lands on exactly one stage;
a split that cannot place the blocks (too few blocks, counts that do not add up) is an error
naming the settings, never a silently dropped layer.

A rank keeps the union of its stages' blocks in one `Transformer` (the other blocks deleted
before any memory is allocated; parameter names unchanged, so checkpoints and data-parallel
groups work as without pipelining) and runs each stage with `PipelineStage.forward`. With tied
embeddings the last stage keeps its own copy of the embedding matrix as the head; the two
copies start equal and their gradients are summed (Megatron-LM's embedding group), so they stay
equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.model.llama import Transformer
from fivefold.plan.flops import count_parameters

BALANCE_BY = ("flops", "params")


@dataclass(frozen=True)
class StageCosts:
    """Cost of the embedding, of each block, and of the head (final norm + output projection)."""

    embedding: float
    blocks: tuple[float, ...]
    head: float


def stage_costs(config: ModelConfig, seq_len: int, balance: str = "flops") -> StageCosts:
    if balance not in BALANCE_BY:
        raise ConfigError(f"pipeline_parallel.balance = {balance!r} is not one of {', '.join(BALANCE_BY)}")
    count = count_parameters(config)
    layers = config.n_layers
    block_params = (count.attention + count.mlp) / layers + 2 * config.dim
    vocab_matrix = config.vocab_size * config.dim
    if balance == "params":
        head = config.dim + (0 if config.tie_embeddings else vocab_matrix)
        return StageCosts(vocab_matrix, (block_params,) * layers, head)
    attention = 12 * config.n_heads * config.head_size * seq_len
    block = 6 * (count.attention + count.mlp) / layers + attention
    return StageCosts(0.0, (block,) * layers, 6 * vocab_matrix)


def split_layers(costs: StageCosts, stages: int) -> list[list[int]]:
    """Contiguous runs of blocks, one per stage, minimising the largest stage cost.

    Exact, by dynamic programming over (stages used, blocks placed); every stage gets at least
    one block. Among splits with the same largest cost, the one with the smallest sum of squared
    stage costs is preferred (evener stages).
    """
    n = len(costs.blocks)
    if stages > n:
        raise ConfigError(
            f"{stages} pipeline stages (pipeline_parallel.degree x pipeline_parallel.virtual) but model.n_layers = {n}: every stage "
            "needs at least one block; lower pipeline_parallel.degree or pipeline_parallel.virtual, or give the model more layers"
        )
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (costs.embedding if stage == 0 else 0.0) + (costs.head if stage == stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = (float("inf"), float("inf"))
    # best[s][j]: (max cost, sum of squares) of placing blocks [0, j) on stages [0, s); cut[s][j] the last start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                c = cost(s - 1, i, j)
                candidate = (max(best[s - 1][i][0], c), best[s - 1][i][1] + c * c)
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    bounds, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    return [list(range(lo, hi)) for lo, hi in reversed(bounds)]


def explicit_split(layers_per_stage: list[int], n_layers: int, stages: int) -> list[list[int]]:
    """The split `pipeline_parallel.layers_per_stage` asks for, checked."""
    if len(layers_per_stage) != stages:
        raise ConfigError(
            f"pipeline_parallel.layers_per_stage has {len(layers_per_stage)} entries but there are {stages} stages "
            "(pipeline_parallel.degree x pipeline_parallel.virtual): give one block count per stage"
        )
    if sum(layers_per_stage) != n_layers or any(c < 0 for c in layers_per_stage):
        raise ConfigError(
            f"pipeline_parallel.layers_per_stage = {layers_per_stage} places {sum(layers_per_stage)} blocks but "
            f"model.n_layers = {n_layers}: the counts must be >= 0 and add up to the number of layers"
        )
    middle_empty = [s for s, c in enumerate(layers_per_stage) if c == 0 and 0 < s < stages - 1]
    if middle_empty:
        raise ConfigError(
            f"pipeline_parallel.layers_per_stage leaves stage(s) {middle_empty} with no block: only the first stage "
            "(embedding) and the last (head) may hold none"
        )
    out, start = [], 0
    for count in layers_per_stage:
        out.append(list(range(start, start + count)))
        start += count
    return out


def plan_stages(config: ModelConfig, seq_len: int, stages: int, layers_per_stage: list[int] | None = None,
                balance: str = "flops") -> list[list[int]]:
    """Block indices of every stage: the explicit split if given, else the cost-balanced one."""
    if layers_per_stage:
        return explicit_split(list(layers_per_stage), config.n_layers, stages)
    return split_layers(stage_costs(config, seq_len, balance), stages)


def check_pipeline(config: ModelConfig, pipeline_parallel, seq_len: int, microbatches: int) -> list[list[int]]:
    """Validate the pipeline settings of a run before any work; return the stage split."""
    from fivefold.parallel.pipeline.schedules import PipelineShape, check_schedule

    shape = PipelineShape(pipeline_parallel.degree, microbatches, pipeline_parallel.virtual)
    try:
        check_schedule(pipeline_parallel.schedule, shape)
    except ConfigError as exc:
        raise ConfigError(f"pipeline_parallel.schedule = {pipeline_parallel.schedule}: {exc} "
                          "(the micro-batch count is train.grad_accum_steps)") from exc
    return plan_stages(config, seq_len, shape.stages, pipeline_parallel.layers_per_stage, pipeline_parallel.balance)


@dataclass(frozen=True)
class PipelineStage:
    """One stage: which blocks it runs and whether it embeds tokens or produces logits."""

    index: int
    layers: tuple[int, ...]
    is_first: bool
    is_last: bool

    def forward(self, model: Transformer, x: torch.Tensor, positions: torch.Tensor, project: bool = True) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states, or logits (last stage; with
        project=False its normalised hidden states, for a loss that applies the head itself).

        `positions` are the tokens' (global) positions: hidden states may hold only part of the
        sequence (sequence parallelism), so they cannot be read off x.
        """
        cos, sin = model.rope(positions)
        h = model.tok_embeddings(x) if self.is_first else x
        for layer in self.layers:
            h = model.layers[str(layer)](h, cos, sin)
        if not self.is_last:
            return h
        return model.head(h) if project else model.norm(h)


def stages_of_rank(split: list[list[int]], pp: int, rank: int) -> list[PipelineStage]:
    """The stages pipeline rank `rank` holds (stage s on rank s % pp), in stage order."""
    last = len(split) - 1
    return [PipelineStage(s, tuple(split[s]), s == 0, s == last) for s in range(rank, len(split), pp)]


def cut_model(model: Transformer, stages: list[PipelineStage]) -> None:
    """Delete what these stages do not run (on a meta model, before any memory is allocated)."""
    keep = {layer for stage in stages for layer in stage.layers}
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    if not first and not (last and model.output is None):  # a tied head keeps the embedding matrix
        model.tok_embeddings = None
    if not last:
        model.norm, model.output = None, None


def holds_tied_copy(model: Transformer, stages: list[PipelineStage]) -> bool:
    """True on the last stage's rank when it holds the tied embedding only as the head (not the first stage too)."""
    return model.output is None and model.tok_embeddings is not None and not any(s.is_first for s in stages)


def tied_embedding_rows(pp_rank_table: torch.Tensor, last_rank: int) -> list[list[int]]:
    """For every pipeline group, its first and last pipeline ranks, which both hold the tied embedding.

    `pp_rank_table` has one row per pipeline group (Mesh.rank_table("pp")); the mesh creates a group
    per row (Megatron-LM's embedding group).
    """
    return [[row[0], row[last_rank]] for row in pp_rank_table.tolist()]
