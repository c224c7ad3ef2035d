"""`fivefold simulate`: its arguments, and the reports of a simulated training step (sim/step.py, with
--config / --gpus) or of one simulated collective (sim/collective.py, with --ranks).

Imports nothing heavy at module level: the CLI builds its --help from this module without torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from fivefold.errors import ConfigError
from fivefold.plan.efficiency import add_efficiency_arguments, efficiency_from
from fivefold.units import parse_bytes
from fivefold.sim.names import COLLECTIVE_ALGORITHMS, CONGESTION, FIDELITIES, PLACEMENTS, ROUTINGS, TOPOLOGY_KINDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    collectives = sorted(COLLECTIVE_ALGORITHMS)
    algorithms = sorted({a for names in COLLECTIVE_ALGORITHMS.values() for a in names} | {"native"})
    parser.add_argument("--cluster", required=True, help="a preset (a100-80gb, h100-sxm, h200, b200) or a cluster TOML "
                                                        "file; its [topology] table describes the fabric")
    step = parser.add_argument_group("a training step (--gpus; --config and --section.key overrides as for train)")
    step.add_argument("--config", help="the TOML config `train` would run (its model, batch and layout)")
    step.add_argument("--gpus", type=int, help="accelerators the step runs on")
    add_efficiency_arguments(step)  # the planner's compute model
    step.add_argument("--fidelity", default="hybrid", choices=FIDELITIES,
                      help="flow: every collective as messages; hybrid: collectives inside a node by formula; "
                           "aggregate: also a ring between nodes as one flow per rank (for a thousand GPUs); "
                           "analytical: all by formula, one rank per pipeline stage (for tens of thousands of GPUs)")
    step.add_argument("--vocab-size", type=int, default=0, help="for a model whose vocabulary comes from the tokenizer")
    step.add_argument("--plot", help="draw the simulated timeline of the first ranks (PNG)")
    step.add_argument("--expert-load", metavar="RUN",
                      help="a MoE run's folder or metrics.jsonl: its measured routing (each expert-parallel position's "
                           "load, moe_load_by_ep_rank, or else moe_load; last 10 logged steps) routes the rows "
                           "unevenly, as they went in that run (default: balanced routing)")
    one = parser.add_argument_group("one collective (--ranks)")
    one.add_argument("--collective", default="all_reduce", choices=collectives)
    one.add_argument("--algorithm", default="ring", choices=algorithms,
                     help="the runtime's algorithm (comm/); native = the backend's, modelled as a ring")
    one.add_argument("--ranks", type=int, help="ranks taking part")
    one.add_argument("--stride", type=int, default=1,
                     help="accelerators between consecutive members (8 on 8-GPU nodes: one rank per node)")
    one.add_argument("--bytes", default="256M", help="bytes per rank (the whole vector), e.g. 64M, 1G")
    one.add_argument("--node-size", type=int, default=0, help="hierarchical: ranks per node (default: per node)")
    one.add_argument("--jobs", type=int, default=1,
                     help="jobs running the same collective at once on their own accelerators (sharing the fabric)")
    one.add_argument("--placement", default="packed", choices=PLACEMENTS,
                     help="packed: each job on a contiguous block; interleaved: the jobs take --stride slots in turn")
    parser.add_argument("--topology", choices=TOPOLOGY_KINDS, help="override the cluster file's topology.kind")
    parser.add_argument("--routing", choices=ROUTINGS, help="override topology.routing")
    parser.add_argument("--oversubscription", type=float, help="override topology.oversubscription")
    parser.add_argument("--nodes-per-leaf", type=int, help="override topology.nodes_per_leaf")
    parser.add_argument("--spines", type=int, help="override topology.spines")
    parser.add_argument("--subflows", type=int, help="override topology.subflows (ecmp_paths)")
    parser.add_argument("--seed", type=int, help="override topology.seed (the ECMP hash)")
    parser.add_argument("--congestion", default="none", choices=CONGESTION,
                        help="none: flows share links max-min fairly at once; aimd: each flow's rate is set by "
                             "additive increase / multiplicative decrease every 10 us (sim/network.py AimdNetwork)")
    parser.add_argument("--trace", help="write the simulated timeline as a Chrome trace (JSON) here")
    parser.add_argument("--top-links", type=int, default=5, help="busiest links to list")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")


def cluster_with_overrides(args: argparse.Namespace):
    """The --cluster preset or file, with the command line's topology overrides applied."""
    from fivefold.plan.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    overrides = {key: value for key, value in (
        ("kind", args.topology), ("routing", args.routing), ("oversubscription", args.oversubscription),
        ("nodes_per_leaf", args.nodes_per_leaf), ("spines", args.spines), ("subflows", args.subflows),
        ("seed", args.seed)) if value is not None}
    return replace(cluster, topology=replace(cluster.topology, **overrides)) if overrides else cluster


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """`fivefold simulate`: a training step with --gpus, one collective with --ranks."""
    if args.top_links < 0:
        raise ConfigError(f"--top-links {args.top_links}: must be >= 0")
    for option in ("trace", "plot"):
        path = getattr(args, option)
        if path and not Path(path).resolve().parent.is_dir():
            raise ConfigError(f"--{option} {path}: its folder does not exist; create it or write it elsewhere")
    if (args.gpus is None) == (args.ranks is None):
        raise ConfigError("give --gpus N (and --config) to simulate a training step, or --ranks N to simulate one "
                          "collective")
    if args.ranks is not None and (args.config or overrides or args.expert_load):
        raise ConfigError("--config, --expert-load and --section.key overrides describe a training step: use --gpus, "
                          "not --ranks")
    if args.gpus is not None and (args.jobs != 1 or args.placement != "packed"):
        raise ConfigError("--jobs and --placement place several jobs' collectives (--ranks); a simulated step "
                          "(--gpus) is one job")
    if args.gpus is not None:
        return run_step(args, overrides or [])
    return run_collective(args)


