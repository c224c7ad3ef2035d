"""The simulator's vocabulary, importable without torch (the CLI builds its --help from it).

Fabric kinds (topology.py), routing policies (routing.py) and the collectives with the runtime
algorithms `fivefold simulate` can record (trace.py `ALGORITHMS`; a test keeps the two equal).
"""

TOPOLOGY_KINDS = ("nvswitch", "fat_tree", "rail_optimized", "torus_2d")
ROUTINGS = ("ecmp", "ecmp_paths", "spray")
FIDELITIES = ("flow", "hybrid", "aggregate", "analytical")  # workload.py: how collectives are simulated
COLLECTIVE_ALGORITHMS = {
    "all_reduce": ("ring", "halving_doubling", "rabenseifner", "butterfly", "tree", "double_tree", "hierarchical",
                   "torus"),
    "reduce_scatter": ("ring", "recursive"),
    "all_gather": ("ring", "recursive"),
    "all_to_all": ("pairwise",),
    "broadcast": ("binomial",),
}
CONGESTION = ("none", "aimd")  # network.py: max-min fair at once, or AIMD rate control
PLACEMENTS = ("packed", "interleaved")  # collective.py: where several jobs' ranks go
