"""Draw a pipeline schedule's timeline as a PNG, like the figures of the GPipe, Megatron and
zero-bubble papers: one row per rank, one box per compute pass, numbered by micro-batch,
coloured by pass (forward, backward, input / weight gradient) and shaded by virtual stage.

The boxes come from the simulator (equal stage costs), so the picture shows the schedule's own
bubble; the title gives the simulated bubble beside the formula.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.parallel.pipeline.schedules import Op, PipelineShape, all_schedules, ideal_bubble
from fivefold.parallel.pipeline.simulate import Costs, simulate

_COLOURS = {Op.FORWARD: "#4e79a7", Op.BACKWARD: "#59a14f", Op.BACKWARD_INPUT: "#59a14f", Op.BACKWARD_WEIGHT: "#f28e2b"}


def plot_schedule(name: str, shape: PipelineShape, output: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = shape.virtual
    sim = simulate(all_schedules(name, shape),
                   Costs(forward=1 / v, backward=2 / v, backward_input=1 / v, backward_weight=1 / v))
    fig, ax = plt.subplots(figsize=(max(8.0, sim.makespan * 0.45), 0.6 * shape.ranks + 1.4))
    for rank, ins, start, end in sim.timeline:
        chunk = ins.stage // shape.ranks
        alpha = 1.0 - 0.45 * chunk / max(v - 1, 1) if v > 1 else 1.0
        ax.barh(rank, end - start, left=start, height=0.8, color=_COLOURS[ins.op], alpha=alpha, edgecolor="white")
        label = f"{ins.microbatch}" if ins.op in (Op.FORWARD, Op.BACKWARD) else f"{ins.op.value}{ins.microbatch}"
        ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(shape.ranks), [f"rank {r}" for r in range(shape.ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time (one forward of a whole stage = 1)")
    legend = [(Op.FORWARD, "forward"), (Op.BACKWARD, "backward")] if name != "zb-h1" else [
        (Op.FORWARD, "forward (F)"), (Op.BACKWARD_INPUT, "input gradient (I)"), (Op.BACKWARD_WEIGHT, "weight gradient (W)")]
    for op, text in legend:
        ax.barh(-10, 0, color=_COLOURS[op], label=text)
    ax.set_ylim(shape.ranks - 0.5, -0.5)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(legend), frameon=False, fontsize=8)
    ax.set_title(f"{name}: pp {shape.ranks}, {shape.microbatches} micro-batches"
                 + (f", {v} virtual stages per rank" if v > 1 else "")
                 + f"; bubble {sim.bubble_over_ideal:.3f} of ideal time (formula {ideal_bubble(name, shape):.3f})",
                 fontsize=9)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=130)
    plt.close(fig)
    return output
