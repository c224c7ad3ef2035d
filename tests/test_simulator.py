"""The cluster simulator (sim/): max-min fairness, routing, ECMP collisions, and the runtime's collectives.

On a contention-free fabric (one NVSwitch, every rank its own full-duplex link) the simulated time
of every collective the runtime implements equals comm/cost.py's alpha-beta formula to 1e-9: the
engine, the network and the recorded programs agree with the model the planner uses. On shared
fabrics the simulator shows what the formula cannot: 8 elephant flows hashed by ECMP over 4 equal
paths reach, on average, 4 (1 - (3/4)^8) = 3.6 paths' worth of bandwidth, and finish when the most
loaded path drains.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from fivefold.comm import cost
from fivefold.errors import ConfigError
from fivefold.plan.cluster import PRESETS, cluster_from_dict, cluster_toml, load_cluster
from fivefold.sim.collective import simulate_collective
from fivefold.units import parse_bytes
from fivefold.sim.engine import Await, Compute, Notify, Recv, Send, SimulationError, Wait, simulate
from fivefold.sim.network import FlowNetwork, max_min_rates
from fivefold.sim.routing import Router
from fivefold.sim.topology import fat_tree, nvswitch, rail_optimized, torus_2d
from fivefold.sim.names import COLLECTIVE_ALGORITHMS
from fivefold.sim.trace import ALGORITHMS, as_streams, collective_programs

B = 100e9  # bytes/s
ALPHA = 10e-6


def _rates(routes, capacity):
    flow_of = np.array([f for f, route in enumerate(routes) for _ in route])
    link_of = np.array([link for route in routes for link, _ in route])
    weight = np.array([w for route in routes for _, w in route], dtype=float)
    return max_min_rates(flow_of, link_of, weight, np.array(capacity, dtype=float), len(routes))


def test_max_min_fair_rates():
    # Bertsekas & Gallager's example: f0 crosses both links, f1 only link 0, f2 only link 1.
    assert _rates([[(0, 1), (1, 1)], [(0, 1)], [(1, 1)]], [1, 1]) == pytest.approx([0.5, 0.5, 0.5])
    # A flow left alone on a big link takes what the others leave.
    assert _rates([[(0, 1)], [(0, 1), (1, 1)], [(1, 1)]], [1, 10]) == pytest.approx([0.5, 0.5, 9.5])
    # A sprayed flow (half its rate on each of links 0 and 1) beside an ECMP flow on link 0.
    assert _rates([[(0, 0.5), (1, 0.5)], [(0, 1)]], [1, 1]) == pytest.approx([2 / 3, 2 / 3])



class _WholeRecompute(FlowNetwork):
    """Max-min rates of every flow at every start and end, as the network computed them before components."""

    def _update_rates(self, touched=None) -> None:
        super()._update_rates(None)


@pytest.mark.parametrize("routing", ["ecmp", "spray"])
def test_rates_recomputed_per_component_are_every_flows_rates(routing):
    """A flow's start or end changes only the rates of the flows connected to it through shared links (max-min
    fairness splits over the components of the flow-link graph), so the network recomputes only those: 300
    random messages over a 2:1 oversubscribed fat tree of 8 nodes are delivered at the same times, in the same
    order, carrying the same bytes per link, as when every flow is recomputed every time."""
    rng = np.random.default_rng(7)
    topology = fat_tree(8, 4, 100e9, 2e-6, 25e9, 5e-6, nodes_per_leaf=2, oversubscription=2.0)
    runs = []
    for network in (FlowNetwork(Router(topology, routing)), _WholeRecompute(Router(topology, routing))):
        pending = sorted((float(rng.uniform(0, 2e-3)), int(a), int(b), float(rng.uniform(1e3, 4e6)))
                         for a, b in rng.integers(0, 32, size=(300, 2)) if a != b)
        rng = np.random.default_rng(7)  # the second network gets the same messages
        delivered, queue = [], list(pending)
        while queue or network.busy:
            t = min(network.next_event(), queue[0][0] if queue else float("inf"))
            delivered += [(m, t) for m in network.advance(t)]
            while queue and queue[0][0] <= network.now:
                _, a, b, nbytes = queue.pop(0)
                network.send(a, b, nbytes)
        runs.append((delivered, network.link_bytes.copy()))
    (mine, bytes_mine), (whole, bytes_whole) = runs
    assert [m for m, _ in mine] == [m for m, _ in whole] and len(mine) == len(pending)
    assert [t for _, t in mine] == pytest.approx([t for _, t in whole], rel=1e-9)
    assert bytes_mine == pytest.approx(bytes_whole, rel=1e-9)

def test_lone_message_costs_alpha_plus_n_beta():
    network = FlowNetwork(Router(nvswitch(2, B, ALPHA)))
    message = network.send(0, 1, 1e6)
    t = network.next_event()
    assert network.advance(t) == [] and t == pytest.approx(ALPHA)  # the latency, then the transfer starts
    t = network.next_event()
    assert network.advance(t) == [message] and t == pytest.approx(ALPHA + 1e6 / B)
    assert sum(network.link_bytes) == pytest.approx(2e6)  # two links of one route


CONTENTION_FREE = [
    ("all_reduce", "ring", 8), ("all_reduce", "ring", 6), ("all_reduce", "halving_doubling", 8),
    ("all_reduce", "rabenseifner", 8), ("all_reduce", "butterfly", 8), ("all_reduce", "halving_doubling", 6),
    ("all_reduce", "butterfly", 6), ("all_reduce", "hierarchical", 8), ("all_reduce", "torus", 8),
    ("reduce_scatter", "ring", 8), ("reduce_scatter", "recursive", 8), ("all_gather", "ring", 8),
    ("all_gather", "recursive", 8), ("all_to_all", "pairwise", 8),
]


@pytest.mark.parametrize("collective,algorithm,p", CONTENTION_FREE)
def test_contention_free_fabric_reproduces_the_cost_formulas(collective, algorithm, p):
    nbytes = 4 * 840 * 64  # divisible by every p and node size here
    programs = collective_programs(collective, algorithm, range(p), nbytes, node_size=4)
    result = simulate(as_streams(programs), FlowNetwork(Router(nvswitch(p, B, ALPHA))))
    link = cost.Link(ALPHA, 1 / B)
    if algorithm == "hierarchical":
        expected = cost.two_level(nbytes, p, 4, link, link)
    else:
        expected = cost.predict_collective(collective, "ring" if algorithm == "pairwise" else algorithm, nbytes, p,
                                           cost.Cluster(link, link, p))
    assert result.time == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("collective,algorithm,p", [("all_reduce", "ring", 8), ("all_reduce", "halving_doubling", 6),
                                                    ("all_reduce", "butterfly", 8), ("all_reduce", "hierarchical", 8),
                                                    ("all_reduce", "tree", 8), ("all_reduce", "double_tree", 6),
                                                    ("reduce_scatter", "recursive", 8), ("all_to_all", "pairwise", 4)])
def test_recorded_programs_send_what_the_cost_model_counts(collective, algorithm, p):
    """Busiest rank's messages and bytes = cost.traffic, which tests/distributed/test_collective_traffic.py
    checks against the runtime's counted sends: the recorded programs are the runtime's messages."""
    nbytes = 4 * 840 * 160
    programs = collective_programs(collective, algorithm, range(p), nbytes, node_size=4)
    sends = [[op for op in ops if isinstance(op, Send)] for ops in programs.values()]
    busiest = max((sum(op.nbytes for op in ops), len(ops)) for ops in sends)
    messages, sent = cost.traffic(collective, algorithm, nbytes, p, node_size=4)
    assert busiest == (sent, messages)


def test_where_the_formulas_are_optimistic():
    """Two gaps the simulator exposes (docs/simulator.md).

    The binomial broadcast posts all of a rank's sends at once, so they share its link: on 8 ranks
    the root's three messages take 3 n beta together, rank 1 then feeds ranks 3 and 5 at once
    (2 n beta more) and rank 3 feeds rank 7 (n beta): 3 alpha + 6 n beta, not 3 (alpha + n beta).
    The runtime's tree walks (up chunk c, down chunk c - lag) in lock step, so each iteration waits
    for a round trip through the tree, where cost.tree assumes perfect pipelining."""
    link = cost.Link(ALPHA, 1 / B)
    n = 4 * 840 * 64
    result = simulate(as_streams(collective_programs("broadcast", "binomial", range(8), n)),
                      FlowNetwork(Router(nvswitch(8, B, ALPHA))))
    assert result.time == pytest.approx(3 * ALPHA + 6 * n / B, rel=1e-9)
    assert cost.broadcast("binomial", n, 8, link) == pytest.approx(3 * (ALPHA + n / B))
    p, nbytes = 8, 8 * 2**20
    result = simulate(as_streams(collective_programs("all_reduce", "tree", range(p), nbytes)),
                      FlowNetwork(Router(nvswitch(p, B, ALPHA))))
    assert result.time > 3 * cost.tree(nbytes, p, link)


# ------------------------------------------------------------------------------ ECMP collisions
def _elephants(policy: str, seed: int, subflows: int = 4):
    """8 flows from the 8 hosts of leaf 0 to the 8 of leaf 1, over 4 spines, every link B."""
    topology = fat_tree(16, 1, B, 0, B, 0, nodes_per_leaf=8, spines=4, oversubscription=2)
    router = Router(topology, policy, subflows, seed)
    network = FlowNetwork(router)
    size = 1e9
    for i in range(8):
        network.send(i, 8 + i, size, key=("elephant", i))
    network.advance(network.next_event())  # start the transfers (latency 0)
    initial = sum(network.rates().values())
    spines = [next(topology.vertex_names[topology.links[link].target] for link, _ in router.route(i, 8 + i, ("elephant", i))
                   if "spine" in topology.vertex_names[topology.links[link].target]) for i in range(8)] \
        if policy == "ecmp" else []
    while network.busy:
        network.advance(network.next_event())
    return initial, network.now, spines, size


def test_ecmp_collisions_of_eight_elephants_on_four_paths():
    distinct, makespans = [], []
    for seed in range(300):
        initial, makespan, spines, size = _elephants("ecmp", seed)
        loads = [spines.count(s) for s in set(spines)]
        # Each path's flows share its uplink: the aggregate is B per path in use, and the job ends
        # when the most loaded path drains.
        assert initial == pytest.approx(B * len(loads), rel=1e-9)
        assert makespan == pytest.approx(max(loads) * size / B, rel=1e-9)
        distinct.append(len(loads))
        makespans.append(max(loads))
    # Against the exact expectations of 8 flows hashed uniformly onto 4 paths.
    expected_distinct = 4 * (1 - (3 / 4) ** 8)  # 3.5995
    loads = [max(assignment.count(j) for j in range(4)) for assignment in itertools.product(range(4), repeat=8)]
    expected_max = sum(loads) / len(loads)  # 3.0 paths' worth of time, about
    assert np.mean(distinct) == pytest.approx(expected_distinct, abs=0.1)
    assert np.mean(makespans) == pytest.approx(expected_max, abs=0.15)


def test_two_jobs_share_an_oversubscribed_uplink_only_when_interleaved():
    """Two 2-rank ring all-reduces, one rank per node, on 4 nodes under 2 leaves whose single spine uplink runs at
    NIC speed (16:1). Packed, each job stays under its own leaf and takes exactly its time alone; interleaved,
    both jobs' flows cross the same uplinks, each gets half of them, and its bandwidth term doubles: the time
    alone plus the bandwidth share again (2x alone but for the latency, which is not shared)."""
    h100 = PRESETS["h100-sxm"]
    thin = dataclasses.replace(h100, topology=dataclasses.replace(h100.topology, nodes_per_leaf=2, oversubscription=16))
    nbytes = 256 << 20
    packed = simulate_collective(thin, "all_reduce", "ring", 2, nbytes, 8, jobs=2, placement="packed")
    assert packed.job_members == [(0, 8), (16, 24)]
    assert packed.job_times == pytest.approx([packed.alone] * 2, rel=1e-9)
    interleaved = simulate_collective(thin, "all_reduce", "ring", 2, nbytes, 8, jobs=2, placement="interleaved")
    assert interleaved.job_members == [(0, 16), (8, 24)]
    alone = interleaved.alone
    latency = alone - nbytes / h100.inter.bandwidth_gbs / 1e9  # 2 steps of half the vector at NIC speed
    assert 0 < latency < 0.01 * alone
    assert interleaved.job_times == pytest.approx([2 * alone - latency] * 2, rel=1e-3)
    single = simulate_collective(thin, "all_reduce", "ring", 2, nbytes, 16)
    assert single.time == pytest.approx(alone, rel=1e-9)  # alone is the job by itself on the same nodes


def test_aimd_one_flow_averages_three_quarters_of_its_link():
    """Chiu and Jain's AIMD alone on a link: the rate climbs from half the link to all of it by 1% per interval,
    halves when it overshoots, and so averages (1 + 1/2) / 2 = 3/4 of the link; max-min gives the whole link."""
    from fivefold.sim.network import AimdNetwork

    def transfer(network) -> float:
        programs = {(0, "c"): [Send(1, 1e9, 0), Wait((0,))], (1, "c"): [Recv(0, 1e9, 0), Wait((0,))]}
        return simulate(programs, network).time

    router = Router(nvswitch(2, 1e9, 0.0))
    assert transfer(FlowNetwork(router)) == pytest.approx(1.0, rel=1e-9)
    assert transfer(AimdNetwork(router, interval=1e-3, increase=0.01)) == pytest.approx(4 / 3, rel=2e-3)


def test_aimd_flows_sharing_a_link_converge_to_equal_rates():
    """A flow that starts while another holds the link starts slower; each overshoot halves both rates, and so
    the gap between them, while additive increase keeps it: the rates become equal (Chiu and Jain 1989)."""
    from fivefold.sim.network import AimdNetwork

    network = AimdNetwork(Router(nvswitch(3, 1e9, 0.0)), interval=1e-3, increase=0.01)
    first = network.send(0, 2, 10e9)

    def run_until(t: float) -> dict[int, float]:
        while network.next_event() < t:
            network.advance(network.next_event())
        network.advance(t)
        return network.rates()

    run_until(0.3)
    second = network.send(1, 2, 10e9)
    early = run_until(0.31)
    assert early[first] > 1.5 * early[second]
    late = run_until(1.0)
    assert late[first] == pytest.approx(late[second], rel=1e-6)
    assert late[first] + late[second] <= 1e9 * (1 + 1e-9)


def test_spraying_and_path_variation_beat_flow_hashing():
    _, makespan, _, size = _elephants("spray", 0)
    assert makespan == pytest.approx(2 * size / B, rel=1e-9)  # perfectly balanced: 2 flows' worth per path
    ecmp = np.mean([_elephants("ecmp", seed)[1] for seed in range(40)])
    varied = np.mean([_elephants("ecmp_paths", seed, subflows=4)[1] for seed in range(40)])
    assert 2 * size / B < varied < ecmp


# ------------------------------------------------------------------------------ topologies
def _hops(topology, source, destination):
    return [topology.vertex_names[topology.links[link].target] for link, _ in Router(topology).route(source, destination, 0)]


def test_routes_take_nvlink_inside_a_node_and_the_fabric_across():
    tree = fat_tree(4, 8, 450e9, 3e-6, 50e9, 6e-6, nodes_per_leaf=2)
    assert _hops(tree, 0, 7) == ["node0.nvswitch", "gpu7"]
    assert _hops(tree, 0, 8) == ["leaf0", "gpu8"]  # same leaf
    hops = _hops(tree, 0, 31)
    assert len(hops) == 4 and hops[0] == "leaf0" and hops[1].startswith("spine") and hops[2] == "leaf1"
    rail = rail_optimized(8, 8, 450e9, 3e-6, 50e9, 6e-6, nodes_per_rail_group=4)
    assert _hops(rail, 3, 11) == ["group0.rail3", "gpu11"]  # same rail, same group: one switch
    assert _hops(rail, 3, 12)[1].startswith("spine")  # another rail: through a spine
    torus = torus_2d(4, 4, 100e9, 1e-6)
    assert len(_hops(torus, 0, 10)) == 4  # (2, 2) away on a 4 x 4 torus
    assert len(_hops(torus, 0, 3)) == 1  # wrap-around neighbour


def test_oversubscription_thins_the_uplinks():
    full, thin = (fat_tree(8, 8, 450e9, 0, 50e9, 0, nodes_per_leaf=2, oversubscription=o) for o in (1, 4))
    uplinks = [sum(link.bandwidth for link in t.links if t.vertex_names[link.source] == "leaf0"
                   and "spine" in t.vertex_names[link.target]) for t in (full, thin)]
    assert uplinks == [16 * 50e9, 4 * 50e9]


# ------------------------------------------------------------------------------ engine
def test_engine_orders_streams_and_reports_deadlocks():
    programs = {
        (0, "compute"): [Compute(1.0), Notify("grads"), Compute(2.0)],
        (0, "comm"): [Await("grads"), Send(1, 1000, 0), Wait((0,))],
        (1, "comm"): [Recv(0, 1000, 0), Wait((0,)), Compute(0.5)],
    }
    result = simulate(programs, FlowNetwork(Router(nvswitch(2, 1e3, 0.0))))
    assert result.finish[(0, "comm")] == pytest.approx(2.0)  # waited 1 s for the gradients, then 1 s on the wire
    assert result.finish[(1, "comm")] == pytest.approx(2.5)
    assert result.time == pytest.approx(3.0)
    assert result.pair_bytes == {(0, 1): 1000}
    trace = result.chrome_trace()
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"compute", "comm", "await grads"}
    json.dumps(trace)
    with pytest.raises(SimulationError, match="deadlock"):
        simulate({(0, "comm"): [Recv(1, 8, 0), Wait((0,))], (1, "comm"): [Compute(1.0)]},
                 FlowNetwork(Router(nvswitch(2, 1e3, 0.0))))


# ------------------------------------------------------------------------------ cluster file and CLI
def test_cluster_file_topology_is_validated_and_round_trips(tmp_path):
    base = PRESETS["h100-sxm"]
    text = cluster_toml(base).replace('kind = "fat_tree"', 'kind = "rail_optimized"')
    path = tmp_path / "c.toml"
    path.write_text(text)
    loaded = load_cluster(str(path))
    assert loaded.topology.kind == "rail_optimized" and loaded == dataclasses.replace(base, topology=loaded.topology,
                                                                                      source=loaded.source)
    good = {k: v for k, v in base.to_dict().items()}
    for bad, message in (({"kind": "dragonfly"}, "topology.kind"), ({"routing": "random"}, "topology.routing"),
                         ({"oversubscription": 0.5}, "oversubscription"), ({"color": 1}, "unknown"),
                         ({"kind": "torus_2d"}, "torus = \\[x, y\\]"), ({"torus": ["a", 1]}, "torus"), ({"routing": "ecmp_paths", "subflows": 1}, "subflows")):
        with pytest.raises(ConfigError, match=message):
            cluster_from_dict({**good, "topology": bad})


def test_simulated_collective_against_its_formula_and_under_contention():
    h100 = PRESETS["h100-sxm"]
    node = simulate_collective(dataclasses.replace(h100, topology=h100.topology.__class__(kind="nvswitch")),
                               "all_reduce", "ring", 8, 2**26)
    assert node.time == pytest.approx(node.formula, rel=1e-9)
    assert node.bus_bandwidth() == pytest.approx(2**26 / node.time * 7 / 4)
    # Two nodes per leaf, uplinks cut 4x: in an all-to-all all 16 GPUs of a leaf send across at once.
    thin = dataclasses.replace(h100, topology=h100.topology.__class__(oversubscription=4, nodes_per_leaf=2))
    crowded = simulate_collective(thin, "all_to_all", "pairwise", 32, 2**26)
    assert crowded.time > 2 * crowded.formula
    ring = simulate_collective(thin, "all_reduce", "ring", 32, 2**26)  # one ring flow leaves each leaf
    assert ring.time == pytest.approx(ring.formula, rel=0.05)


def test_parse_bytes():
    assert parse_bytes("4096") == 4096 and parse_bytes("64M") == 64 * 2**20 and parse_bytes("1GiB") == 2**30
    for bad in ("lots", "nan", "inf", "0", "-5", "1e9"):
        with pytest.raises(ConfigError, match="--bytes"):
            parse_bytes(bad)


def test_simulate_cli(tmp_path, capsys):
    from fivefold.cli import main

    trace = tmp_path / "t.json"
    assert main(["simulate", "--cluster", "h100-sxm", "--topology", "nvswitch", "--ranks", "8", "--bytes", "64M",
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "ratio=1.0000" in out and "RESULT name=simulate" in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert main(["simulate", "--cluster", "h100-sxm", "--ranks", "9", "--bytes", "1M"]) == 2
    assert "whole nodes" in capsys.readouterr().err
    assert main(["simulate", "--cluster", "h100-sxm", "--ranks", "16", "--bytes", "1M", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ranks"] == 16 and math.isfinite(summary["seconds"])


def test_cli_vocabulary_matches_the_recordable_algorithms():
    assert {(c, a) for c, names in COLLECTIVE_ALGORITHMS.items() for a in names} == set(ALGORITHMS)


def _simulate_json(capsys, *argv: str) -> dict:
    from fivefold.cli import main

    assert main(["simulate", "--cluster", "h100-sxm", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_simulate_option_changes_what_is_simulated(capsys):
    one_per_node = ["--ranks", "32", "--stride", "8", "--algorithm", "rabenseifner", "--bytes", "64M"]
    ecmp = _simulate_json(capsys, *one_per_node)
    assert ecmp["fabric"].startswith("fat_tree: 256 accelerators")  # --stride spreads the 32 ranks over 32 nodes
    assert ecmp["seconds"] > 1.3 * ecmp["formula_seconds"]  # ECMP collisions between leaves
    sprayed = _simulate_json(capsys, *one_per_node, "--routing", "spray")
    assert sprayed["seconds"] == pytest.approx(sprayed["formula_seconds"], rel=0.01)
    assert _simulate_json(capsys, *one_per_node, "--seed", "3")["seconds"] != ecmp["seconds"]
    paths = [_simulate_json(capsys, *one_per_node, "--routing", "ecmp_paths", "--subflows", k)["seconds"] for k in "28"]
    assert paths[0] != paths[1]
    assert _simulate_json(capsys, *one_per_node, "--oversubscription", "4")["seconds"] > ecmp["seconds"]
    assert _simulate_json(capsys, *one_per_node, "--nodes-per-leaf", "8", "--spines", "2")["fabric"] == \
        "fat_tree: 256 accelerators, 38 switches, 1040 links"  # 32 NVSwitches + 4 leaves + 2 spines; (256 + 256 + 8) x 2
    rail = _simulate_json(capsys, "--ranks", "16", "--topology", "rail_optimized", "--bytes", "1M", "--top-links", "2")
    assert rail["fabric"].startswith("rail_optimized") and len(rail["busiest_links"]) == 2
    node = ["--ranks", "8", "--topology", "nvswitch", "--algorithm", "hierarchical", "--bytes", "16M"]
    halves, pairs = (_simulate_json(capsys, *node, "--node-size", k) for k in ("4", "2"))
    assert halves["seconds"] != pairs["seconds"]
    assert halves["formula_seconds"] != pairs["formula_seconds"]  # the formula follows --node-size too
    native = _simulate_json(capsys, "--ranks", "8", "--topology", "nvswitch", "--algorithm", "native", "--bytes", "16M")
    assert native["algorithm"] == "ring"
    shared = ["--ranks", "2", "--stride", "8", "--nodes-per-leaf", "2", "--oversubscription", "16", "--jobs", "2"]
    packed, dealt = _simulate_json(capsys, *shared), _simulate_json(capsys, *shared, "--placement", "interleaved")
    assert packed["jobs"] == 2 and len(packed["job_seconds"]) == 2 and packed["placement"] == "packed"
    assert max(dealt["job_seconds"]) > 1.9 * dealt["alone_seconds"] > 1.9 * max(packed["job_seconds"]) / 1.01
    controlled = _simulate_json(capsys, "--ranks", "2", "--stride", "8", "--congestion", "aimd")
    assert controlled["congestion"] == "aimd"
    assert controlled["seconds"] > 1.2 * _simulate_json(capsys, "--ranks", "2", "--stride", "8")["seconds"]


def test_simulate_cli_routes_experts_by_a_runs_measured_load(tmp_path, capsys):
    """--expert-load reads a run's moe_load records (the mean of the last 10 logged steps, as EPLB does)."""
    moe = ["--gpus", "4", "--config", "configs/tiny.toml", "--model.n_experts", "8", "--model.n_layers", "2",
           "--expert_parallel.degree", "4", "--train.seq_len", "128", "--vocab-size", "257"]
    records = [{"step": step, "moe_load": {"0": [8, 1, 1, 1, 1, 1, 1, 1], "1": [1] * 8}} for step in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    balanced = _simulate_json(capsys, *moe)
    measured = _simulate_json(capsys, *moe, "--expert-load", str(tmp_path))
    assert balanced["expert_load"] == "balanced" and balanced["expert_imbalance"] == 1.0
    assert measured["expert_load"] == str(tmp_path) and measured["expert_imbalance"] == pytest.approx(2.4)
    assert measured["seconds"] > balanced["seconds"]
    from fivefold.cli import main

    assert main(["simulate", "--cluster", "h100-sxm", *moe, "--expert-load", str(tmp_path / "none")]) == 2
    assert "--expert-load" in capsys.readouterr().err
    for bad in ("NaN", "Infinity", "-1", '"x"', "true"):  # json reads NaN and Infinity: refused, as is any non-count
        (tmp_path / "metrics.jsonl").write_text('{"moe_load": {"0": [1, 1, 1, 1, 1, 1, 1, %s], "1": [1, 1, 1, 1, 1, 1, '
                                                '1, 1]}}\n' % bad)
        assert main(["simulate", "--cluster", "h100-sxm", *moe, "--expert-load", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "--expert-load" in err and "finite, non-negative counts" in err and err.count("\n") == 1, (bad, err)
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    assert main(["simulate", "--cluster", "h100-sxm", *moe, "--expert-load", str(tmp_path)]) == 2
    assert "cannot read it" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "0"], "--ranks 0"), (["--ranks", "8", "--stride", "0"], "--stride 0"),
    (["--ranks", "8", "--bytes", "nan"], "--bytes"), (["--ranks", "8", "--bytes", "0"], "--bytes"),
    (["--ranks", "8", "--oversubscription", "nan"], "oversubscription"),
    (["--ranks", "8", "--oversubscription", "inf"], "oversubscription"),
    (["--ranks", "8", "--oversubscription", "0.5"], "oversubscription"),
    (["--ranks", "8", "--spines", "-1"], "spines"), (["--ranks", "8", "--subflows", "0"], "subflows"),
    (["--ranks", "8", "--seed", "-1"], "seed"), (["--ranks", "8", "--nodes-per-leaf", "0"], "nodes_per_leaf"),
    (["--ranks", "8", "--node-size", "-1"], "--node-size"), (["--ranks", "8", "--top-links", "-1"], "--top-links"),
    (["--ranks", "8", "--trace", "/no/such/folder/t.json"], "--trace"),
    (["--ranks", "16", "--topology", "nvswitch"], "one node"), (["--ranks", "6", "--topology", "torus_2d"], "torus"),
    (["--ranks", "8", "--collective", "broadcast", "--algorithm", "ring"], "broadcast/ring"),
    (["--ranks", "8", "--cluster", "no-such-cluster"], "--cluster"),
    (["--ranks", "8", "--jobs", "0"], "--jobs 0"), (["--gpus", "2", "--jobs", "2"], "--jobs and --placement"),
    (["--ranks", "8", "--placement", "interleaved"], "give --jobs 2 or more"),
    (["--ranks", "8", "--expert-load", "runs/x"], "use --gpus, not --ranks"),
    (["--gpus", "2", "--fidelity", "analytical", "--congestion", "aimd"], "no shared links"),
])
def test_simulate_rejects_bad_input_in_one_line(argv, message, capsys):
    from fivefold.cli import main

    assert main(["simulate", "--cluster", "h100-sxm", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fivefold: error:") and message in err and err.count("\n") == 1
