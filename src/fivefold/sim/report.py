"""`fivefold simulate`: its arguments, and the report of one simulated collective (sim/collective.py).

Imports nothing heavy at module level: the CLI builds its --help from this module without torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from fivefold.errors import ConfigError
from fivefold.units import parse_bytes
from fivefold.sim.names import COLLECTIVE_ALGORITHMS, ROUTINGS, TOPOLOGY_KINDS

def add_arguments(parser: argparse.ArgumentParser) -> None:
    collectives = sorted(COLLECTIVE_ALGORITHMS)
    algorithms = sorted({a for names in COLLECTIVE_ALGORITHMS.values() for a in names} | {"native"})
    parser.add_argument("--cluster", required=True, help="a preset (a100-80gb, h100-sxm, h200, b200) or a cluster TOML "
                                                        "file; its [topology] table describes the fabric")
    parser.add_argument("--collective", default="all_reduce", choices=collectives)
    parser.add_argument("--algorithm", default="ring", choices=algorithms,
                        help="the runtime's algorithm (comm/); native = the backend's, modelled as a ring")
    parser.add_argument("--ranks", type=int, required=True, help="ranks taking part")
    parser.add_argument("--stride", type=int, default=1,
                        help="accelerators between consecutive members (8 on 8-GPU nodes: one rank per node)")
    parser.add_argument("--bytes", default="256M", help="bytes per rank (the whole vector), e.g. 64M, 1G")
    parser.add_argument("--node-size", type=int, default=0, help="hierarchical: ranks per node (default: per node)")
    parser.add_argument("--topology", choices=TOPOLOGY_KINDS, help="override the cluster file's topology.kind")
    parser.add_argument("--routing", choices=ROUTINGS, help="override topology.routing")
    parser.add_argument("--oversubscription", type=float, help="override topology.oversubscription")
    parser.add_argument("--nodes-per-leaf", type=int, help="override topology.nodes_per_leaf")
    parser.add_argument("--spines", type=int, help="override topology.spines")
    parser.add_argument("--subflows", type=int, help="override topology.subflows (ecmp_paths)")
    parser.add_argument("--seed", type=int, help="override topology.seed (the ECMP hash)")
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


def run(args: argparse.Namespace) -> int:
    from fivefold.sim.collective import simulate_collective

    if args.top_links < 0:
        raise ConfigError(f"--top-links {args.top_links}: must be >= 0")
    if args.trace and not Path(args.trace).resolve().parent.is_dir():
        raise ConfigError(f"--trace {args.trace}: its folder does not exist; create it or write the trace elsewhere")
    nbytes = parse_bytes(args.bytes)
    cluster = cluster_with_overrides(args)
    run_ = simulate_collective(cluster, args.collective, args.algorithm, args.ranks, nbytes, args.stride,
                               args.node_size, record_spans=bool(args.trace))
    links = run_.link_utilisation()
    mean = sum(u for _, u in links) / len(links) if links else 0.0
    spec = cluster.topology
    summary = {
        "collective": args.collective, "algorithm": run_.algorithm, "ranks": args.ranks, "stride": args.stride,
        "bytes": run_.nbytes, "cluster": cluster.name, "topology": spec.kind, "fabric": run_.topology.describe(),
        "routing": spec.routing, "subflows": spec.subflows, "seed": spec.seed,
        "oversubscription": spec.oversubscription, "seconds": run_.time, "formula_seconds": run_.formula,
        "busbw_gbs": run_.bus_bandwidth() / 1e9, "busiest_links": links[:args.top_links],
        "mean_link_utilisation": mean, "bytes_sent": sum(run_.result.pair_bytes.values()),
        "simulation_wall_seconds": run_.wall_seconds,
    }
    if args.trace:
        try:
            run_.result.write_chrome_trace(args.trace)
        except OSError as exc:
            raise ConfigError(f"--trace {args.trace}: cannot write it ({exc.strerror})") from exc
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    ratio = run_.time / run_.formula if run_.formula == run_.formula and run_.formula > 0 else float("nan")
    print(f"{args.collective}/{args.algorithm}: {run_.nbytes / 2**20:.1f} MiB per rank over {args.ranks} ranks "
          f"(stride {args.stride}) on {cluster.name}")
    print(f"  fabric       {run_.topology.describe()}; routing {spec.routing}, oversubscription {spec.oversubscription:g}")
    print(f"  simulated    {run_.time * 1e3:.3f} ms   bus bandwidth {run_.bus_bandwidth() / 1e9:.1f} GB/s")
    print(f"  alpha-beta   {run_.formula * 1e3:.3f} ms   (comm/cost.py, no contention)   simulated / formula {ratio:.3f}")
    print(f"  links        {len(links)} used, mean utilisation {mean:.0%}; busiest:")
    for name, utilisation in links[:args.top_links]:
        print(f"    {name:<28} {utilisation:6.1%}")
    if args.trace:
        print(f"  trace        {args.trace} (chrome://tracing or ui.perfetto.dev)")
    print(f"RESULT name=simulate collective={args.collective} algorithm={args.algorithm} ranks={args.ranks} "
          f"seconds={run_.time:.6g} formula_seconds={run_.formula:.6g} ratio={ratio:.4f} "
          f"wall_seconds={run_.wall_seconds:.3f}")
    return 0
