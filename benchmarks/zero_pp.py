"""ZeRO++ against plain ZeRO-3 in the same run: cross-node bytes, step time and loss, on 4 gloo ranks as 2 nodes.

Variants (parallel/zero_pp.py), each a real Trainer on the same config and seed:

    zero3       plain ZeRO-3 (the peer: every gather and reduce-scatter over all 4 ranks)
    qwZ         int8 weight gathers
    hpZ         secondary weight shards over the 2 ranks of a node; backward gathers stay inside it
    qgZ-int8    int8 hierarchical all-to-all reduce-scatter   (qgZ-int4: int4, as in the paper)
    zero++      all three (qwZ + hpZ + qgZ-int4)

Rounds run one optimizer step of every variant in rotating order (benchmarks/ranks.py); a step's time
is the slowest rank's, reported as the median after the warm-up. Bytes are what rank 0's ZeRO sent in
one step (ring volume per collective, parallel/zero_pp.py ZeroTraffic), split into groups spanning the
2 pretend nodes (gradient_comm.node_size = 2) and groups inside one. Weights are bf16 with bf16
gradient reduction, the paper's fp16 baseline. Losses: each variant's first and last step against
plain ZeRO-3 (quantisation is lossy; hpZ is exact).

    python benchmarks/zero_pp.py --preset tiny --rounds 6
"""

from __future__ import annotations

import functools
import json

from ranks import benchmark_arguments, spawn, trainer_config, trainers_taking_turns, zero_traffic_rounds

VARIANTS = {
    "zero3": {},
    "qwZ": {"quantized_weights": True},
    "hpZ": {"hpz_partition": 2},
    "qgZ-int8": {"quantized_gradients": "int8"},
    "qgZ-int4": {"quantized_gradients": "int4"},
    "zero++": {"quantized_weights": True, "hpz_partition": 2, "quantized_gradients": "int4"},
}


def _config(args, options: dict, output: str):
    return trainer_config(args, output,
                          data_parallel=dict(zero_stage=3, shard=4, replicate=1, param_dtype=args.param_dtype, **options),
                          gradient_comm=dict(node_size=2, reduce_dtype=args.param_dtype))


def _rank(rank: int, world_size: int, args) -> dict:
    trainers = trainers_taking_turns(rank, world_size, {name: functools.partial(_config, args, options)
                                                        for name, options in VARIANTS.items()})
    return zero_traffic_rounds(trainers, args.warmup, args.rounds)


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"))
    args = parser.parse_args()
    rows = spawn(_rank, 4, args, args.timeout)
    if args.json:
        print(json.dumps({"config": vars(args), "results": rows}, indent=2))
    base = rows["zero3"]
    print(f"{args.preset}, 4 gloo ranks as 2 nodes of 2, per-rank batch {args.batch} x {args.seq_len}, "
          f"{args.param_dtype} weights, median of {args.rounds} rounds")
    print(f"{'variant':<9} {'step (ms)':>10} {'bytes/step':>12} {'cross-node':>12} {'cross x less':>13} "
          f"{'loss, first':>12} {'last':>8}")
    ratios = []
    for name, row in rows.items():
        less = base["cross_node_bytes"] / max(row["cross_node_bytes"], 1)
        print(f"{name:<9} {row['step_ms']:>10.1f} {row['bytes']:>12,} {row['cross_node_bytes']:>12,} {less:>13.2f} "
              f"{row['first_loss']:>12.4f} {row['last_loss']:>8.4f}")
        if name != "zero3":
            key = name.replace("+", "p").replace("-", "_")
            ratios.append(f"{key}_vs_zero3_time={row['step_ms'] / base['step_ms']:.3f} {key}_cross_node_less={less:.3f}")
    last = max(abs(row["last_loss"] - base["last_loss"]) / base["last_loss"] for row in rows.values())
    exact = abs(rows["hpZ"]["last_loss"] - base["last_loss"])
    print(f"loss after {args.warmup + args.rounds} steps: largest relative difference from zero3 {last:.1e}; "
          f"hpZ vs zero3 {exact:.1e} (exact)")
    print("RESULT name=zero_pp " + " ".join(ratios) + f" last_loss_rel_diff={last:.3e} hpz_loss_abs_diff={exact:.3e}")


if __name__ == "__main__":
    main()
