"""Expert-parallel dispatch under adversarial routing: never hangs, never crashes, computes the right thing.

4 ranks, 4 experts, one per rank. Every rank regenerates every rank's tokens, runs the whole layer on
all of them in one process (the reference), and checks its own rows' outputs, its tokens' input
gradients and its expert's weight gradient (summed over every rank's tokens) against it, for both
all-to-all backends and routings where one expert gets every token, a rank has no tokens at all, an
expert gets none, and one rank sends everything to a single peer. The rows a rank receives stay
within the documented bound ep x T x min(k, E/ep), and the bytes each rank sent equal the cost model's
matrix of bytes per rank pair (comm/cost.py's dispatch_bytes) built from the routing counts.
The same scenarios run with expert tensor parallelism (EP 2 x ETP 2: two experts per EP position, each
split in halves over two ranks), checked against the same one-process reference.
"""

from __future__ import annotations

import pytest

from distributed.spawn import run_distributed

SCENARIOS = ("all-to-expert-0", "rank-without-tokens", "expert-without-tokens", "uniform", "all-to-expert-0-replicated")
# EPLB's answer to all-to-expert-0: expert 0 replicated on every rank (2 slots per rank)
REPLICATED = [[0, 1], [0, 2], [0, 3], [0, 1]]
TOKENS, DIM, K = 6, 16, 2


def _routing(scenario: str, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    tokens = 0 if scenario == "rank-without-tokens" and rank == 3 else TOKENS
    x = torch.randn(tokens, DIM, generator=g)
    if scenario.startswith("all-to-expert-0"):
        experts = torch.stack([torch.zeros(tokens, dtype=torch.long), torch.randint(1, 4, (tokens,), generator=g)], 1)
    elif scenario == "expert-without-tokens":
        experts = torch.stack([torch.zeros(tokens, dtype=torch.long), torch.ones(tokens, dtype=torch.long) * 3], 1)
    else:
        experts = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, K, dtype=torch.long)
    weights = torch.rand(tokens, K, generator=g)
    return x, experts, weights


def _whole_layer():
    """The MoE layer every rank builds identically: the reference, and the source of each rank's experts."""
    import torch

    from fivefold.model.config import ModelConfig
    from fivefold.model.moe import MoE

    config = ModelConfig(dim=DIM, n_layers=1, n_heads=2, vocab_size=8, n_experts=4, moe_top_k=K, moe_ffn_dim=8)
    torch.manual_seed(0)
    full = MoE(config, 0)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return full


