"""NVMe offload of ZeRO's optimizer states (ZeRO-Infinity, Rajbhandari et al. 2021).

With `data_parallel.nvme_path`, each rank keeps its fp32 master shards and both AdamW moments in
one file under that directory (local NVMe), not in host memory. Each ZeRO flat group's shard is cut
into pieces of at most `data_parallel.nvme_sub_group` elements (DeepSpeed's sub-groups), and host
memory holds only a ring of three page-aligned slots, each one piece's (master, exp_avg, exp_avg_sq).
The step walks the pieces in order as a three-stage pipeline:

    piece i+1   read from the file into slot (i+1) % 3      (I/O threads)
    piece i     AdamW on slot i % 3, updated weights copied to the compute shard
    piece i-1   written back from slot (i-1) % 3            (I/O threads)

so the reads and writes of neighbouring pieces run while a piece is stepped. Each transfer is cut
into chunks spread over a small thread pool (`os.preadv` / `os.pwritev` release the GIL), which
gives the drive several requests in flight. The file is opened with O_DIRECT where the file system
allows it (page-aligned buffers, offsets and sizes), so the states do not fill the page cache.

Every chunk's xxh3-64 hash (the checkpoint manifest's hash family) is taken when it is written and checked when it is read back: a swap file
changed behind our back stops the run with a clear error instead of training on garbage. The
space is reserved (posix_fallocate) before the first step, so a full disk fails at start-up.

The update is torch's own AdamW (foreach), run piece by piece on the slot tensors with the state
and step count that piece had; AdamW is elementwise, so the result is bitwise the in-memory
offload's (tests/parity).
Bytes per parameter moved per step: 12 read + 12 written (master, two moments, fp32).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import mmap
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash
from torch import nn

from fivefold.errors import ConfigError, FivefoldError
from fivefold.parallel.gradient_sync import step_tensor
from fivefold.plan.memory import NVME_SLOTS, PAGE, page_rounded, swap_pieces

STATES = ("master", "exp_avg", "exp_avg_sq")  # the order of one group's regions in the file and in a slot
CHUNK_BYTES = 8 << 20  # one I/O request
SLOTS = NVME_SLOTS
IO_THREADS = 4  # requests in flight per rank


def check_nvme_path(directory: str) -> None:
    """Refuse an nvme_path that is not a writable directory (the launcher checks it before any rank starts)."""
    if not directory or not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"data_parallel.nvme_path = {directory!r} is not a writable directory: create it on a local "
                          "drive (NVMe) with room for the optimizer states, or unset it to keep them in host memory")


class OffloadCorruptError(FivefoldError):
    """A swapped-out optimizer state did not read back as written."""


@dataclass
class Piece:
    """Up to `piece_numel` elements of one flat group's shard: the unit swapped and stepped at once."""

    group: int  # index into the optimizer's (zero, flat group) pairs
    start: int  # first element within the group's shard
    numel: int
    offset: int  # of the piece's three regions in the file
    decay: bool
    step: torch.Tensor  # AdamW's step count, kept in memory (one scalar)
    checksums: list[int]

    @property
    def region(self) -> int:
        return page_rounded(self.numel * 4)

    @property
    def nbytes(self) -> int:
        return len(STATES) * self.region


