"""Gradient communication scheduling: FIFO (wait-free backprop) vs priority (P3 / ByteScheduler), vs PyTorch DDP.

    ours-fifo      parallel/data_parallel.py: buckets all-reduced as backward fills them
    ours-priority  parallel/comm_schedule.py: slices in next-forward order, per-module deferred updates
    torch-ddp      torch.nn.parallel.DistributedDataParallel (the peer for step time)

Both of ours sum with the same reducer (`--algorithm`, on the communication thread) and measure
the fraction of communication hidden behind computation: 1 - (time the training thread waited
for communication) / (time the communication thread spent reducing). For priority the waits are
in the next forward (each module for its own slices) and the step is forward + backward + hand-off.

    python benchmarks/comm_schedule.py --world-size 2 --bucket-mb 1 --slice-mb 0.25
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import benchmark_arguments, benchmark_model, loss_rel_diff, run_variants, spawn

VARIANTS = ("ours-fifo", "ours-priority", "torch-ddp")


def _build(variant: str, config, args, world_size: int):
    from fivefold.comm.reducers import build_reducer
    from fivefold.config import OptimConfig
    from fivefold.model import build_model, materialize
    from fivefold.parallel.comm_schedule import PriorityDataParallel
    from fivefold.parallel.mesh import private_copy
    from fivefold.parallel.data_parallel import DataParallel
    from fivefold.optim import build_optimizer, set_lr

    optim = OptimConfig(lr=1e-3)
    model = materialize(build_model(config), "cpu", seed=0)
    group = private_copy(dist.group.WORLD)
    sync = None
    if variant == "ours-fifo":
        sync = DataParallel(model, group, args.bucket_mb, reducer=build_reducer(group, args.algorithm))
    elif variant == "ours-priority":
        sync = PriorityDataParallel(model, group, args.bucket_mb, reducer=build_reducer(group, args.algorithm),
                                    slice_mb=args.slice_mb)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=args.bucket_mb)
    optimizer = build_optimizer(model, optim)

    def update(params):
        set_lr(optimizer, optim.lr)
        optimizer.step()

    def step(inputs, labels):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        if sync is None:
            loss.backward()
            optimizer.step()
        else:
            (loss / world_size).backward()
            sync.finish_gradient_sync()
            if variant == "ours-priority":
                sync.defer_update(update)
            else:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return sync.overlap if sync is not None else None, (float(loss) * labels.numel(), labels.numel())

    return step


def _rank(rank: int, world_size: int, args) -> dict:
    config = benchmark_model(args)
    steps = {v: _build(v, config, args, world_size) for v in VARIANTS}
    times, last, losses = run_variants(steps, config.vocab_size, args, seed=rank)
    agreement = loss_rel_diff(losses, [("ours-fifo", "torch-ddp"), ("ours-priority", "torch-ddp")])
    out = {}
    for v in VARIANTS:
        meter = last[v]
        hidden = torch.tensor(meter.hidden_fraction() if meter is not None else float("nan"))
        dist.all_reduce(hidden)  # mean over ranks
        out[v] = {"step_ms": times[v], "hidden": float(hidden) / world_size, "loss_rel_diff": agreement}
    return out


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--algorithm", default="ring", help="the reducer both of ours use (native runs on the thread too)")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--slice-mb", type=float, default=0.25)
    args = parser.parse_args()
    results = spawn(_rank, args.world_size, args, args.timeout)
    if args.json:
        print(json.dumps({"config": vars(args), "results": results}, indent=2))
    print(f"{args.preset}, {args.world_size} ranks, per-rank batch {args.batch} x {args.seq_len}, buckets {args.bucket_mb} MiB, "
          f"slices {args.slice_mb} MiB, {args.algorithm}, gloo on CPU, median of {args.rounds} rounds")
    print(f"{'variant':<14} {'step (ms)':>10} {'comm hidden':>12}")
    for variant, row in results.items():
        hidden = "-" if row["hidden"] != row["hidden"] else f"{row['hidden']:.1%}"
        print(f"{variant:<14} {row['step_ms']:>10.1f} {hidden:>12}")
    peer = results["torch-ddp"]["step_ms"]
    ratios = " ".join(f"{v}={results[v]['step_ms'] / peer:.2f}" for v in ("ours-fifo", "ours-priority"))
    print(f"step time vs torch-ddp: {ratios}")
    print(f"RESULT name=comm_schedule fifo_hidden={results['ours-fifo']['hidden']:.3f} "
          f"priority_hidden={results['ours-priority']['hidden']:.3f} "
          f"fifo_vs_torch={results['ours-fifo']['step_ms'] / peer:.3f} priority_vs_torch={results['ours-priority']['step_ms'] / peer:.3f} "
          f"loss_rel_diff={results['torch-ddp']['loss_rel_diff']:.3e}")


if __name__ == "__main__":
    main()
