"""`fivefold plan`: the estimate, the search and the calculator as tables, JSON and a memory plot.

    fivefold plan [--config F] [--section.key V ...] --gpus N [--cluster h100-sxm|FILE]
                  [--efficiency E] [--attention-efficiency A] [--json OUT] [--plot OUT.png]
    fivefold plan ... --search [--global-batch B] [--top K] [--no-offload] [--workers W] [--write-best OUT.toml]
    fivefold plan ... --sharding-degrees [--top K] [--write-best OUT.toml]
    fivefold plan ... --tokens T (--gpus N | --days D) [--achieved-tflops X | --mfu M]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from typing import TYPE_CHECKING

from fivefold.errors import ConfigError
from fivefold.plan.efficiency import add_efficiency_arguments, efficiency_from

if TYPE_CHECKING:  # the parser is built without torch (`fivefold --help` stays instant)
    from fivefold.config.schema import JobConfig
    from fivefold.plan.cluster import ClusterSpec
    from fivefold.plan.estimate import Estimate

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="the TOML config `train` would run (its model, batch and layout)")
    parser.add_argument("--gpus", type=int, default=0, help="accelerators the job runs on")
    parser.add_argument("--cluster", default="h100-sxm",
                        help="a preset (a100-80gb, h100-sxm, h200, b200) or a cluster TOML file (docs/planner.md)")
    add_efficiency_arguments(parser)
    parser.add_argument("--vocab-size", type=int, default=0, help="for a model whose vocabulary comes from the tokenizer")
    parser.add_argument("--json", help="also write the result as JSON here")
    parser.add_argument("--expert-load", metavar="RUN",
                        help="a MoE run's folder or metrics.jsonl: price the expert exchanges and the busiest rank's "
                             "experts under its measured routing (each expert-parallel position's load, "
                             "moe_load_by_ep_rank, or else moe_load; last 10 logged steps; default: balanced); "
                             "with --search, every layout with expert parallelism")
    parser.add_argument("--plot", help="draw the memory per rank by component (PNG)")
    parser.add_argument("--search", action="store_true", help="rank every feasible layout on --gpus")
    parser.add_argument("--global-batch", type=int, default=0,
                        help="sequences per optimizer step for --search (default: the config's micro x accum x dp)")
    parser.add_argument("--top", type=int, default=10, help="layouts --search prints")
    parser.add_argument("--no-offload", action="store_true", help="leave ZeRO-Offload out of --search")
    parser.add_argument("--workers", type=int, default=0,
                        help="processes sharing --search (forked, Linux; the result is the same for any number): "
                             "default 0, one per usable core, at most 8")
    parser.add_argument("--write-best", help="write the best layout of --search (or --sharding-degrees) as a TOML "
                                             "`train` accepts")
    parser.add_argument("--sharding-degrees", action="store_true",
                        help="rank the config's layout under every P/G/OS sharding degree (AMSP/MiCS) that fits memory")
    parser.add_argument("--tokens", type=float, default=0, help="training tokens for the calculator")
    parser.add_argument("--days", type=float, default=0, help="calculator: the GPUs needed to train --tokens in D days")
    parser.add_argument("--achieved-tflops", type=float, default=0, help="calculator: achieved TFLOP/s per GPU")
    parser.add_argument("--mfu", type=float, default=0, help="calculator: achieved share of the cluster's peak")


def format_estimate(found: Estimate, cluster: ClusterSpec, title: str) -> str:
    m, t = found.memory, found.time
    rows = [
        (title, found.degrees.describe() + f" on {found.gpus} x {cluster.accelerator.name}"),
        ("memory per rank", f"{m.total / GIB:,.2f} GiB of {found.capacity / GIB:,.0f} GiB "
                            f"({'fits' if found.fits else 'does NOT fit'}; pipeline rank {found.memory_rank})"),
        ("  parameters", f"{m.parameters / GIB:,.2f} GiB"),
        ("  gradients", f"{m.gradients / GIB:,.2f} GiB"
                        + (" (made in backward, after the loss's peak: not in the total)" if m.gradients_after_peak
                           else "")),
        ("  optimizer", f"{m.optimizer / GIB:,.2f} GiB" + (f" (+ {m.host / GIB:,.2f} GiB on the host)" if m.host else "")
                        + (f" (+ {m.nvme / GIB:,.2f} GiB in the NVMe swap file)" if m.nvme else "")),
        ("  activations", f"{m.activations / GIB:,.2f} GiB"),
        ("  logits", f"{m.logits / GIB:,.2f} GiB"),
        ("  buffers", f"{m.buffers / GIB:,.2f} GiB"),
        ("  DDP buckets", f"{m.buckets / GIB:,.2f} GiB"),
    ]
    if m.weight_copies:
        rows.append(("  bf16 weight copies", f"{m.weight_copies / GIB:,.2f} GiB (autocast's, kept for backward)"))
    if m.backward_climb:
        rows.append(("  backward climb", f"{m.backward_climb / GIB:,.2f} GiB (gradients made beyond what backward frees, "
                                         "above the loss's peak)"))
    if found.server is not None:
        server = found.server
        rows.append(("parameter server", f"{server.total / GIB:,.2f} GiB (the largest: {server.parameter_count:,} "
                                         f"parameters; weights {server.parameters / GIB:,.2f}, gradients "
                                         f"{server.gradients / GIB:,.2f}, AdamW {server.optimizer / GIB:,.2f}, push buffers "
                                         f"{server.buffers / GIB:,.2f} GiB)"))
    if t is not None:
        rows += [("step time", f"{t.total:,.4g} s ({found.tokens_per_step:,} tokens: {found.tokens_per_second:,.0f} "
                               f"tokens/s, MFU {100 * found.mfu:.1f}%)")]
        rows += [(f"  {name}", f"{value:,.4g} s") for name, value in
                 (("compute", t.compute), ("tp comm", t.tp), ("cp comm (exposed)", t.cp), ("ep all-to-all", t.ep),
                  ("pp sends", t.pp_comm), ("pp bubble", t.bubble),
                  ("push + pull" if found.server else "dp comm (exposed)", t.dp), ("offload", t.offload),
                  ("servers' update" if found.server else "optimizer", t.optimizer))
                 if value or name == "compute"]
    rows += [("note", note) for note in found.notes]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def describe_layout(config: JobConfig) -> str:
    z, t, p = config.data_parallel, config.train, config.pipeline_parallel
    sharded = f" P/G/OS {z.shard_params}/{z.shard_grads}/{z.shard_optim}" if z.shard_optim or z.shard_grads or z.shard_params else ""
    parts = [f"zero {z.zero_stage}{sharded}" + (" offload" if z.offload else ""), f"recompute {t.recompute}",
             f"micro {t.micro_batch_size} x {t.grad_accum_steps}"]
    if p.degree > 1:
        parts.append(p.schedule + (f" v{p.virtual}" if p.virtual > 1 else "") + f" stages {p.layers_per_stage}")
    return ", ".join(parts)


def plot_memory(entries: list[tuple[str, Estimate]], output: str) -> Path:
    from fivefold.plotting import pyplot, save_figure

    plt = pyplot()
    parts = ("parameters", "gradients", "optimizer", "activations", "logits", "buffers", "buckets", "weight_copies")
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(entries) + 2), 4.5))
    bottoms = [0.0] * len(entries)
    for part in parts:
        values = [getattr(e.memory, part) / GIB for _, e in entries]
        ax.bar(range(len(entries)), values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    capacity = entries[0][1].capacity / GIB
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity:.0f} GiB")
    ax.set_xticks(range(len(entries)), [label for label, _ in entries], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GiB per rank")
    ax.set_title("predicted memory per rank by component")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, output)


def _default_batch(config: JobConfig, gpus: int) -> int:
    t = config.train
    others = config.tensor_parallel.degree * config.pipeline_parallel.degree * config.context_parallel.degree
    return t.micro_batch_size * t.grad_accum_steps * max(gpus // others, 1)


def run(args: argparse.Namespace, config: JobConfig, cluster: ClusterSpec) -> int:
    from fivefold.plan.estimate import estimate
    if args.gpus < 0 or args.top < 1 or args.global_batch < 0:
        raise ConfigError("--gpus, --top and --global-batch must be positive")
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: a number of processes (0: one per usable core, at most 8)")
    out: dict = {"cluster": cluster.to_dict()}
    if args.expert_load and (args.tokens or args.sharding_degrees):
        raise ConfigError("--expert-load prices a layout's expert exchanges (one, or each that --search ranks): leave "
                          "out --tokens and --sharding-degrees")
    if args.tokens:
        return _calculator(args, config, cluster, out)
    if args.gpus < 1:
        raise ConfigError("fivefold plan needs --gpus N (the accelerators of the job)")
    load = None
    if args.expert_load:
        from fivefold.parallel.expert_placement import routing_from_metrics

        load = routing_from_metrics(args.expert_load)
    if args.search:
        return _search(args, config, cluster, out, load)
    if args.sharding_degrees:
        return _sharding_degrees(args, config, cluster, out)
    efficiency = efficiency_from(args)
    found = estimate(config, args.gpus, cluster, efficiency, args.vocab_size, expert_load=load)
    print(format_estimate(found, cluster, "layout"))
    if efficiency.profile is not None:
        print(f"compute: {efficiency.describe()} (--profile {args.profile})")
    out["estimate"] = found.to_dict()
    if found.expert_imbalance is not None:
        from fivefold.plan.expert_load import describe_routing, load_positions

        out["expert_load"], out["expert_imbalance"] = args.expert_load, found.expert_imbalance
        out["expert_load_positions"] = load_positions(load)
        print(f"experts routed as measured in {args.expert_load} ({describe_routing(load)}): the busiest "
              f"expert-parallel rank receives {found.expert_imbalance:.2f}x the mean rows (the memory above keeps its MoE "
              "activations on every rank)")
    if args.plot:
        print(f"wrote {plot_memory([(found.degrees.describe(), found)], args.plot)}")
    _write_json(args, out)
    return 0


def _search(args: argparse.Namespace, config: JobConfig, cluster: ClusterSpec, out: dict,
            load: dict[str, list] | None = None) -> int:
    import time

    from fivefold.config import config_toml
    from fivefold.plan.search import search
    from fivefold.plan.workers import default_workers

    batch = args.global_batch or _default_batch(config, args.gpus)
    workers = args.workers or default_workers()
    start = time.perf_counter()
    result = search(config, args.gpus, cluster, batch, efficiency_from(args), args.vocab_size, not args.no_offload,
                    workers=workers, expert_load=load)
    seconds = time.perf_counter() - start
    if load is not None:
        from fivefold.plan.expert_load import describe_routing

        print(f"layouts with expert parallelism routed as measured in {args.expert_load} ({describe_routing(load)})")
    print(f"searched {result.considered:,} layouts of {args.gpus} x {cluster.accelerator.name} for a global batch of "
          f"{batch} sequences in {seconds:.1f} s ({result.workers} process{'es' if result.workers > 1 else ''}): "
          f"{len(result.ranked):,} feasible"
          + (f" ({result.rebalanced:,} with blocks moved between pipeline stages to fit memory)" if result.rebalanced else ""))
    for reason, count in result.rejected.most_common():
        print(f"  rejected {count:>7,} by {reason}: e.g. {result.examples[reason]}")
    if not result.ranked:
        raise ConfigError("no layout fits: add accelerators, shorten train.seq_len, or use a larger accelerator")
    print(f"\n{'rank':>4}  {'step (s)':>9}  {'MFU':>6}  {'GiB/rank':>8}  layout")
    for i, (candidate, found) in enumerate(result.ranked[:args.top], 1):
        print(f"{i:>4}  {found.time.total:>9.4g}  {100 * found.mfu:>5.1f}%  {found.memory.total / GIB:>8.2f}  "
              f"{found.degrees.describe()}, {describe_layout(candidate)}")
    best_config, best = result.ranked[0]
    print("\n" + format_estimate(best, cluster, "best"))
    out["search"] = {"considered": result.considered, "rebalanced": result.rebalanced, "seconds": seconds, "workers": result.workers,
                     "degree_options": result.degree_options, "placements": result.placements,
                     "global_batch": batch, "expert_load": args.expert_load or "balanced",
                     "rejected": dict(result.rejected), "examples": result.examples,
                     "top": [{"layout": describe_layout(c), **e.to_dict()} for c, e in result.ranked[:args.top]]}
    if args.write_best:
        path = Path(args.write_best)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# written by `fivefold plan --search` ({best.degrees.describe()}, {describe_layout(best_config)}, "
                        f"predicted {best.time.total:.4g} s per step on {args.gpus} x {cluster.accelerator.name})\n"
                        + config_toml(best_config.to_dict()))
        print(f"wrote {path}: `fivefold train --config {path} --nproc-per-node ...` runs it")
    if args.plot:
        entries = [(f"{i}: {f.degrees.describe()}", f) for i, (_, f) in enumerate(result.ranked[:args.top], 1)]
        print(f"wrote {plot_memory(entries, args.plot)}")
    _write_json(args, out)
    return 0


def _sharding_degrees(args: argparse.Namespace, config: JobConfig, cluster: ClusterSpec, out: dict) -> int:
    from fivefold.config import config_toml
    from fivefold.plan.estimate import zero_degrees
    from fivefold.plan.search import choose_degrees

    if not config.data_parallel.zero_stage:
        raise ConfigError("--sharding-degrees varies ZeRO's sharding: set data_parallel.zero_stage to 1, 2 or 3")
    ranked = choose_degrees(config, args.gpus, cluster, efficiency_from(args), args.vocab_size)
    if not ranked:
        raise ConfigError(f"no P/G/OS sharding degree of this layout fits {cluster.accelerator.name}'s memory")
    print(f"{'rank':>4}  {'P/G/OS':>12}  {'step (s)':>9}  {'GiB/rank':>8}  (fastest first; degrees over the dp x cp ranks)")
    rows = []
    for i, (option, found) in enumerate(ranked[:args.top], 1):
        d = zero_degrees(option, found.degrees)
        print(f"{i:>4}  {f'{d.params}/{d.grads}/{d.optim}':>12}  {found.time.total:>9.4g}  {found.memory.total / GIB:>8.2f}")
        rows.append({"params": d.params, "grads": d.grads, "optim": d.optim, **found.to_dict()})
    out["sharding_degrees"] = rows
    if args.write_best:
        path = Path(args.write_best)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# written by `fivefold plan --sharding-degrees` ({describe_layout(ranked[0][0])})\n"
                        + config_toml(ranked[0][0].to_dict()))
        print(f"wrote {path}")
    _write_json(args, out)
    return 0


def _calculator(args: argparse.Namespace, config: JobConfig, cluster: ClusterSpec, out: dict) -> int:
    from fivefold.plan.calculator import budget
    from fivefold.plan.estimate import compute_dtype, estimate, model_for

    model = model_for(config, args.vocab_size)
    seq = config.train.seq_len
    if args.achieved_tflops:
        rate, source = args.achieved_tflops * 1e12, "given"
    elif args.mfu:
        if not 0 < args.mfu <= 1:
            raise ConfigError(f"--mfu = {args.mfu}: must lie in (0, 1]")
        rate = args.mfu * cluster.accelerator.peak_flops(compute_dtype(config))
        source = f"MFU {args.mfu:.0%} of {cluster.accelerator.name}"
    else:
        if args.gpus < 1:
            raise ConfigError("the calculator needs --achieved-tflops, --mfu, or --gpus N to predict the rate of the "
                              "config's layout on N accelerators")
        found = estimate(config, args.gpus, cluster, efficiency_from(args), args.vocab_size)
        rate = found.mfu * found.peak_flops
        source = f"predicted for {found.degrees.describe()} on {cluster.accelerator.name} (MFU {100 * found.mfu:.1f}%)"
    result = budget(model, args.tokens, seq, rate, gpus=0 if args.days else args.gpus, days=args.days)
    print(f"{model.name}: {result.describe()} [rate {source}]")
    out["budget"] = {"tokens": result.tokens, "flops": result.flops, "achieved_tflops_per_gpu": rate / 1e12,
                     "gpus": result.gpus, "days": result.days, "rate_source": source}
    _write_json(args, out)
    return 0


def _write_json(args: argparse.Namespace, out: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
