"""Gradient compression codecs for data parallelism, used as bucket reducers (DDP communication hooks).

Each codec leaves in the bucket an approximation of the sum over the ranks and reports the bytes
one rank sends for it (`wire_bytes`). Error feedback (Seide et al. 2014; Karimireddy et al. 2019)
keeps, per bucket, what compression dropped and adds it to the next step's gradient, so nothing
is lost, only delayed.

    int8      block quantisation: each block of `block` values becomes int8 codes and one fp32
              scale (max |x| / 127). Sent as a compressed all-reduce (the two-phase scheme of
              DeepSpeed's 1-bit Adam and ZeRO++'s qgZ): all-to-all of the quantised chunks, the
              owner of each chunk dequantises and sums, requantises, all-gather. Bytes per rank:
              2 (p-1)/p (n + 4 n / block), a quarter of fp32's. No error feedback.
    sign      1-bit sign with a scale (mean |x|) per block and error feedback on both phases (the
              workers' and the chunk owners', as 1-bit Adam): 2 (p-1)/p (n/8 + 4 n / block).
    topk      top-k sparsification with error feedback (Aji & Heafield 2017; Lin et al. 2018):
              the k = ratio n largest |values| and their int32 indices, all-gathered, summed by
              index: (p-1) 8 k bytes.
    powersgd  rank-r PowerSGD (Vogels et al. 2019) with warm start and error feedback: each
              weight matrix M (rows x rest) becomes P = M Q (all-reduced, orthogonalised) and
              Q = M^T P (all-reduced); the sum is P Q^T. Vectors (norms) and matrices too small
              to gain are summed densely, with them in the first all-reduce:
              2 (p-1)/p 4 (sum of P, Q and dense sizes).

The all-to-all and all-gather are comm/'s own (pairwise exchange, ring) on the data-parallel
group; PowerSGD's dense all-reduces use the configured all-reduce algorithm. All codecs compute
in fp32 and sum contributions in rank order, so every rank ends with the same bits.
"""

from __future__ import annotations

import abc
import math

import torch
import torch.distributed as dist

from fivefold.comm.alltoall import pairwise_all_to_all
from fivefold.comm.p2p import Ranks
from fivefold.comm.cost import all_reduce_bytes
from fivefold.comm.ring import ring_all_gather
from fivefold.errors import ConfigError

CODECS = ("none", "int8", "sign", "topk", "powersgd")


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, fp32 scale per block) of a vector whose length is a multiple of block."""
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    codes = torch.round(blocks / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return codes.clamp_(-127, 127).to(torch.int8).view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    return (codes.view(-1, block).float() * scales[:, None]).view(-1)


def pack_signs(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs packed 8 per byte, mean |x| per block): x >= 0 is bit 1."""
    scales = x.view(-1, block).abs().mean(dim=1)
    bits = (x >= 0).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (bits * weights).sum(dim=1, dtype=torch.uint8), scales