def _write_trace(result, path: str) -> None:
    try:
        result.write_chrome_trace(path)
    except OSError as exc:
        raise ConfigError(f"--trace {path}: cannot write it ({exc.strerror})") from exc


def run_step(args: argparse.Namespace, overrides: list[str]) -> int:
    from fivefold.config import load_config
    from fivefold.plan.estimate import model_for
    from fivefold.plan.gemms import core_narrowest, routed_narrowest
    from fivefold.plan.expert_load import describe_routing, load_positions
    from fivefold.sim.step import PHASES, simulate_step

    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: must be a positive number of accelerators")
    config = load_config(args.config, overrides)
    cluster = cluster_with_overrides(args)
    efficiency = efficiency_from(args)
    load = None
    if args.expert_load:
        from fivefold.parallel.expert_placement import routing_from_metrics

        load = routing_from_metrics(args.expert_load)
    run_ = simulate_step(config, args.gpus, cluster, efficiency, args.fidelity, args.vocab_size,
                         record_spans=bool(args.trace or args.plot), congestion=args.congestion, expert_load=load)
    phases = run_.breakdown()
    links = run_.link_utilisation()
    work, spec = run_.workload, cluster.topology
    model = model_for(config, args.vocab_size)
    summary = {
        "gpus": args.gpus, "layout": work.degrees.describe(), "cluster": cluster.name, "topology": spec.kind,
        "fabric": run_.topology.describe(), "routing": spec.routing, "fidelity": args.fidelity,
        "congestion": args.congestion,
        "efficiency": efficiency.matmul, "attention_efficiency": efficiency.core_share(core_narrowest(model)),
        "expert_efficiency": efficiency.expert_share(routed_narrowest(model, work.degrees.etp)) if model.n_experts
        else efficiency.experts or efficiency.matmul, "half_width": efficiency.half_width,
        "seconds": run_.time,
        "phases_seconds": phases, "expert_load": args.expert_load or "balanced",
        "expert_imbalance": work.expert_imbalance, "expert_load_positions": load_positions(load) if load else 0,
        "slowest_rank": run_.slowest_rank, "simulated_ranks": len(work.simulated),
        "collectives_as_messages": work.recorded, "collectives_by_formula": work.analytical,
        "bytes_sent": sum(run_.result.pair_bytes.values()), "busiest_links": links[:args.top_links],
        "build_wall_seconds": run_.build_seconds, "simulation_wall_seconds": run_.simulate_seconds,
        "priority_slices": len(work.slices), "priority_order_simulations": run_.order_passes,
    }
    if args.trace:
        _write_trace(run_.result, args.trace)
    if args.plot:
        plot_timeline(run_, args.plot)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"one step of {work.degrees.describe()} on {args.gpus} x {cluster.accelerator.name} ({cluster.name}), "
          f"fidelity {args.fidelity}, efficiency {efficiency.describe()}")
    print(f"  fabric       {run_.topology.describe()}; routing {spec.routing}")
    print(f"  step         {run_.time * 1e3:.3f} ms   (slowest rank {run_.slowest_rank}; "
          f"{len(work.simulated)} ranks simulated)")
    if args.expert_load:
        print(f"  experts      routed as measured in {args.expert_load} ({describe_routing(load)}): the busiest "
              f"expert-parallel rank receives {work.expert_imbalance:.2f} x the mean rows")
    if work.slices:
        print(f"  priority     {len(work.slices)} gradient slices reduced in the order the runtime's rule picks (found in "
              f"{run_.order_passes} simulation(s)); the second of two steps reported")
    for phase in PHASES:
        if phases[phase] > 0:
            print(f"    {phase:<11}{phases[phase] * 1e3:12.3f} ms {phases[phase] / run_.time:7.1%}")
    print(f"  collectives  {work.recorded} as messages, {work.analytical} by formula; "
          f"{sum(run_.result.pair_bytes.values()) / 2**20:.1f} MiB sent point to point")
    if links:
        print(f"  links        {len(links)} used; busiest:")
        for name, utilisation in links[:args.top_links]:
            print(f"    {name:<28} {utilisation:6.1%}")
    for option, what in (("trace", "chrome://tracing or ui.perfetto.dev"), ("plot", "timeline")):
        if getattr(args, option):
            print(f"  {option:<12} {getattr(args, option)} ({what})")
    print(f"RESULT name=simulate_step gpus={args.gpus} fidelity={args.fidelity} seconds={run_.time:.6g} "
          + " ".join(f"{phase}={phases[phase]:.6g}" for phase in PHASES)
          + f" wall_seconds={run_.build_seconds + run_.simulate_seconds:.3f}")
    return 0


