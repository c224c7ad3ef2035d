"""ZeRO++'s collectives on 4 gloo ranks standing in for 2 nodes of 2, and the bytes they send.

The quantised gather and reduce-scatter agree with the exact ones within the quantisation bound;
the bytes the runtime counts per phase and per kind of group (parallel/zero_pp.py ZeroTraffic) for a
real training step equal the planner's formula (plan/zero_traffic.py) on the runtime's flat groups,
for plain ZeRO-3 and every ZeRO++ switch; and the cross-node bytes drop as the formula says.
"""

from __future__ import annotations

import pytest
import torch

from distributed.spawn import run_distributed
from parity.harness import with_changes


def _collectives(rank, world_size, bits):
    import torch.distributed as dist

    from fivefold.parallel.mesh import subgroup
    from fivefold.parallel.zero_pp import (ZeroPPOptions, ZeroTraffic, build_zero_pp_groups, quantized_all_gather,
                                           quantized_reduce_scatter)

    options = ZeroPPOptions(quantized_weights=True, gradient_bits=bits, block=64, node_size=2)
    groups = build_zero_pp_groups(options, [[0, 1, 2, 3]], subgroup)
    traffic = ZeroTraffic()
    generator = torch.Generator().manual_seed(rank)
    full = torch.randn(4 * 300, generator=generator)
    everyone = [torch.empty_like(full) for _ in range(world_size)]
    dist.all_gather(everyone, full)
    exact = torch.stack(everyone).sum(0)[rank * 300 : (rank + 1) * 300]
    out = torch.empty(300)
    quantized_reduce_scatter(out, full, groups, traffic).wait()
    local = torch.randn(300, generator=generator)
    gathered = torch.empty(4 * 300)
    quantized_all_gather(gathered, local, dist.group.WORLD, 64, traffic, "gather", True).wait()
    shards = [torch.empty(300) for _ in range(world_size)]
    dist.all_gather(shards, local)
    return (out - exact).abs().max().item(), exact.abs().max().item(), (gathered - torch.cat(shards)).abs().max().item(), \
        torch.cat(shards).abs().max().item(), dict(traffic.sent)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_collectives_are_within_their_bound(bits):
    results = run_distributed(_collectives, 4, bits)
    top = 127 if bits == 8 else 7
    for scatter_error, scale, gather_error, gathered_max, sent in results:
        # two rounds of quantisation, each off by half a step of a block whose max is at most the sum's max x 4
        assert 0 < scatter_error <= 2 * 4 * scale / top
        assert 0 < gather_error <= 0.5 * gathered_max / 127 * 1.0001  # half an int8 step of the largest block
        row = lambda n: -(-n // 64) * 64 * bits // 8 + 4 * (-(-n // 64))  # noqa: E731
        assert sent[("reduce-scatter", False)] == row(2 * 300) * 2 // 2  # 2 rows of K x shard to 1 node peer
        assert sent[("reduce-scatter", True)] == row(300) * 2 // 2  # 2 rows of a shard to the other node
        assert sent[("gather", True)] == 3 * (4 * (320 + 4 * 5)) // 4


def _step_counts(rank, world_size, configs):
    from fivefold.plan.zero_traffic import ZeroShape, zero3_step_bytes
    from fivefold.train.trainer import Trainer

    out = []
    for config in configs:
        trainer = Trainer(config)
        zero = trainer.sync.zero
        trainer.sync.traffic_metrics = lambda: {}  # keep the counts for this test
        trainer.train_step()  # the first step
        zero.traffic.take()
        trainer.train_step()
        measured = zero.traffic.take()
        z = config.data_parallel
        shape = ZeroShape(zero.shards, nodes=2 if zero.shards == 4 else 1, hpz=z.hpz_partition,
                          quantized_weights=z.quantized_weights, gradient_bits=z.gradient_bits, block=z.quantization_block,
                          replicas=4 // zero.shards)
        groups = [(g.numel, g.unit < len(zero.units)) for g in zero.groups]
        out.append((measured, zero3_step_bytes(groups, shape, config.train.grad_accum_steps)))
        trainer.close()
    return out


LAYOUTS = {
    "plain": {},
    "qwZ": {"quantized_weights": True},
    "hpZ": {"hpz_partition": 2},
    "qgZ-int8": {"quantized_gradients": "int8"},
    "qgZ-int4-block64": {"quantized_gradients": "int4", "quantization_block": 64},
    "all-three": {"quantized_weights": True, "hpz_partition": 2, "quantized_gradients": "int4"},
    "hsdp-2x2-qwZ-qgZ": {"replicate": 2, "shard": 2, "quantized_weights": True, "quantized_gradients": "int8"},
}


def test_counted_bytes_equal_the_planner_formula_and_drop_across_nodes(job, tmp_path):
    configs = [with_changes(job, checkpoint={"enabled": False},
                            train={"eval_every": 0, "micro_batch_size": 1, "grad_accum_steps": 2,
                                   "output_dir": str(tmp_path / name)},
                            data_parallel={"zero_stage": 3, "shard": 4, **options}, gradient_comm={"node_size": 2})
               for name, options in LAYOUTS.items()]
    results = run_distributed(_step_counts, 4, configs)
    for rank_results in results:
        for name, (measured, planned) in zip(LAYOUTS, rank_results):
            assert measured == planned, f"{name}: runtime {measured} vs formula {planned}"
    counts = dict(zip(LAYOUTS, results[0]))
    cross = {name: {phase: n for (phase, over), n in counts[name][0].items() if over} for name in LAYOUTS}
    plain = cross["plain"]
    assert cross["hpZ"].get("backward all-gather", 0) == 0  # backward gathers stay in the node
    assert cross["hpZ"]["forward all-gather"] == plain["forward all-gather"]
    assert cross["qwZ"]["forward all-gather"] < plain["forward all-gather"] / 3  # fp32 -> int8 + scales
    assert cross["qgZ-int8"]["reduce-scatter"] < plain["reduce-scatter"] / 8  # int8 and 1/L of it crosses
    assert sum(cross["all-three"].values()) < sum(plain.values()) / 4  # the paper's 4x, here more (fp32 weights)
