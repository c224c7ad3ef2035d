"""Draw a pipeline schedule's timeline as a PNG, like the figures of the GPipe, Megatron and
zero-bubble papers: one row per rank, one box per compute pass, numbered by micro-batch,
coloured by pass (forward, backward, input / weight gradient) and shaded by virtual stage.

`plot_schedule` takes the boxes from the simulator (equal stage costs), so the picture shows the
schedule's own bubble; the title gives the simulated bubble beside the formula. `plot_trace`
draws a measured step instead (the Chrome trace a training run writes, pipeline/trace.py), in
milliseconds, with the measured bubble beside the formula.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.parallel.pipeline.schedules import Op, PipelineShape, all_schedules, ideal_bubble
from fivefold.parallel.pipeline.simulate import Costs, simulate

_COLOURS = {Op.FORWARD: "#4e79a7", Op.BACKWARD: "#59a14f", Op.BACKWARD_INPUT: "#59a14f", Op.BACKWARD_WEIGHT: "#f28e2b"}


def plot_schedule(name: str, shape: PipelineShape, output: str | Path) -> Path:
    v = shape.virtual
    sim = simulate(all_schedules(name, shape),
                   Costs(forward=1 / v, backward=2 / v, backward_input=1 / v, backward_weight=1 / v))
    boxes = [(rank, ins.op, ins.microbatch, ins.stage, start, end) for rank, ins, start, end in sim.timeline]
    title = (f"{name}: pp {shape.ranks}, {shape.microbatches} micro-batches"
             + (f", {v} virtual stages per rank" if v > 1 else "")
             + f"; bubble {sim.bubble_over_ideal:.3f} of ideal time (formula {ideal_bubble(name, shape):.3f})")
    return _draw(name, shape, boxes, sim.makespan, title, "time (one forward of a whole stage = 1)", output)


def plot_trace(trace_path: str | Path, output: str | Path) -> Path:
    """The measured timeline of a `pipeline_trace.json` written by training (logging.pipeline_trace)."""
    import json

    from fivefold.parallel.pipeline.executor import TimedEvent
    from fivefold.parallel.pipeline.trace import measure_bubble

    trace = json.loads(Path(trace_path).read_text())
    info = trace["otherData"]
    shape = PipelineShape(info["ranks"], info["microbatches"], info["virtual"])
    events: list[list[TimedEvent]] = [[] for _ in range(shape.ranks)]
    boxes = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        start, end = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        events[e["pid"]].append(TimedEvent(e["name"], e["cat"], start, end))
        if e["cat"] == "compute" and "@s" in e["name"]:
            op, rest = e["name"][0], e["name"][1:]
            microbatch, stage = rest.split("@s")
            boxes.append((e["pid"], Op(op), int(microbatch), int(stage), start, end))
    bubble = measure_bubble(events)
    name = info["schedule"]
    title = (f"measured {name}: pp {shape.ranks}, {shape.microbatches} micro-batches"
             + (f", {shape.virtual} virtual stages per rank" if shape.virtual > 1 else "")
             + f"; bubble {bubble.over_ideal:.3f} of compute time (formula {ideal_bubble(name, shape):.3f})")
    return _draw(name, shape, boxes, bubble.makespan, title, "milliseconds from the start of the step", output)


def _draw(name: str, shape: PipelineShape, boxes, makespan: float, title: str, xlabel: str, output) -> Path:
    from fivefold.plotting import pyplot, save_figure

    plt = pyplot()

    v = shape.virtual
    longest = max((end - start for *_, start, end in boxes), default=1.0)
    fig, ax = plt.subplots(figsize=(max(8.0, makespan / longest * 0.9), 0.6 * shape.ranks + 1.4))
    for rank, op, microbatch, stage, start, end in boxes:
        chunk = stage // shape.ranks
        alpha = 1.0 - 0.45 * chunk / max(v - 1, 1) if v > 1 else 1.0
        ax.barh(rank, end - start, left=start, height=0.8, color=_COLOURS[op], alpha=alpha, edgecolor="white")
        label = f"{microbatch}" if op in (Op.FORWARD, Op.BACKWARD) else f"{op.value}{microbatch}"
        ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(shape.ranks), [f"rank {r}" for r in range(shape.ranks)])
    ax.set_xlim(0, makespan)
    ax.set_xlabel(xlabel)
    legend = [(Op.FORWARD, "forward"), (Op.BACKWARD, "backward")] if name != "zb-h1" else [
        (Op.FORWARD, "forward (F)"), (Op.BACKWARD_INPUT, "input gradient (I)"), (Op.BACKWARD_WEIGHT, "weight gradient (W)")]
    for op, text in legend:
        ax.barh(-10, 0, color=_COLOURS[op], label=text)
    ax.set_ylim(shape.ranks - 0.5, -0.5)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(legend), frameon=False, fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, output, dpi=130)