def unpack_signs(packed: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (packed[:, None] >> shifts) & 1
    signs = bits.view(-1).float() * 2 - 1
    return (signs.view(-1, block) * scales[:, None]).view(-1)


class _Codec:
    """Shared state: the data-parallel ranks and per-bucket error-feedback memory."""

    asynchronous = False

    def __init__(self, group: dist.ProcessGroup):
        self.ranks = Ranks.of_group(group)
        self.p = self.ranks.size
        self.error: dict[object, torch.Tensor] = {}

    def state_bytes(self) -> int:
        """Bytes kept from step to step: the error-feedback memories (and PowerSGD's warm-start Q)."""
        kept = [*self.error.values(), *getattr(self, "q", {}).values()]
        return sum(t.numel() * t.element_size() for t in kept)

    def _feedback(self, key: object, x: torch.Tensor) -> torch.Tensor:
        """x plus what compression dropped from it last time."""
        if key in self.error:
            return x + self.error[key]
        return x.clone()


class _TwoPhaseCodec(_Codec, abc.ABC):
    """Compressed all-reduce: all-to-all of compressed chunks, sum at each chunk's owner, recompress, all-gather."""

    bits = 8  # bits per value on the wire
    feedback = False

    def __init__(self, group: dist.ProcessGroup, block: int = 256):
        super().__init__(group)
        if block < 8 or block % 8:
            raise ConfigError(f"gradient_comm.compression_block = {block}: must be a positive multiple of 8")
        self.block = block

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, fp32 scale per block) of a vector whose length is a multiple of the block."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The vector a payload stands for."""

    def _padded(self, numel: int) -> int:
        unit = self.p * self.block
        return -(-numel // unit) * unit

    def _compress(self, key: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.feedback:
            x = self._feedback(key, x)
        payload, scales = self.encode(x)
        if self.feedback:
            self.error[key] = x - self.decode(payload, scales)
        return payload, scales

    def reduce(self, index: int, bucket) -> None:
        buffer = bucket.buffer
        n, padded = buffer.numel(), self._padded(buffer.numel())
        x = torch.zeros(padded, dtype=torch.float32, device=buffer.device)
        x[:n] = buffer.float()
        payload, scales = self._compress(("worker", index), x)
        payload_in, scales_in = torch.empty_like(payload), torch.empty_like(scales)
        pairwise_all_to_all(payload_in, payload, self.ranks)
        pairwise_all_to_all(scales_in, scales, self.ranks)
        # this rank owns chunk `index` of every rank's vector: sum them in rank order
        pieces = zip(payload_in.view(self.p, -1), scales_in.view(self.p, -1))
        owned = torch.stack([self.decode(q, s) for q, s in pieces]).sum(dim=0)
        my_payload, my_scales = self._compress(("owner", index), owned)
        everything = torch.empty_like(payload).view(self.p, -1)
        every_scale = torch.empty_like(scales).view(self.p, -1)
        everything[self.ranks.index], every_scale[self.ranks.index] = my_payload, my_scales
        ring_all_gather(everything.view(-1), self.ranks)
        ring_all_gather(every_scale.view(-1), self.ranks)
        total = torch.cat([self.decode(q, s) for q, s in zip(everything, every_scale)])
        buffer.copy_(total[:n])

    def wire_bytes(self, index: int, bucket) -> int:
        padded = self._padded(bucket.buffer.numel())
        return all_reduce_bytes(padded * self.bits // 8 + 4 * padded // self.block, self.p)


class Int8Codec(_TwoPhaseCodec):
    bits = 8

    def encode(self, x):
        return quantize_int8(x, self.block)

    def decode(self, payload, scales):
        return dequantize_int8(payload, scales, self.block)


class SignCodec(_TwoPhaseCodec):
    bits = 1
    feedback = True

    def encode(self, x):
        return pack_signs(x, self.block)

    def decode(self, payload, scales):
        return unpack_signs(payload, scales, self.block)


class TopKCodec(_Codec):
    """The k largest magnitudes and their indices, all-gathered and summed by index; error feedback."""

    def __init__(self, group: dist.ProcessGroup, ratio: float = 0.01):
        super().__init__(group)
        if not 0 < ratio <= 1:
            raise ConfigError(f"gradient_comm.topk_ratio = {ratio}: must be in (0, 1]")
        self.ratio = ratio

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def reduce(self, index: int, bucket) -> None:
        buffer = bucket.buffer
        x = self._feedback(index, buffer.float())
        k = self.k(x.numel())
        chosen = torch.topk(x.abs(), k, sorted=False).indices
        values = x[chosen]
        residual = x.clone()
        residual[chosen] = 0
        self.error[index] = residual
        # values (as int32 bits) and indices travel in one message per rank
        gathered = torch.empty(self.p, 2 * k, dtype=torch.int32, device=buffer.device)
        gathered[self.ranks.index] = torch.cat([values.view(torch.int32), chosen.to(torch.int32)])
        ring_all_gather(gathered.view(-1), self.ranks)
        total = torch.zeros_like(x)
        for row in gathered:
            total.index_add_(0, row[k:].long(), row[:k].view(torch.float32))
        buffer.copy_(total)

    def wire_bytes(self, index: int, bucket) -> int:
        return (self.p - 1) * 8 * self.k(bucket.buffer.numel())


class PowerSGDCodec(_Codec):
    """Rank-r PowerSGD per weight matrix, warm-started Q, error feedback; the rest summed densely."""

    def __init__(self, group: dist.ProcessGroup, dense, rank: int = 4, seed: int = 0):
        super().__init__(group)
        if rank < 1:
            raise ConfigError(f"gradient_comm.powersgd_rank = {rank}: must be >= 1")
        self.dense, self.rank, self.seed = dense, rank, seed
        self.q: dict[tuple[int, int], torch.Tensor] = {}

    def _matrices(self, bucket) -> list[tuple[int, int, int]]:
        """(param index, rows, cols) of the bucket's parameters worth compressing."""
        out = []
        for i, param in enumerate(bucket.params):
            if param.dim() < 2:
                continue
            rows, cols = param.shape[0], param.numel() // param.shape[0]
            r = min(self.rank, rows, cols)
            if (rows + cols) * r < rows * cols:
                out.append((i, rows, cols))
        return out

    def _initial_q(self, index: int, i: int, cols: int, r: int, device) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 10_007 + i)  # the same on every rank
        return torch.randn(cols, r, generator=g).to(device)

    def reduce(self, index: int, bucket) -> None:
        buffer = bucket.buffer
        x = buffer.float()
        matrices = self._matrices(bucket)
        compressed = {i for i, _, _ in matrices}
        views, ps = {}, []
        for i, rows, cols in matrices:
            lo = bucket.offsets[i]
            m = self._feedback((index, i), x[lo:lo + rows * cols].view(rows, cols))
            r = min(self.rank, rows, cols)
            q = self.q.get((index, i))
            if q is None:
                q = self._initial_q(index, i, cols, r, x.device)
            views[i] = (m, q)
            ps.append((m @ q).view(-1))
        dense_parts = [x[bucket.offsets[i]:bucket.offsets[i] + p.numel()] for i, p in enumerate(bucket.params)
                       if i not in compressed]
        first = torch.cat(ps + dense_parts) if ps or dense_parts else x[:0]
        self.dense.all_reduce(first)
        at = 0
        p_hats = {}
        for i, rows, cols in matrices:
            r = views[i][1].shape[1]
            p_hats[i] = torch.linalg.qr(first[at:at + rows * r].view(rows, r)).Q
            at += rows * r
        out = torch.zeros_like(x)
        for i, param in enumerate(bucket.params):
            if i in compressed:
                continue
            lo = bucket.offsets[i]
            out[lo:lo + param.numel()] = first[at:at + param.numel()]
            at += param.numel()
        local_qs = {i: views[i][0].t() @ p_hats[i] for i, _, _ in matrices}
        second = torch.cat([local_qs[i].reshape(-1) for i, _, _ in matrices]) if matrices else x[:0]
        self.dense.all_reduce(second)
        at = 0
        for i, rows, cols in matrices:
            m, _ = views[i]
            r = local_qs[i].shape[1]
            q_sum = second[at:at + cols * r].view(cols, r)
            at += cols * r
            self.error[(index, i)] = m - p_hats[i] @ local_qs[i].t()
            self.q[(index, i)] = q_sum.clone()  # warm start: next step's power iteration begins here
            lo = bucket.offsets[i]
            out[lo:lo + rows * cols] = (p_hats[i] @ q_sum.t()).view(-1)
        buffer.copy_(out)

    def wire_bytes(self, index: int, bucket) -> int:
        matrices = self._matrices(bucket)
        compressed = {i for i, _, _ in matrices}
        elements = sum(min(self.rank, rows, cols) * (rows + cols) for _, rows, cols in matrices)
        elements += sum(p.numel() for i, p in enumerate(bucket.params) if i not in compressed)
        return all_reduce_bytes(4 * elements, self.p)


def build_codec(name: str, group: dist.ProcessGroup, dense, block: int = 256, topk_ratio: float = 0.01,
                powersgd_rank: int = 4, seed: int = 0):
    if name == "int8":
        return Int8Codec(group, block)
    if name == "sign":
        return SignCodec(group, block)
    if name == "topk":
        return TopKCodec(group, topk_ratio)
    if name == "powersgd":
        return PowerSGDCodec(group, dense, powersgd_rank, seed)
    raise ConfigError(f"gradient_comm.compression = {name!r} is not one of {', '.join(CODECS)}")
