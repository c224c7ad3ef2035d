"""Model-state memory (parameters, gradients, optimizer states) per the ZeRO paper's accounting.

Rajbhandari et al. 2020: mixed-precision Adam keeps 2 bytes of half-precision parameters,
2 of half-precision gradients and K = 12 of fp32 master parameters, momentum and variance
per parameter: 16 bytes per parameter. Plain fp32 Adam keeps 4 + 4 + 8 = 16 as well, but
split differently (the weights are their own master). ZeRO over N ranks divides by N:
    stage 1: optimizer states      mixed 2 + 2 + 12/N     fp32 4 + 4 + 8/N
    stage 2: + gradients           mixed 2 + 14/N         fp32 4 + 12/N
    stage 3: + parameters          mixed 16/N             fp32 16/N
(ZeRO paper, 7.5B parameters at N = 64: 120, 31.4, 16.6 and 1.9 GB.)
With independent degrees p | g | o (AMSP, MiCS; parallel/shard_layout.py) each term has its own:
    w Ψ/p + w Ψ/g + K Ψ/o          (the stages are (1, 1, N), (1, N, N), (N, N, N))

Mixture of experts: expert parallelism (EP) and expert tensor parallelism (ETP) split the routed
experts' Ψ_e over EP x ETP ranks, and ZeRO shards their states over the expert-data-parallel group
(EDP = distinct-token ranks / (EP x ETP)) while the dense Ψ - Ψ_e is sharded over the data-parallel
group as before:
    Ψ per rank = Ψ - Ψ_e + Ψ_e / (EP x ETP)      (tp = pp = 1)
    states     = zero(Ψ - Ψ_e, stage, N) + zero(Ψ_e / (EP x ETP), stage, EDP)

NVMe offload (ZeRO-Infinity, parallel/nvme_offload.py) moves the fp32 master and both moments of
each flat group's shard into a file, cut in pieces of at most S elements (n_p each), three
page-rounded regions per piece, and keeps a ring of three slots of the largest piece in host memory:
    file  = sum_p 3 x page(4 n_p)        host = 3 x 3 x page(4 max_p n_p)      page(x) = x rounded up to 4 KiB
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStateBytes:
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def adam_fp32(num_params: int) -> ModelStateBytes:
    """fp32 parameters (4), fp32 gradients (4), Adam momentum and variance (4 + 4)."""
    return ModelStateBytes(4 * num_params, 4 * num_params, 8 * num_params)


def adam_mixed_precision(num_params: int) -> ModelStateBytes:
    """bf16/fp16 parameters (2) and gradients (2); fp32 master, momentum, variance (K = 12)."""
    return ModelStateBytes(2 * num_params, 2 * num_params, 12 * num_params)


def zero_model_states(num_params: int, stage: int, shards: int, mixed_precision: bool,
                      separate_master: bool = False) -> ModelStateBytes:
    """Bytes one rank holds under ZeRO `stage` (0 = plain data parallelism) over `shards` ranks. fp32 weights
    are their own master unless `separate_master` (offload keeps an fp32 master on the host: 12 bytes, not 8)."""
    degree = {kind: shards if stage >= level else 1 for kind, level in (("optim", 1), ("grads", 2), ("params", 3))}
    return sharded_model_states(num_params, degree["params"], degree["grads"], degree["optim"], mixed_precision,
                                separate_master)


def sharded_model_states(num_params: int, params: int, grads: int, optim: int, mixed_precision: bool,
                         separate_master: bool = False) -> ModelStateBytes:
    """Bytes one rank holds with parameters, gradients and optimizer states sharded over `params`, `grads` and
    `optim` ranks (AMSP's unified space, parallel/shard_layout.py): w Ψ/p + w Ψ/g + K Ψ/o, w = 2 (bf16) or 4."""
    weight = 2 if mixed_precision else 4
    optimizer = 12 if mixed_precision or separate_master else 8
    return ModelStateBytes(weight * num_params // params, weight * num_params // grads, optimizer * num_params // optim)


PAGE = 4096
NVME_SLOTS = 3  # groups in flight: one being read, one stepped, one written


def page_rounded(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def swap_pieces(numel: int, piece_numel: int) -> list[tuple[int, int]]:
    """(start, numel) of the pieces NVMe offload cuts a shard of `numel` elements into."""
    return [(start, min(piece_numel, numel - start)) for start in range(0, numel, piece_numel)] or [(0, 0)]


def nvme_file_bytes(shard_numels: list[int], piece_numel: int) -> int:
    """NVMe offload: bytes of one rank's swap file, three fp32 regions per piece, each page-rounded."""
    return sum(3 * page_rounded(4 * n) for numel in shard_numels for _, n in swap_pieces(numel, piece_numel))


def nvme_host_bytes(shard_numels: list[int], piece_numel: int) -> int:
    """NVMe offload: host bytes of the slot ring, NVME_SLOTS slots of the largest piece's three regions."""
    return NVME_SLOTS * 3 * page_rounded(4 * min(max(shard_numels, default=0), piece_numel))


@dataclass(frozen=True)
class TrainingFloor:
    """A floor under the bytes one rank needs to train: fp32 model states, saved activations, logits."""

    model_states: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.logits


def training_floor(parameters: int, layers: int, block_elements: int, micro_batch: int, seq_len: int,
                   vocab: int, model_parallel: int = 1, loss_chunk: int = 0) -> TrainingFloor:
    """At least this much memory per rank: 16 bytes per parameter it holds (fp32 AdamW, before any ZeRO
    sharding beyond `model_parallel`), each of its `layers` blocks' saved activations in fp32, and the
    fp32 logits with their gradient (with the chunked head, `loss_chunk` tokens' worth, plus 4 bytes per
    token). Anything else (workspace, the allocator, ZeRO buffers) comes on top."""
    tokens = micro_batch * seq_len
    logits = 2 * 4 * tokens * vocab // model_parallel
    if loss_chunk:
        logits = 4 * tokens + 2 * 4 * min(loss_chunk, tokens) * vocab // model_parallel
    return TrainingFloor(16 * parameters // model_parallel, 4 * layers * block_elements, logits)


def moe_parameters_per_rank(total: int, routed_experts: int, ep: int, etp: int = 1) -> int:
    """Ψ one rank holds without tensor or pipeline parallelism: the dense part whole, 1 / (EP x ETP) of the experts."""
    return total - routed_experts + routed_experts // (ep * etp)


def moe_model_states(total: int, routed_experts: int, ep: int, etp: int, stage: int, dp_shards: int, edp: int,
                     mixed_precision: bool) -> ModelStateBytes:
    """Model-state bytes of one rank of a MoE model: dense states over the dp shards, expert states over EDP."""
    experts = routed_experts // (ep * etp)
    dense = zero_model_states(total - routed_experts, stage, dp_shards, mixed_precision)
    routed = zero_model_states(experts, stage, edp if stage else 1, mixed_precision)
    return ModelStateBytes(dense.parameters + routed.parameters, dense.gradients + routed.gradients,
                           dense.optimizer + routed.optimizer)
