"""How data parallelism sums a gradient bucket: the backend's all-reduce or a hand-written one.

A reducer is what PyTorch DDP calls a communication hook: given a flat bucket, leave in it the
sum over the data-parallel ranks. `NativeReducer` calls the backend's all-reduce
(asynchronously, on the backend's own threads). `AlgorithmReducer` runs one of comm/'s
point-to-point algorithms; `auto` measures the links once (comm/measure.py) and takes, for each
bucket size, the algorithm the alpha-beta-gamma model predicts fastest. The compression codecs
(comm/compression.py) are reducers too.

Hand-written algorithms are synchronous point-to-point code, so data parallelism runs them on
one communication thread (`CommThread`), buckets in launch order: backward goes on computing
while the thread communicates, as the backend's threads do for its own collectives. The traffic
goes on the data-parallel process group, never shared with the main thread's collectives.

`wire_bytes(index, bucket)` is what the busiest rank sends for one bucket: for a hand-written
algorithm the cost model's own count for it (`cost.traffic`, which tests/distributed hold equal to
the bytes counted at the point-to-point layer), for the backend's all-reduce the bandwidth-optimal
2(p-1)/p n of a ring (its real algorithm is the backend's choice). Training logs the sum per step.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from fivefold.comm import ALL_REDUCE, all_reduce, default_node_size
from fivefold.comm.compression import build_codec
from fivefold.comm.cost import Cluster, all_reduce_bytes, best_all_reduce, traffic
from fivefold.comm.p2p import Ranks
from fivefold.errors import ConfigError

ALGORITHMS = ("native", *ALL_REDUCE, "auto")


class BucketLike(Protocol):
    buffer: torch.Tensor
    params: list
    offsets: list[int]


class Reducer(Protocol):
    """What DataParallel needs of a reducer (asynchronous ones also have `launch(bucket) -> Work`)."""

    asynchronous: bool

    def reduce(self, index: int, bucket: BucketLike) -> None: ...

    def wire_bytes(self, index: int, bucket: BucketLike) -> int: ...


class NativeReducer:
    """The backend's own all-reduce (gloo / NCCL), launched asynchronously."""

    asynchronous = True

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.p = group, dist.get_world_size(group)

    def launch(self, bucket: BucketLike) -> dist.Work:
        return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def reduce(self, index: int, bucket: BucketLike) -> None:
        dist.all_reduce(bucket.buffer, group=self.group)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def wire_bytes(self, index: int, bucket: BucketLike) -> int:
        return all_reduce_bytes(bucket.buffer.numel() * bucket.buffer.element_size(), self.p)

    def describe(self) -> str:
        return "native"


class AlgorithmReducer:
    """One of comm/'s hand-written all-reduce algorithms, or `auto`: the predicted fastest per bucket size."""

    asynchronous = False

    def __init__(self, group: dist.ProcessGroup, algorithm: str, node_size: int = 0, cluster: Cluster | None = None):
        if algorithm not in ALL_REDUCE and algorithm != "auto":
            raise ConfigError(f"gradient_comm.allreduce_algorithm = {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        self.ranks = Ranks.of_group(group)
        self.node_size = node_size or default_node_size(self.ranks)
        if self.ranks.size % self.node_size:
            raise ConfigError(f"gradient_comm.node_size = {node_size} does not divide the {self.ranks.size} data-parallel "
                              "ranks: use a divisor, or 0 for the launcher's ranks per node")
        self.algorithm = algorithm
        if algorithm == "auto" and cluster is None:
            from fivefold.comm.measure import measure_cluster

            cluster = measure_cluster(self.ranks, self.node_size)
        self.cluster = cluster
        self.choices: dict[int, str] = {}

    def choose(self, nbytes: int) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        return best_all_reduce(nbytes, self.ranks.size, self.cluster)

    def reduce(self, index: int, bucket: BucketLike) -> None:
        if index not in self.choices:
            self.choices[index] = self.choose(bucket.buffer.numel() * bucket.buffer.element_size())
        all_reduce(bucket.buffer, self.choices[index], self.ranks, self.node_size)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum any contiguous tensor the same way (the compression codecs' dense collectives)."""
        all_reduce(tensor, self.choose(tensor.numel() * tensor.element_size()), self.ranks, self.node_size)

    def wire_bytes(self, index: int, bucket: BucketLike) -> int:
        """The busiest rank's bytes for this bucket under the algorithm that reduced it (the cost model's count)."""
        buffer = bucket.buffer
        nbytes = buffer.numel() * buffer.element_size()
        algorithm = self.choices.get(index) or self.choose(nbytes)
        return int(traffic("all_reduce", algorithm, nbytes, self.ranks.size, self.node_size, buffer.element_size())[1])

    def describe(self) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        picked = sorted(set(self.choices.values()))
        return f"auto ({', '.join(picked) or 'chosen per bucket'})"


class CommThread:
    """One background thread running reductions in submission order (every rank submits the same order)."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fivefold-comm")

    def submit(self, fn: Callable[[], None]) -> "concurrent.futures.Future[None]":
        return self._pool.submit(fn)

    def close(self) -> None:
        """End the thread once its queue is done, without waiting here: after an error a reduction may be stuck on a
        peer that is gone until the collective timeout, and closing must not hang on it."""
        self._pool.shutdown(wait=False)


def build_reducer(group: dist.ProcessGroup, algorithm: str, compression: str = "none", node_size: int = 0,
                  **codec_options) -> NativeReducer | AlgorithmReducer:
    """The reducer for `gradient_comm.allreduce_algorithm` and `gradient_comm.compression`."""
    dense = NativeReducer(group) if algorithm == "native" else AlgorithmReducer(group, algorithm, node_size)
    if compression == "none":
        return dense
    return build_codec(compression, group, dense, **codec_options)