class _Slot:
    """A page-aligned host buffer (anonymous mmap) holding one piece's three states."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, max(nbytes, PAGE))
        self.view = memoryview(self.map)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.write: list[Future] = []

    def states(self, piece: Piece) -> list[torch.Tensor]:
        return [self.tensor[k * piece.region : k * piece.region + piece.numel * 4].view(torch.float32)
                for k in range(len(STATES))]


class NvmeOptimizer:
    """AdamW whose fp32 masters and moments live in a file; steps ZeRO's flat groups, piece by piece, as a
    read / step / write pipeline.

    `pairs` are (ZeroDataParallel, FlatGroup); each group gives its gradient shard (`grad_shard`) and takes
    the updated weights into its compute shard (`zero.compute_shard(g)`). A group's shard is cut into
    pieces of at most `piece_numel` elements, so host memory stays bounded however large a group is (the
    embedding's). `param_groups` is AdamW's, so the learning-rate schedule sets it as for any optimizer.
    """

    def __init__(self, pairs: list, directory: str, optimizer_factory, rank: int, piece_numel: int = 1 << 24,
                 threads: int = IO_THREADS):
        self.pairs, self.piece_numel = pairs, piece_numel
        check_nvme_path(directory)
        self.directory = tempfile.mkdtemp(prefix=f"fivefold-optimizer-rank{rank}-", dir=directory)
        self.path = os.path.join(self.directory, "states.bin")
        offset, self.pieces, self.pieces_of = 0, [], []
        for index, (_, g) in enumerate(pairs):
            self.pieces_of.append([])
            for start, numel in swap_pieces(g.shard_numel, piece_numel):
                self.pieces_of[-1].append(len(self.pieces))
                self.pieces.append(Piece(index, start, numel, offset, g.decay, step_tensor(0.0), []))
                offset += self.pieces[-1].nbytes
        self.file_bytes = offset
        self.fd, self.direct = self._open()
        self._finalizer = weakref.finalize(self, _close, self.fd, self.directory)
        atexit.register(self._finalizer)
        self._reserve(directory)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fivefold-nvme")
        largest = max((piece.nbytes for piece in self.pieces), default=PAGE)
        self.slots = [_Slot(largest) for _ in range(SLOTS)]
        # torch's AdamW, one per decay class, over one placeholder parameter that takes each piece's slot in turn
        self.placeholders = {decay: nn.Parameter(torch.empty(0)) for decay in (True, False)}
        self.adamw = optimizer_factory([self.placeholders[True]], [self.placeholders[False]])
        self.param_groups = self.adamw.param_groups
        self.bytes_read = self.bytes_written = 0
        for index, (zero, g) in enumerate(pairs):  # the initial masters (the weights) and zero moments
            master = zero.compute_shard(g).detach().to("cpu", torch.float32)
            self._store(index, {"master": master, "exp_avg": torch.zeros_like(master),
                                "exp_avg_sq": torch.zeros_like(master)}, 0.0)

    # ------------------------------------------------------------------ file
    def _open(self) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                fd = os.open(self.path, flags | direct, 0o600)
            except OSError as error:  # tmpfs and some others refuse O_DIRECT
                if error.errno != errno.EINVAL:
                    raise
            else:
                try:
                    os.pwrite(fd, mmap.mmap(-1, PAGE), 0)  # some accept the flag but refuse the I/O
                    return fd, True
                except OSError as error:
                    os.close(fd)
                    if error.errno != errno.EINVAL:
                        raise
        return os.open(self.path, flags, 0o600), False

    def _reserve(self, directory: str) -> None:
        try:
            os.posix_fallocate(self.fd, 0, max(self.file_bytes, PAGE))
        except OSError as error:
            self.close()
            free = shutil.disk_usage(directory).free
            raise ConfigError(f"data_parallel.nvme_path = {directory!r}: cannot reserve {self.file_bytes / 2**30:.2f} GiB "
                              f"for this rank's optimizer states ({free / 2**30:.2f} GiB free; {error.strerror}): free "
                              "space there, point nvme_path at a larger drive, or use more data-parallel shards") from None

    def _chunks(self, piece: Piece):
        for start in range(0, piece.nbytes, CHUNK_BYTES):
            yield start, min(CHUNK_BYTES, piece.nbytes - start)

    def _read(self, index: int, slot: _Slot) -> list[Future]:
        piece = self.pieces[index]
        self.bytes_read += piece.nbytes
        return [self.pool.submit(self._read_chunk, piece, slot, k, start, size)
                for k, (start, size) in enumerate(self._chunks(piece))]

    def _read_chunk(self, piece: Piece, slot: _Slot, k: int, start: int, size: int) -> None:
        view = slot.view[start : start + size]
        got = os.preadv(self.fd, [view], piece.offset + start)
        if got != size or xxhash.xxh3_64_intdigest(view) != piece.checksums[k]:
            raise OffloadCorruptError(
                f"the optimizer states swapped to {self.path} (bytes {piece.offset + start}-{piece.offset + start + size}) "
                f"did not read back as written ({'short read' if got != size else 'checksum mismatch'}): the file was "
                "changed or the drive failed. This run cannot continue; resume from the last checkpoint.")

    def _write(self, index: int, slot: _Slot) -> list[Future]:
        piece = self.pieces[index]
        chunks = list(self._chunks(piece))
        if len(piece.checksums) != len(chunks):
            piece.checksums = [0] * len(chunks)
        self.bytes_written += piece.nbytes
        return [self.pool.submit(self._write_chunk, piece, slot, k, start, size) for k, (start, size) in enumerate(chunks)]

    def _write_chunk(self, piece: Piece, slot: _Slot, k: int, start: int, size: int) -> None:
        view = slot.view[start : start + size]
        piece.checksums[k] = xxhash.xxh3_64_intdigest(view)
        written = os.pwritev(self.fd, [view], piece.offset + start)
        if written != size:
            raise OSError(errno.EIO, f"short write to {self.path}: {written} of {size} bytes")

    @staticmethod
    def _wait(futures: list[Future]) -> None:
        for future in futures:
            future.result()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """AdamW over every piece: read piece i+1 and write piece i-1 while piece i steps."""
        n = len(self.pieces)
        reads = {0: self._read(0, self.slots[0])} if n else {}
        for i, piece in enumerate(self.pieces):
            if i + 1 < n:
                ahead = self.slots[(i + 1) % SLOTS]
                self._wait(ahead.write)  # that slot's last piece (i - 2) is on disk before it is refilled
                reads[i + 1] = self._read(i + 1, ahead)
            slot = self.slots[i % SLOTS]
            self._wait(reads.pop(i))
            zero, flat = self.pairs[piece.group]
            master, exp_avg, exp_avg_sq = slot.states(piece)
            placeholder = self.placeholders[piece.decay]
            placeholder.data = master
            placeholder.grad = flat.grad_shard[piece.start : piece.start + piece.numel].to("cpu", torch.float32)
            self.adamw.state[placeholder] = {"step": piece.step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
            self.adamw.step()
            placeholder.grad = None
            zero.compute_shard(flat)[piece.start : piece.start + piece.numel].copy_(master)
            slot.write = self._write(i, slot)
        for slot in self.slots:
            self._wait(slot.write)
            slot.write = []
        for placeholder in self.placeholders.values():
            placeholder.data = torch.empty(0)
        self.adamw.state.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are taken from the ZeRO shards during the step; nothing is kept."""

    # ------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def load(self, group: int) -> tuple[dict[str, torch.Tensor], float]:
        """Group `group`'s whole shard of states read back from the file (checksums verified), and its step count."""
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in STATES}
        slot = self.slots[0]
        for index in self.pieces_of[group]:
            self._wait(self._read(index, slot))
            for name, t in zip(STATES, slot.states(self.pieces[index])):
                parts[name].append(t.clone())
        return {name: torch.cat(ts) for name, ts in parts.items()}, float(self.pieces[self.pieces_of[group][0]].step)

    @torch.no_grad()
    def _store(self, group: int, values: dict[str, torch.Tensor], step: float) -> None:
        slot = self.slots[0]
        for index in self.pieces_of[group]:
            piece = self.pieces[index]
            for name, t in zip(STATES, slot.states(piece)):
                t.copy_(values[name][piece.start : piece.start + piece.numel])
            self._wait(self._write(index, slot))
            piece.step = step_tensor(step)

    def store(self, group: int, values: dict[str, torch.Tensor], step: float) -> None:
        """Replace group `group`'s states (a checkpoint load) and set its compute shard to the master."""
        self._store(group, values, step)
        zero, g = self.pairs[group]
        zero.compute_shard(g).copy_(values["master"])

    def host_tensors(self) -> list[torch.Tensor]:
        """What the optimizer holds in host memory: the slot ring."""
        return [slot.tensor for slot in self.slots]

    def close(self) -> None:
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=True)
        self._finalizer()


def _close(fd: int, directory: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)
