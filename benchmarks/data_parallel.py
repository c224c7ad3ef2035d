"""Data-parallel step time and per-rank model-state memory: ours vs PyTorch, in the same run.

    our DDP (parallel/data_parallel.py)  vs  torch.nn.parallel.DistributedDataParallel
    our ZeRO-3 (parallel/zero.py)        vs  FSDP2 torch.distributed.fsdp.fully_shard (per block, then root)

Each rank builds the four variants from the same seed; every round runs one optimizer step of
each, in an order that rotates per round (benchmarks/ranks.py). Memory is the bytes of parameters, gradients and optimizer
states one rank holds after a step, counted from tensor storages (local shards for FSDP2's
DTensors); communication buffers are not counted for anyone.

    python benchmarks/data_parallel.py --world-sizes 2 4 --preset tiny
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import benchmark_arguments, benchmark_model, loss_rel_diff, run_variants, spawn

VARIANTS = ("ours-ddp", "torch-ddp", "ours-zero3", "fsdp2")
PEERS = {"ours-ddp": "torch-ddp", "ours-zero3": "fsdp2"}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.dim() == 0:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _optimizer_tensors(optimizer):
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _build(variant: str, config, group, world_size: int):
    from torch.distributed.fsdp import fully_shard

    from fivefold.config import OptimConfig
    from fivefold.model import build_model, materialize
    from fivefold.parallel.data_parallel import DataParallel, DDPSync
    from fivefold.parallel.gradient_sync import GradNorm
    from fivefold.parallel.zero import ZeroDataParallel, ZeroSync
    from fivefold.parallel.zero_groups import ZeroGroups
    from fivefold.train.memory import measure_model_states
    from fivefold.optim import build_adamw, build_optimizer

    optim = OptimConfig(lr=1e-3)
    model = materialize(build_model(config), "cpu", seed=0)
    sync, zero = None, None
    if variant == "ours-ddp":
        sync = DataParallel(model, group)
        optimizer = build_optimizer(model, optim)
    elif variant == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        optimizer = build_optimizer(model, optim)
    elif variant == "ours-zero3":
        zero = sync = ZeroDataParallel(model, ZeroGroups.over(group, None, 3), stage=3)
        optimizer = build_adamw(zero.master_parameters(True), zero.master_parameters(False), optim)
    else:
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        optimizer = build_optimizer(model, optim)

    def step(inputs, labels):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        if variant in ("ours-ddp", "ours-zero3"):
            (loss / world_size).backward()  # ours sum gradients; torch averages
            sync.finish_gradient_sync()
        else:
            loss.backward()
        if zero is not None:
            zero.prepare_step()
        optimizer.step()
        memory = None
        if zero is not None:
            memory = measure_model_states(ZeroSync(zero, optimizer, GradNorm(), None)).total
            zero.after_step()
        elif variant == "ours-ddp":
            memory = measure_model_states(DDPSync(model, optimizer, sync, GradNorm())).total
        else:
            params = list(model.parameters())
            memory = _storage_bytes([*params, *(p.grad for p in params), *_optimizer_tensors(optimizer)])
        optimizer.zero_grad(set_to_none=True)
        return memory, (float(loss) * labels.numel(), labels.numel())

    return step


def _rank(rank: int, world_size: int, args) -> dict:
    config = benchmark_model(args)
    steps = {v: _build(v, config, dist.group.WORLD, world_size) for v in VARIANTS}
    times, memory, losses = run_variants(steps, config.vocab_size, args, seed=rank)  # each rank its own batch
    return {"rows": {v: {"step_ms": times[v], "model_state_mib": memory[v] / 2**20} for v in VARIANTS},
            "loss_rel_diff": loss_rel_diff(losses, list(PEERS.items()))}


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()

    measured = {w: spawn(_rank, w, args, args.timeout) for w in args.world_sizes}
    results = {w: m["rows"] for w, m in measured.items()}
    agreement = max(m["loss_rel_diff"] for m in measured.values())
    if args.json:
        print(json.dumps({"config": vars(args), "results": results}, indent=2))
    print(f"{args.preset}, per-rank batch {args.batch} x {args.seq_len}, gloo on CPU, median of {args.rounds} rounds")
    print(f"{'ranks':>5} {'variant':<11} {'step (ms)':>10} {'model states (MiB/rank)':>24}")
    ratios = []
    for world, rows in results.items():
        for variant, row in rows.items():
            print(f"{world:>5} {variant:<11} {row['step_ms']:>10.1f} {row['model_state_mib']:>24.2f}")
        for ours, peer in PEERS.items():
            time_ratio = rows[ours]["step_ms"] / rows[peer]["step_ms"]
            mem_ratio = rows[ours]["model_state_mib"] / rows[peer]["model_state_mib"]
            print(f"{world:>5} {ours} / {peer}: step time x{time_ratio:.2f}, memory x{mem_ratio:.2f}")
            ratios.append(f"{ours}_vs_{peer}_x{world}_time={time_ratio:.3f} {ours}_vs_{peer}_x{world}_mem={mem_ratio:.3f}")
    print(f"first-step losses, ours vs peers: largest relative difference {agreement:.1e}")
    print("RESULT name=data_parallel " + " ".join(ratios) + f" loss_rel_diff={agreement:.3e}")


if __name__ == "__main__":
    main()