def plot_timeline(run_, path: str, ranks: int = 16) -> Path:
    """The compute stream of the first `ranks` simulated ranks, one row each, coloured by phase."""
    from fivefold.plotting import pyplot, save_figure
    from fivefold.sim.workload import COMPUTE

    plt = pyplot()
    colours = {"forward": "tab:blue", "backward": "tab:green", "recompute": "tab:olive", "optimizer": "tab:purple",
               "offload": "tab:pink", "tp": "tab:orange", "cp": "tab:brown", "ep": "tab:cyan", "dp": "tab:red",
               "pp": "tab:gray"}
    shown = list(run_.workload.simulated[:ranks])
    row = {rank: i for i, rank in enumerate(shown)}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(shown) + 1.6))
    for span in run_.result.spans:
        if span.stream == COMPUTE and span.rank in row:
            ax.barh(row[span.rank], (span.end - span.start) * 1e3, left=span.start * 1e3, height=0.8,
                    color=colours.get(span.label, "lightgray"), linewidth=0)
    ax.set_yticks(range(len(shown)), [f"rank {r}" for r in shown])
    ax.invert_yaxis()
    ax.set_xlabel("simulated time (ms)")
    ax.set_title(f"simulated step: {run_.workload.degrees.describe()}, {run_.time * 1e3:.2f} ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, [f"{k} (waiting)" if k in ("tp", "cp", "ep", "dp", "pp") else k for k in colours],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return save_figure(fig, path)


def run_collective(args: argparse.Namespace) -> int:
    from fivefold.sim.collective import simulate_collective

    nbytes = parse_bytes(args.bytes)
    cluster = cluster_with_overrides(args)
    run_ = simulate_collective(cluster, args.collective, args.algorithm, args.ranks, nbytes, args.stride,
                               args.node_size, record_spans=bool(args.trace), jobs=args.jobs, placement=args.placement,
                               congestion=args.congestion)
    links = run_.link_utilisation()
    mean = sum(u for _, u in links) / len(links) if links else 0.0
    spec = cluster.topology
    summary = {
        "collective": args.collective, "algorithm": run_.algorithm, "ranks": args.ranks, "stride": args.stride,
        "bytes": run_.nbytes, "cluster": cluster.name, "topology": spec.kind, "fabric": run_.topology.describe(),
        "routing": spec.routing, "subflows": spec.subflows, "seed": spec.seed, "congestion": args.congestion,
        "oversubscription": spec.oversubscription, "seconds": run_.time, "formula_seconds": run_.formula,
        "busbw_gbs": run_.bus_bandwidth() / 1e9, "busiest_links": links[:args.top_links],
        "mean_link_utilisation": mean, "bytes_sent": sum(run_.result.pair_bytes.values()),
        "simulation_wall_seconds": run_.wall_seconds, "jobs": args.jobs, "placement": args.placement,
        "job_seconds": run_.job_times, "alone_seconds": run_.alone,
    }
    if args.trace:
        _write_trace(run_.result, args.trace)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    ratio = run_.time / run_.formula if run_.formula == run_.formula and run_.formula > 0 else float("nan")
    print(f"{args.collective}/{args.algorithm}: {run_.nbytes / 2**20:.1f} MiB per rank over {args.ranks} ranks "
          f"(stride {args.stride}) on {cluster.name}")
    print(f"  fabric       {run_.topology.describe()}; routing {spec.routing}, oversubscription {spec.oversubscription:g}")
    print(f"  simulated    {run_.time * 1e3:.3f} ms   bus bandwidth {run_.bus_bandwidth() / 1e9:.1f} GB/s")
    print(f"  alpha-beta   {run_.formula * 1e3:.3f} ms   (comm/cost.py, no contention)   simulated / formula {ratio:.3f}")
    if args.jobs > 1:
        times = ", ".join(f"{t * 1e3:.3f}" for t in run_.job_times)
        print(f"  jobs         {args.jobs} {args.placement}: {times} ms; alone {run_.alone * 1e3:.3f} ms, "
              f"slowest {max(run_.job_times) / run_.alone:.2f}x alone")
    print(f"  links        {len(links)} used, mean utilisation {mean:.0%}; busiest:")
    for name, utilisation in links[:args.top_links]:
        print(f"    {name:<28} {utilisation:6.1%}")
    if args.trace:
        print(f"  trace        {args.trace} (chrome://tracing or ui.perfetto.dev)")
    print(f"RESULT name=simulate collective={args.collective} algorithm={args.algorithm} ranks={args.ranks} "
          f"seconds={run_.time:.6g} formula_seconds={run_.formula:.6g} ratio={ratio:.4f} "
          f"jobs={args.jobs} alone_seconds={run_.alone:.6g} wall_seconds={run_.wall_seconds:.3f}")
    return 0
