"""A grouped GEMM's fixed cost per expert on this host, measured: the accelerator's `expert_group_us`.

A mixture-of-experts block runs its routed experts as grouped GEMMs (model/moe.py `ExpertKernel`,
`torch._grouped_mm`): one call per projection over every expert a rank holds, each expert multiplying the
rows routed to it. On a GPU that is one kernel whose cost follows its FLOPs. PyTorch's CPU kernel runs one
GEMM per group instead, and each pays a fixed cost beside its FLOPs (preparing that expert's weight slice and
its rows): on this repository's 2-core host some 50-90 us per expert and call at tiny-moe's 256 x 256 experts,
the same at 512 to 2,048 rows and on one thread or two (2026-11-29). So the same routed rows cost more the more
experts a rank holds: the grouped GEMMs of 8 experts ran 1.47x a dense MLP of the same FLOPs on one rank, those
of 2 experts per rank under ep4 1.12x. Neither a FLOP rate nor an operator count (plan/operators.py: one call,
one operator) sees it, and the planner priced ep4's routed work as dearly as one rank's.

`measure_expert_groups` times the runtime's kernel forward and backward over the same rows held by one expert
and by eight (interleaved, so that a slow spell lands on both), and divides the difference by the seven extra
experts and the nine grouped calls of a forward and backward (gate, up and down; backward's two per
projection). The planner adds `expert_group_us` x the experts a rank holds x three to a MoE block's forward
(backward pays twice the forward, as every fixed cost, plan/estimate.py `pass_costs`), under the grouped kernel
only: the loop kernel's per-expert matmuls are operators the count sees. It is measured at tiny-moe's expert
shape (a larger expert's fixed cost was within 30% of it at 512 x 512), stored with the cluster (`fivefold
bench comm --cluster-file`, benchmarks/plan_vs_measured.py) and 0 where not measured (the GPU presets).
"""

from __future__ import annotations

DIM = 256  # tiny-moe's experts: model width
HIDDEN = 256  # and hidden width
ROWS = 1024  # routed rows of the planner table's micro-batch (4 x 128 tokens, top-2)
EXPERTS = 8  # the many-experts case, against one
CALLS = 9  # grouped GEMMs per forward and backward: three projections forward, two each backward


def measure_expert_groups(rounds: int = 11, passes: int = 4) -> dict:
    """{"expert_group_us": the grouped GEMM's fixed cost per expert and call (>= 0), "measured": [[experts,
    median us of one forward and backward], ...]} on this process's threads."""
    import statistics
    import time

    import torch

    from fivefold.model.layers import FeedForward
    from fivefold.model.moe import ExpertKernel

    kernel = ExpertKernel("grouped")
    if kernel.resolve(torch.zeros(1, DIM), [FeedForward(DIM, HIDDEN)]) != "grouped":
        return {"expert_group_us": 0.0, "measured": []}  # this torch has no grouped GEMM: nothing to measure
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, DIM, generator=generator, requires_grad=True)
    runs = {}
    for experts in (1, EXPERTS):
        with torch.random.fork_rng(devices=[]):  # leave the caller's generator (a live trainer's) where it was
            torch.manual_seed(0)
            layers = [FeedForward(DIM, HIDDEN) for _ in range(experts)]
        counts = [ROWS // experts] * experts

        def run(layers=layers, counts=counts) -> None:
            kernel(x, counts, layers).sum().backward()

        for _ in range(3):
            run()
        runs[experts] = run
    times: dict[int, list[float]] = {experts: [] for experts in runs}
    for _ in range(rounds):
        for experts, run in runs.items():
            start = time.perf_counter()
            for _ in range(passes):
                run()
            times[experts].append((time.perf_counter() - start) / passes * 1e6)
    measured = [[experts, statistics.median(values)] for experts, values in times.items()]
    return {"expert_group_us": expert_group_us_of(measured), "measured": measured}


def expert_group_us_of(measured: list[list[float]]) -> float:
    """The fixed cost per expert and grouped call from [[experts, us of a forward and backward], ...]: the
    least-squares slope over the experts (comm/cost.py `fit_link`), per call (0.0 when it does not rise or fewer
    than two expert counts were timed)."""
    if len({experts for experts, _ in measured}) < 2:
        return 0.0
    from fivefold.comm.cost import fit_link  # (comm/ imports torch: not at this module's import)

    return fit_link([e for e, _ in measured], [t for _, t in measured]).beta / CALLS


def group_seconds(per_expert_us: float, experts: int, kernel: str) -> float:
    """Seconds the grouped GEMMs' fixed cost adds to a MoE block's forward on a rank holding `experts` experts
    (three calls; 0 under the loop kernel, whose matmuls are counted operators)."""
    if kernel != "grouped" or not per_expert_us:
        return 0.0
    return 3 * experts * per_expert_us * 1e-6