def _compare_with_reference(local, full, scenario: str, rank: int, world_size: int) -> list:
    """Run this rank's tokens through the distributed layer and every rank's through the whole one; check this
    rank's outputs and input gradients. Leaves the gradients in both layers' experts; returns every rank's routing."""
    import torch

    from fivefold.model.moe import Routing

    everyone = [_routing(scenario, r) for r in range(world_size)]
    upstream = torch.Generator().manual_seed(7)
    grads_out = [torch.randn(x.shape, generator=upstream) for x, _, _ in everyone]
    x, experts, weights = everyone[rank]
    x = x.clone().requires_grad_()
    out = local.dispatch(x, Routing(experts, weights, None), local)
    (out * grads_out[rank]).sum().backward()

    ref_x = torch.cat([e[0] for e in everyone]).requires_grad_()
    ref_routing = Routing(torch.cat([e[1] for e in everyone]), torch.cat([e[2] for e in everyone]), None)
    ref = full.dispatch(ref_x, ref_routing, full)
    (ref * torch.cat(grads_out)).sum().backward()
    start = sum(e[0].shape[0] for e in everyone[:rank])
    mine = slice(start, start + x.shape[0])
    torch.testing.assert_close(out, ref[mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_x.grad[mine], rtol=1e-5, atol=1e-5)
    return everyone


def _check(rank: int, world_size: int, scenario: str, backend: str) -> int:
    import copy

    import torch
    import torch.distributed as dist

    from fivefold.parallel.expert_parallel import AllToAllMeter, ExpertParallelDispatch

    full = _whole_layer()
    replicated = scenario.endswith("replicated")
    placement = REPLICATED if replicated else [[r] for r in range(world_size)]
    local = copy.deepcopy(full)
    for key in [k for k in local.experts if int(k) not in placement[rank]]:
        del local.experts[key]
    group = dist.new_group(list(range(world_size)))
    local.dispatch = ExpertParallelDispatch(group, rank, placement, 4, backend, AllToAllMeter())

    everyone = _compare_with_reference(local, full, scenario, rank, world_size)
    for e in placement[rank]:
        for mine, theirs in zip(local.experts[str(e)].parameters(), full.experts[str(e)].parameters()):
            grad = mine.grad.clone()
            if replicated:  # each replica holds its share: summed over the holders it is the whole gradient
                holders = [r for r in range(world_size) if e in placement[r]]
                parts = [torch.zeros_like(grad) for _ in range(world_size)]
                dist.all_gather(parts, grad)
                grad = sum(parts[r] for r in holders)
            torch.testing.assert_close(grad, theirs.grad, rtol=1e-5, atol=1e-5)
    if replicated:  # no rank gets more than a quarter of expert 0's rows, plus its other slot's
        return local.stats.max_received
    # the cost model's bytes per rank pair, from the routing counts, equal what the runtime sent:
    # dispatch (matrix row) and combine (column) in forward, the same again in backward
    from fivefold.comm.cost import dispatch_bytes

    counts = [torch.bincount(e[1].reshape(-1), minlength=4).tolist() for e in everyone]
    matrix = dispatch_bytes(counts, 1, DIM * 4)
    expected = 2 * sum(matrix[rank][j] + matrix[j][rank] for j in range(world_size) if j != rank)
    assert local.dispatch.meter.bytes_sent == expected, (local.dispatch.meter.bytes_sent, expected)
    bound = 4 * TOKENS * min(K, 1)
    assert local.stats.max_received <= bound, (local.stats.max_received, bound)
    return local.stats.max_received


@pytest.mark.parametrize("backend", ["torch", "pairwise"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dispatch_survives_adversarial_routing(scenario, backend):
    received = run_distributed(_check, 4, scenario, backend, timeout=120)
    if scenario == "all-to-expert-0":
        assert received[0] == 4 * TOKENS  # every token of every rank came to rank 0, the bound's worst case
    if scenario == "expert-without-tokens":
        assert received[1] == received[2] == 0
    if scenario == "all-to-expert-0-replicated":  # the 24 rows of expert 0 spread over 4 replicas
        assert max(received) < 4 * TOKENS


def _check_etp(rank: int, world_size: int, scenario: str, backend: str) -> int:
    """EP 2 x ETP 2 over 4 ranks: ETP groups {0, 1}, {2, 3}; EP groups {0, 2}, {1, 3}."""
    import copy

    import torch
    import torch.distributed as dist

    from fivefold.parallel.expert_parallel import AllToAllMeter, ExpertParallelDispatch, expert_rows, shard_experts

    full = _whole_layer()
    rows = expert_rows([list(range(world_size))], 2, 2)
    assert rows == {"etp": [[0, 1], [2, 3]], "ep": [[0, 2], [1, 3]], "edp": [[0], [1], [2], [3]]}
    groups = {}
    for kind in ("etp", "ep"):
        for row in rows[kind]:
            created = dist.new_group(row)
            if rank in row:
                groups[kind] = (created, row.index(rank))
    ep_rank, etp_rank = groups["ep"][1], groups["etp"][1]
    placement = [[0, 1], [2, 3]]
    local = copy.deepcopy(full)
    for key in [k for k in local.experts if int(k) not in placement[ep_rank]]:
        del local.experts[key]
    shard_experts(local, 2, etp_rank)
    local.dispatch = ExpertParallelDispatch(groups["ep"][0], ep_rank, placement, 4, backend, AllToAllMeter(),
                                            groups["etp"][0])

    _compare_with_reference(local, full, scenario, rank, world_size)
    half = slice(etp_rank * 4, etp_rank * 4 + 4)  # this rank's 4 of the 8 hidden units
    for e in placement[ep_rank]:
        piece, whole = local.experts[str(e)], full.experts[str(e)]
        assert piece.w1.weight.shape == (4, DIM) and piece.w2.weight.shape == (DIM, 4)
        torch.testing.assert_close(piece.w1.weight.grad, whole.w1.weight.grad[half], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(piece.w3.weight.grad, whole.w3.weight.grad[half], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(piece.w2.weight.grad, whole.w2.weight.grad[:, half], rtol=1e-5, atol=1e-5)
    bound = 2 * 2 * TOKENS * min(K, 2)  # ep x etp x T x min(k, E/ep)
    assert local.stats.max_received <= bound, (local.stats.max_received, bound)
    return local.stats.max_received


@pytest.mark.parametrize("backend", ["torch", "pairwise"])
@pytest.mark.parametrize("scenario", SCENARIOS[:4])
def test_expert_tensor_parallel_dispatch_survives_adversarial_routing(scenario, backend):
    received = run_distributed(_check_etp, 4, scenario, backend, timeout=120)
    if scenario == "all-to-expert-0":  # every token of every rank computed by both halves of expert 0 (+ expert 1's)
        assert received[0] == received[1] >= 4 * TOKENS
    if scenario == "expert-without-tokens":  # experts 0 and 3: every EP position gets rows
        assert min(received) > 0
