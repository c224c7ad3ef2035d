"""Ring attention's own Python, measured on this host: the accelerator's `ring_step_operators`.

The planner prices a block's host work by the operators it dispatches (plan/operators.py): a dense block's
fixed cost is fitted, a MoE block's and ring attention's additions are counted on a small copy of the block.
Ring attention (Liu et al. 2023; parallel/context_parallel.py) also runs Python between its operators: its
two autograd functions loop over the ring's steps, slice each visiting block, decide what it may see and
keep track of what is in flight. No operator count sees that, and on a CPU it is not small: a cp 2 ring
rank of `tiny` at the planner table's shape spent 0.7 ms a layer in the functions' own Python under the
profiler (docs/planner.md).

`measure_ring_host` measures it in the unit the planner prices host work in, a dense block's operator.
It runs the small copy the counts run on (`tiny`'s, 16 tokens, where host work is nearly all of the time)
with the runtime's ring on its loopback (ring rank 0, as the count runs it), for rings of 2 and 4, under
torch.profiler. The functions' own time P (their self time: not in the operators they call) over the rest
of the block's time per counted operator is what that Python is worth in operators; divided by the ring's
steps, since the loop runs once per step (2026-11-28: 16-22 per step for a ring of 2, 21-22 for 4; the timed
block's norms held uninitialised memory until 2026-11-29 afternoon, and with them at one that day's run measured
21.8 on 2 ranks and 23.7 on 4, against 20.1-20.6 and 20.4-20.8 on the three runs before). A ratio of two times
taken in one profiled run varies far less between processes than the times do (a plain block's time moved
by 30% from one process to the next), and the mean is stored with the cluster (`fivefold bench comm
--cluster-file`), not timed at plan time, so that the planner's figures do not move from run to run.
"""

from __future__ import annotations

RINGS = (2, 4)  # the ring sizes measured
TOKENS = 16  # the small copy's sequence, as plan/operators.py counts it
PASSES = 20  # forward and backward passes profiled per ring


def measure_ring_host(passes: int = PASSES) -> dict:
    """{"ring_step_operators": operators' worth of ring attention's own Python per ring step and block forward
    and backward (the mean over RINGS, >= 0), "measured": [[ring, its functions' own us, the block's us, counted
    operators], ...] per pass} on this process's threads."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fivefold.model.llama import TransformerBlock, rope_tables
    from fivefold.model.presets import PRESETS
    from fivefold.parallel.context_parallel import ring_attention_node_names
    from fivefold.plan.operators import dense_small_copy, loopback_ring, ring_block_counts

    model = dense_small_copy(PRESETS["tiny"])
    cos, sin = rope_tables(model, torch.device("cpu"))
    cos, sin = cos[:TOKENS], sin[:TOKENS]
    x = torch.randn(1, TOKENS, model.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    own = ring_attention_node_names()
    measured = []
    for ring in RINGS:
        torch.manual_seed(0)
        block = TransformerBlock(model, 0)
        block.attention.core = loopback_ring(ring)
        for _ in range(3):
            block(x, cos, sin).sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(passes):
                block(x, cos, sin).sum().backward()
        events = prof.key_averages()
        python = sum(e.self_cpu_time_total for e in events if e.key in own) / passes
        total = sum(e.self_cpu_time_total for e in events) / passes
        counted = ring_block_counts(PRESETS["tiny"], ring)[0]  # the posts' buffers and copies included
        measured.append([ring, python, total, counted])
    return {"ring_step_operators": ring_step_operators_of(measured), "measured": measured}


def ring_step_operators_of(measured: list[list[float]]) -> float:
    """The mean over `measure_ring_host`'s rows of the functions' own time over the rest of the block's time per
    counted operator, per ring step (0.0 for no rows)."""
    per_step = [python * counted / (total - python) / ring for ring, python, total, counted in measured
                if total > python]
    return max(0.0, sum(per_step) / len(per_step)) if per_step else 0.0
