"""The cost model's alpha and beta coefficients are what the runtime really sends.

Every send the hand-written collectives post is counted (torch.distributed's isend, through which
both `send` and `batch_isend_irecv` go) and the busiest rank's count of messages and bytes must
equal `cost.traffic`, the coefficients of alpha and beta in each algorithm's formula, at 4 ranks
and, for the algorithms that fold, at 6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed.spawn import run_distributed

N = 840  # elements: divisible by every p and node size used here


def _count(rank: int, world_size: int, cases) -> list[tuple[int, int]]:
    from fivefold.comm import all_reduce
    from fivefold.comm.alltoall import pairwise_all_to_all
    from fivefold.comm.p2p import Ranks
    from fivefold.comm.recursive import recursive_all_gather, recursive_reduce_scatter
    from fivefold.comm.ring import ring_all_gather, ring_reduce_scatter
    from fivefold.comm.tree import binomial_broadcast

    from fivefold.comm.bench import counting_sends

    sent: list[int] = []
    ranks = Ranks.world()
    run = {
        ("reduce_scatter", "ring"): ring_reduce_scatter, ("reduce_scatter", "recursive"): recursive_reduce_scatter,
        ("all_gather", "ring"): ring_all_gather, ("all_gather", "recursive"): recursive_all_gather,
        ("broadcast", "binomial"): binomial_broadcast,
    }
    counts = []
    for collective, algorithm, node_size in cases:
        x = torch.ones(N, dtype=torch.float32)
        dist.barrier()
        sent.clear()
        with counting_sends(sent):
            if collective == "all_reduce":
                all_reduce(x, algorithm, ranks, node_size)
            elif collective == "all_to_all":
                pairwise_all_to_all(torch.empty_like(x), x, ranks)
            else:
                run[(collective, algorithm)](x, ranks)
        counts.append((len(sent), sum(sent)))
    return counts


CASES = [("all_reduce", a, 0) for a in ("ring", "halving_doubling", "rabenseifner", "butterfly", "torus", "tree",
                                        "double_tree")] + [
    ("all_reduce", "hierarchical", 2),
    ("reduce_scatter", "ring", 0), ("all_gather", "ring", 0), ("reduce_scatter", "recursive", 0),
    ("all_gather", "recursive", 0), ("broadcast", "binomial", 0), ("all_to_all", "pairwise", 0),
]


@pytest.mark.parametrize("world_size", [4, 6])
def test_busiest_rank_sends_what_the_formulas_count(world_size):
    from fivefold.comm.cost import traffic

    cases = [c for c in CASES if world_size == 4 or not (c[0] in ("reduce_scatter", "all_gather") and c[1] == "recursive")]
    per_rank = run_distributed(_count, world_size, cases)
    for index, (collective, algorithm, node_size) in enumerate(cases):
        messages = max(counts[index][0] for counts in per_rank)
        sent = max(counts[index][1] for counts in per_rank)
        expected = traffic(collective, algorithm, N * 4, world_size, node_size)
        assert (messages, sent) == (expected[0], pytest.approx(expected[1])), (collective, algorithm, world_size)


def _reducer_bytes(rank: int, world_size: int, algorithms) -> list[tuple[int, int]]:
    """(bytes this rank sent, the reducer's wire_bytes) for one DDP bucket per algorithm."""
    from torch import nn

    from fivefold.comm.bench import counting_sends
    from fivefold.comm.reducers import AlgorithmReducer
    from fivefold.parallel.data_parallel import make_buckets

    sent: list[int] = []
    out = []
    for algorithm in algorithms:
        reducer = AlgorithmReducer(dist.group.WORLD, algorithm, node_size=2)
        bucket = make_buckets([nn.Parameter(torch.ones(N)), nn.Parameter(torch.ones(N // 2))], 25.0, None)[0]
        dist.barrier()
        sent.clear()
        with counting_sends(sent):
            reducer.reduce(0, bucket)
        out.append((sum(sent), reducer.wire_bytes(0, bucket)))
    return out


def test_ddp_wire_bytes_are_the_bytes_the_algorithm_sends():
    """The wire_bytes training logs per bucket equal the busiest rank's bytes counted at isend, per algorithm."""
    algorithms = ("ring", "halving_doubling", "rabenseifner", "tree", "double_tree", "butterfly", "hierarchical")
    per_rank = run_distributed(_reducer_bytes, 4, algorithms)
    for index, algorithm in enumerate(algorithms):
        busiest = max(counts[index][0] for counts in per_rank)
        reported = {counts[index][1] for counts in per_rank}
        assert reported == {busiest}, (algorithm, busiest, reported)


def _posted(rank: int, world_size: int, cases) -> list[list[tuple[str, int, int]]]:
    """Every ("send" | "recv", global peer, bytes) this rank posts, in order, per case, through a transport
    that counts and then hands each message to torch.distributed."""
    from fivefold.comm.p2p import TORCH_DISTRIBUTED, Ranks
    from fivefold.sim.trace import ALGORITHMS

    class Counting:
        def __init__(self):
            self.log: list[tuple[str, int, int]] = []

        def rank(self) -> int:
            return TORCH_DISTRIBUTED.rank()

        def post(self, ops, group):
            self.log += [(kind, peer, tensor.numel() * tensor.element_size()) for kind, tensor, peer in ops]
            return TORCH_DISTRIBUTED.post(ops, group)

    out = []
    for collective, algorithm, node_size in cases:
        transport = Counting()
        ranks = Ranks(tuple(range(world_size)), None, transport)
        x = torch.ones(N, dtype=torch.float32)
        dist.barrier()
        if algorithm == "hierarchical":
            ALGORITHMS[(collective, algorithm)](x, ranks, node_size)
        else:
            ALGORITHMS[(collective, algorithm)](x, ranks)
        out.append(transport.log)
    return out


@pytest.mark.parametrize("world_size", [4, 6])
def test_simulator_programs_are_the_messages_the_runtime_posts(world_size):
    """sim/trace.py runs the same algorithms on meta tensors: per rank, the same sends and receives,
    to the same peers, of the same sizes, in the same order as the real run over gloo."""
    from fivefold.sim.engine import Recv, Send
    from fivefold.sim.trace import collective_programs

    cases = [c for c in CASES if world_size == 4 or not (c[0] in ("reduce_scatter", "all_gather") and c[1] == "recursive")]
    per_rank = run_distributed(_posted, world_size, cases)
    for index, (collective, algorithm, node_size) in enumerate(cases):
        programs = collective_programs(collective, algorithm, range(world_size), N * 4, node_size=node_size)
        for rank in range(world_size):
            recorded = [("send" if isinstance(op, Send) else "recv", op.peer, op.nbytes) for op in programs[rank]
                        if isinstance(op, (Send, Recv))]
            assert recorded == per_rank[rank][index], (collective, algorithm, world_size, rank)
