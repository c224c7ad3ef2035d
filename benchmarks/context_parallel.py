"""Context-parallel attention methods as the sequence grows: ring vs Ulysses vs 2D, in the same run.

    none      no context parallelism: every rank runs the whole sequence (the per-rank baseline)
    ring      parallel/context_parallel.py ring attention over all cp ranks (zigzag chunks)
    ulysses   all-to-all to head shards over all cp ranks, fused local attention
    2d        Ulysses over cp_heads ranks x ring over cp / cp_heads (LoongTrain's head x context)
    double    ring attention as a double ring (LoongTrain): rounds of an inner ring of cp / 2 ranks (one
              pretend node), each round's first block one hop on the outer ring across the 2 "nodes"
    2d-cf     2d placed context-first: the ring on adjacent ranks, the head groups strided

Same model, seed and batch on every rank; each context-parallel rank feeds its shard of the
sequence. One step is forward + backward (the gradient all-reduce over cp ranks is the same for
every method and left out), in rotating order per round; step time is the median over rounds,
max over ranks. "saved MiB" is what autograd keeps for backward over the whole forward on
rank 0 (saved_tensors_hooks, parameters excluded): the activation memory a method needs.

    python benchmarks/context_parallel.py --world-size 4 --layers 2 --seq-lens 512,1024,2048
"""

from __future__ import annotations

import copy
import json

from ranks import benchmark_arguments, benchmark_model, loss_rel_diff, run_variants, spawn

METHODS = ("none", "ring", "ulysses", "2d", "double", "2d-cf")
PEER = "ring"


def _build(method: str, config, world_size: int, cp_heads: int):
    from fivefold.config import ContextParallelConfig
    from fivefold.model import build_model, materialize
    from fivefold.parallel.mesh import Mesh, ParallelDims, build_mesh
    from fivefold.parallel.parallelize import apply_model_parallel
    from fivefold.train.memory import saved_activation_bytes

    model = materialize(build_model(config), "cpu", seed=0)
    if method == "none":
        plan = apply_model_parallel(model, Mesh.single())
    else:
        mesh = build_mesh(ParallelDims(cp=world_size, world_size=world_size), "cpu")
        options = {"double": dict(method="ring", inner_ring=world_size // 2),
                   "2d-cf": dict(method="2d", placement="context-first")}.get(method, dict(method=method))
        plan = apply_model_parallel(model, mesh, context=ContextParallelConfig(world_size, heads=cp_heads, **options))
    params = list(model.parameters())

    def step(inputs, labels):
        inputs, labels, positions = plan.shard_sequence(inputs, labels)
        losses = []
        saved = saved_activation_bytes(
            lambda: losses.append(plan.loss_sum(model(inputs, positions=positions), labels) / labels.numel()), params)
        losses[0].backward()
        for p in params:
            p.grad = None
        return saved, (float(losses[0]) * labels.numel(), labels.numel())

    return step


def _rank(rank: int, world_size: int, args) -> dict:
    config = benchmark_model(args)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    config.max_seq_len = max(config.max_seq_len, max(seq_lens))
    steps = {m: _build(m, config, world_size, args.cp_heads) for m in METHODS}
    rows = {}
    for seq_len in seq_lens:
        shape = copy.copy(args)
        shape.seq_len = seq_len
        times, saved, losses = run_variants(steps, config.vocab_size, shape, seed=seq_len)
        agreement = loss_rel_diff(losses, [(m, PEER) for m in METHODS if m != PEER])
        rows[seq_len] = {m: {"step_ms": times[m], "saved_mib": saved[m] / 2**20, "loss_rel_diff": agreement}
                         for m in METHODS}
    return rows


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--world-size", type=int, default=4, help="context-parallel degree")
    parser.add_argument("--cp-heads", type=int, default=2, help="head-parallel degree of the 2d method")
    parser.add_argument("--seq-lens", default="512,1024,2048")
    parser.set_defaults(batch=1, rounds=4, warmup=1)
    args = parser.parse_args()

    table = spawn(_rank, args.world_size, args, args.timeout)
    if args.json:
        print(json.dumps({"config": vars(args), "results": table}, indent=2))
    ring = args.world_size // args.cp_heads
    print(f"{args.preset} ({args.layers or 'all'} layers), batch {args.batch}, cp {args.world_size} "
          f"(2d = {args.cp_heads} heads x {ring} ring), gloo on CPU, median of {args.rounds} rounds")
    print(f"{'seq':>6} {'method':<8} {'fwd+bwd (ms)':>13} {'saved (MiB/rank)':>17} {'time / ring':>12} {'saved / ring':>13}")
    result = []
    for seq_len, rows in table.items():
        for method, row in rows.items():
            t = row["step_ms"] / rows[PEER]["step_ms"]
            m = row["saved_mib"] / rows[PEER]["saved_mib"]
            print(f"{seq_len:>6} {method:<8} {row['step_ms']:>13.1f} {row['saved_mib']:>17.2f} {t:>11.2f}x {m:>12.2f}x")
            if method != PEER:
                result.append(f"{method}_vs_ring_time_s{seq_len}={t:.3f}")
    agreement = max(rows[PEER]["loss_rel_diff"] for rows in table.values())
    print(f"losses, every method vs {PEER}: largest relative difference {agreement:.1e}")
    print("RESULT name=context_parallel " + " ".join(result) + f" loss_rel_diff={agreement:.3e}")


if __name__ == "__main__":
    main()
