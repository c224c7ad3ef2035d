"""Independent P/G/OS sharding degrees (AMSP, MiCS) against plain ZeRO-3 in the same run, on 4 gloo ranks as 2 nodes.

Variants (parallel/shard_layout.py), each a real Trainer on the same config and seed, named by the
ranks parameters / gradients / optimizer states are sharded over:

    zero3        4/4/4   plain ZeRO-3 (the peer: every gather and reduce-scatter over both nodes)
    zero2        1/4/4   ZeRO-2          zero1   1/1/4   ZeRO-1
    amsp-1-2-4   1/2/4   whole weights, gradients sharded in the node, optimizer states over both nodes
    amsp-2-2-4   2/2/4   weights and gradients sharded in the node (gathered there every micro-batch)
    mics-2-2-2   2/2/2   everything sharded in the node, replicated across the nodes (MiCS / HSDP)

Each step runs `--accum` micro-batches. Rounds run one optimizer step of every variant in rotating
order (benchmarks/ranks.py); a step's time is the slowest rank's, reported as the median after the
warm-up. Bytes are what rank 0's ZeRO sent in one step (ring volume per collective), split into groups
spanning the 2 pretend nodes (gradient_comm.node_size = 2) and groups inside one; memory is rank 0's
measured model-state bytes. Every variant computes the same loss (exact up to summation order).

    python benchmarks/shard_degrees.py --preset tiny --rounds 6
"""

from __future__ import annotations

import functools
import json

from ranks import benchmark_arguments, spawn, trainer_config, trainers_taking_turns, zero_traffic_rounds

VARIANTS = {
    "zero3": (4, 4, 4),
    "zero2": (1, 4, 4),
    "zero1": (1, 1, 4),
    "amsp-1-2-4": (1, 2, 4),
    "amsp-2-2-4": (2, 2, 4),
    "mics-2-2-2": (2, 2, 2),
}


def _config(args, degrees: tuple[int, int, int], output: str):
    p, g, o = degrees
    return trainer_config(args, output, train=dict(grad_accum_steps=args.accum),
                          data_parallel=dict(zero_stage=1, shard=4, replicate=1, param_dtype=args.param_dtype,
                                             shard_params=p, shard_grads=g, shard_optim=o),
                          gradient_comm=dict(node_size=2, reduce_dtype=args.param_dtype))


def _rank(rank: int, world_size: int, args) -> dict:
    chosen = {name: VARIANTS[name] for name in args.variants.split(",")}
    trainers = trainers_taking_turns(rank, world_size, {name: functools.partial(_config, args, degrees)
                                                        for name, degrees in chosen.items()})
    rows = zero_traffic_rounds(trainers, args.warmup, args.rounds)
    for name, row in rows.items():
        row["model_state_bytes"] = trainers[name].report.model_state_bytes.total
    return rows


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, zero3 first (the peer)")
    args = parser.parse_args()
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown or not args.variants.startswith("zero3"):
        parser.error(f"--variants: {unknown or args.variants} (choose from {', '.join(VARIANTS)}, zero3 first)")
    rows = spawn(_rank, 4, args, args.timeout)
    if args.json:
        print(json.dumps({"config": vars(args), "results": rows}, indent=2))
    base = rows["zero3"]
    print(f"{args.preset}, 4 gloo ranks as 2 nodes of 2, per-rank micro-batch {args.batch} x {args.seq_len} x "
          f"{args.accum} accumulation, {args.param_dtype} weights, median of {args.rounds} rounds")
    print(f"{'variant':<11} {'P/G/OS':>7} {'step (ms)':>10} {'x zero3':>8} {'states (B)':>11} {'x zero3':>8} "
          f"{'bytes/step':>12} {'cross-node':>12} {'x zero3':>8}")
    ratios = []
    for name, row in rows.items():
        time_ratio = row["step_ms"] / base["step_ms"]
        memory_ratio = row["model_state_bytes"] / base["model_state_bytes"]
        cross_ratio = row["cross_node_bytes"] / max(base["cross_node_bytes"], 1)
        degrees = "/".join(map(str, VARIANTS[name]))
        print(f"{name:<11} {degrees:>7} {row['step_ms']:>10.1f} {time_ratio:>8.2f} {row['model_state_bytes']:>11,} "
              f"{memory_ratio:>8.2f} {row['bytes']:>12,} {row['cross_node_bytes']:>12,} {cross_ratio:>8.2f}")
        if name != "zero3":
            key = name.replace("-", "_")
            ratios.append(f"{key}_vs_zero3_time={time_ratio:.3f} {key}_vs_zero3_mem={memory_ratio:.3f} "
                          f"{key}_vs_zero3_cross={cross_ratio:.3f}")
    diff = max(abs(row["first_loss"] - base["first_loss"]) / base["first_loss"] for row in rows.values())
    print(f"first-step loss: largest relative difference from zero3 {diff:.1e}")
    print("RESULT name=shard_degrees " + " ".join(ratios) + f" loss_rel_diff={diff:.3e}")


if __name__ == "__main__":
    main()
