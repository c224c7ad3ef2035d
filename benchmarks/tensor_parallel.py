"""Tensor-parallel training step: our Megatron-style TP vs PyTorch DTensor TP, in the same run.

    ours-tp      parallel/tensor_parallel.py (vocab-parallel embedding, head and loss)
    ours-tp-sp   the same with sequence parallelism
    ours-tp-sp-overlap   sequence parallelism with its all-gathers and reduce-scatters decomposed into
                 collective matmuls (tensor_parallel.comm_overlap, parallel/tp_overlap.py)
    dtensor-tp   torch.distributed.tensor.parallel.parallelize_module with the torchtitan plan:
                 ColwiseParallel for wq/wk/wv/w1/w3, RowwiseParallel for wo/w2, a row-wise
                 (vocab-parallel) embedding, a column-wise head with loss_parallel()

Same model, seed, shapes and ranks; every round runs one step (forward, backward, AdamW) of each
variant in an order that rotates per round. Step time is the median over rounds, max over ranks.
"saved MiB" is what autograd keeps for backward over the whole forward (saved_tensors_hooks,
parameters excluded), on rank 0. "exposed comm" is the time rank 0's step spent waiting in our
tensor-parallel communication (reliability/activity.py `blocked_seconds`): for plain TP and SP the whole
collectives, for the overlapped variant only the waits the matmuls did not cover.

    python benchmarks/tensor_parallel.py --world-size 2 --preset tiny
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from ranks import benchmark_arguments, benchmark_model, loss_rel_diff, run_variants, spawn

VARIANTS = ("ours-tp", "ours-tp-sp", "ours-tp-sp-overlap", "dtensor-tp")
PEER = "dtensor-tp"


def _saved_bytes(fn, params) -> int:
    excluded = {p.to_local().untyped_storage().data_ptr() if hasattr(p, "to_local") else p.untyped_storage().data_ptr()
                for p in params}
    kept = {}

    def pack(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # DTensor's async-collective wrappers have no storage yet: count the tensor
            key, size = id(local), local.numel() * local.element_size()
        if key not in excluded:
            kept[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sum(kept.values()), result


def _build(variant: str, config, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    from fivefold.config import OptimConfig, TensorParallelConfig
    from fivefold.model import build_model, materialize
    from fivefold.parallel.mesh import ParallelDims, build_mesh
    from fivefold.parallel.parallelize import apply_model_parallel
    from fivefold.optim import build_optimizer
    from fivefold.reliability.activity import blocked_seconds

    model = materialize(build_model(config), "cpu", seed=0)
    if variant.startswith("ours"):
        mesh = build_mesh(ParallelDims(tp=world_size, world_size=world_size), "cpu")
        plan = apply_model_parallel(model, mesh, TensorParallelConfig(world_size, "sp" in variant, "overlap" in variant))
        loss_of = plan.loss_sum
        context = torch.enable_grad
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers.values():
            parallelize_module(block, mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
            })
        parallelize_module(model, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })

        def loss_of(logits, labels):
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        context = loss_parallel
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    params = list(model.parameters())

    def step(inputs, labels):
        blocked = blocked_seconds("tensor-parallel")
        with context():
            saved, loss = _saved_bytes(lambda: loss_of(model(inputs), labels) / labels.numel(), params)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # every tensor-parallel rank holds the whole loss
        return (saved, blocked_seconds("tensor-parallel") - blocked), (float(loss), 1)

    return step


def _rank(rank: int, world_size: int, args) -> dict:
    config = benchmark_model(args)
    steps = {v: _build(v, config, world_size) for v in VARIANTS}
    times, last, losses = run_variants(steps, config.vocab_size, args, seed=0)  # every TP rank sees the same batch
    agreement = loss_rel_diff(losses, [(v, PEER) for v in VARIANTS if v != PEER])
    return {v: {"step_ms": times[v], "saved_mib": last[v][0] / 2**20, "exposed_comm_ms": last[v][1] * 1e3,
                "loss_rel_diff": agreement} for v in VARIANTS}


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()

    rows = spawn(_rank, args.world_size, args, args.timeout)
    if args.json:
        print(json.dumps({"config": vars(args), "results": rows}, indent=2))
    print(f"{args.preset}, batch {args.batch} x {args.seq_len}, tp {args.world_size}, gloo on CPU, median of {args.rounds} rounds")
    print(f"{'variant':<19} {'step (ms)':>10} {'saved for backward (MiB/rank)':>30} {'exposed comm (ms)':>18}")
    for variant, row in rows.items():
        exposed = f"{row['exposed_comm_ms']:>18.1f}" if variant != PEER else f"{'-':>18}"
        print(f"{variant:<19} {row['step_ms']:>10.1f} {row['saved_mib']:>30.2f} {exposed}")
    ratios = []
    for ours in ("ours-tp", "ours-tp-sp", "ours-tp-sp-overlap"):
        t = rows[ours]["step_ms"] / rows[PEER]["step_ms"]
        m = rows[ours]["saved_mib"] / rows[PEER]["saved_mib"]
        print(f"{ours} / {PEER}: step time x{t:.2f}, saved activations x{m:.2f}")
        ratios.append(f"{ours}_vs_{PEER}_time={t:.3f} {ours}_vs_{PEER}_saved={m:.3f}")
    overlap, plain = rows["ours-tp-sp-overlap"], rows["ours-tp-sp"]
    t = overlap["step_ms"] / plain["step_ms"]
    exposed = overlap["exposed_comm_ms"] / max(plain["exposed_comm_ms"], 1e-9)
    print(f"ours-tp-sp-overlap / ours-tp-sp: step time x{t:.2f}, exposed communication x{exposed:.2f} "
          f"({overlap['exposed_comm_ms']:.1f} vs {plain['exposed_comm_ms']:.1f} ms)")
    ratios.append(f"overlap_vs_sp_time={t:.3f} overlap_vs_sp_exposed={exposed:.3f}")
    agreement = rows[PEER]["loss_rel_diff"]
    print(f"first-step losses, ours vs {PEER}: largest relative difference {agreement:.1e}")
    print("RESULT name=tensor_parallel " + " ".join(ratios) + f" loss_rel_diff={agreement:.3e}")


if __name__ == "__main__":
    main()
