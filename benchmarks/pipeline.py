"""Our pipeline schedules vs torch.distributed.pipelining on the same model, ranks and micro-batches.

    gpipe         ours vs ScheduleGPipe
    1f1b          ours vs Schedule1F1B
    interleaved   ours vs ScheduleInterleaved1F1B (2 stages per rank)
    zb-h1         ours (no single-stage zero-bubble schedule in torch to pair it with; shown beside
                  torch's Schedule1F1B, the schedule it improves on)

Every rank builds the same model from the same seed and keeps its stages (stage split by
parallel/pipeline/stages.py, the same for both); torch's PipelineStage wraps the same stage
functions. One step is the pipeline forward and backward of m micro-batches (no optimizer step:
both would run the same AdamW). Step time is the median over rounds (rotating order, max over
ranks); "peak saved MiB" is the most activation memory autograd holds at once on the busiest
rank over a step (train/memory.py PeakSavedBytes, parameters excluded), which grows with the
micro-batches in flight (for zb-h1 plus the peak of the inputs and gradients its deferred W
passes hold outside autograd: an upper bound); "bubble" is our executor's measured idle / compute time beside
(p-1)/m (or its schedule's formula). The losses of both are checked to agree.

    python benchmarks/pipeline.py --world-size 4 --layers 8 --microbatches 8
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import benchmark_arguments, benchmark_model, spawn, timed_rounds
from torch import nn

PAIRS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "zb-h1": "Schedule1F1B"}


class _TorchStageModule(nn.Module):
    """One stage for torch's PipelineStage: registers only this stage's modules, runs our stage function."""

    def __init__(self, model, stage, seq_len: int):
        super().__init__()
        self.blocks = nn.ModuleList([model.layers[str(i)] for i in stage.layers])
        self.ends = nn.ModuleList([m for m in (model.tok_embeddings if stage.is_first else None,
                                               model.norm if stage.is_last else None,
                                               model.output if stage.is_last else None) if m is not None])
        object.__setattr__(self, "model", model)  # not a submodule: the other stage's modules stay out
        self.stage, self.positions = stage, torch.arange(seq_len)

    def forward(self, x):
        return self.stage.forward(self.model, x, self.positions)


def _build(schedule: str, config, args, rank: int, world_size: int, total_tokens: int):
    from torch.distributed import pipelining

    from fivefold.model import build_model, materialize
    from fivefold.parallel.pipeline.executor import MicroBatch, PipelineExecutor
    from fivefold.parallel.pipeline.schedules import PipelineShape
    from fivefold.parallel.pipeline.stages import cut_model, plan_stages, stages_of_rank
    from fivefold.train.memory import PeakSavedBytes

    virtual = 2 if schedule == "interleaved" else 1
    m, mb = args.microbatches, args.batch
    split = plan_stages(config, args.seq_len, world_size * virtual)
    stages = stages_of_rank(split, world_size, rank)

    def loss_sum(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    def stage_model():
        model = build_model(config)
        cut_model(model, stages)
        return materialize(model, "cpu", seed=0)

    ours_model, torch_model = stage_model(), stage_model()
    executor = PipelineExecutor(ours_model, stages, PipelineShape(world_size, m, virtual), schedule, dist.group.WORLD,
                                loss_sum, (mb, args.seq_len, config.dim), torch.float32, torch.device("cpu"))

    def ours(inputs, labels):
        batches = [MicroBatch(inputs[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb]) for i in range(m)]
        loss = executor.run(batches, total_tokens, lambda: None, lambda local_loss: None)
        ours_model.zero_grad(set_to_none=True)
        return float(loss)

    torch_stages = [pipelining.PipelineStage(_TorchStageModule(torch_model, s, args.seq_len), s.index,
                                             len(split), torch.device("cpu")) for s in stages]
    kind = getattr(pipelining, PAIRS[schedule])
    runner = kind(torch_stages if virtual > 1 else torch_stages[0], m,
                  loss_fn=lambda out, target: loss_sum(out, target) / total_tokens, scale_grads=False)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def peer(inputs, labels):
        losses: list = []
        args_ = (inputs,) if first else ()
        runner.step(*args_, target=labels if last else None, losses=losses if last else None)
        torch_model.zero_grad(set_to_none=True)
        return float(sum(loss.detach() for loss in losses) * total_tokens) if losses else 0.0

    def peak_saved(step, model, store=None):
        def measure(inputs, labels):
            if store is not None:
                store.peak_bytes = 0
            with PeakSavedBytes(model.parameters()) as tracker:
                step(inputs, labels)
            # zero bubble: the W passes' inputs wait outside autograd; adding their own peak bounds the total
            return tracker.peak + (store.peak_bytes if store is not None else 0)
        return measure

    memory = {"ours": peak_saved(ours, ours_model, executor.store), "peer": peak_saved(peer, torch_model)}
    return {"ours": ours, "peer": peer}, memory, executor


def _rank(rank: int, world_size: int, args) -> dict:
    from fivefold.parallel.pipeline.schedules import PipelineShape, ideal_bubble
    from fivefold.parallel.pipeline.trace import measure_bubble

    torch.manual_seed(0)
    config = benchmark_model(args)
    config.max_seq_len = max(config.max_seq_len, args.seq_len)
    total_tokens = args.microbatches * args.batch * args.seq_len
    generator = torch.Generator().manual_seed(1)

    def make_batch():
        return torch.randint(0, config.vocab_size, (args.microbatches * args.batch, args.seq_len + 1), generator=generator)

    results = {}
    for schedule in args.schedules.split(","):
        steps, memory, executor = _build(schedule, config, args, rank, world_size, total_tokens)
        # the losses are compared below, on one more batch, after the whole pipeline summed them
        wrapped = {name: (lambda tokens, step=step: (step(tokens[:, :-1], tokens[:, 1:]), (0.0, 1)))
                   for name, step in steps.items()}
        times, last, _ = timed_rounds(wrapped, make_batch, args.warmup, args.rounds)
        tokens = make_batch()
        losses = {name: torch.tensor(step(tokens[:, :-1], tokens[:, 1:])) for name, step in steps.items()}
        events: list = [None] * world_size
        dist.all_gather_object(events, executor.events)
        peaks = {}
        for name, measure in memory.items():
            peak = torch.tensor(float(measure(tokens[:, :-1], tokens[:, 1:])))
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[name] = float(peak) / 2**20
        for value in losses.values():
            dist.all_reduce(value)  # only the last stage's rank holds a loss
        virtual = 2 if schedule == "interleaved" else 1
        results[schedule] = {
            "peer": PAIRS[schedule], "ms": times, "peak_saved_mib": peaks,
            "loss_rel_diff": abs(float(losses["ours"] - losses["peer"])) / abs(float(losses["peer"])),
            "bubble": measure_bubble(events).over_ideal,
            "bubble_ideal": ideal_bubble(schedule, PipelineShape(world_size, args.microbatches, virtual)),
        }
    return results


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--world-size", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb-h1")
    parser.set_defaults(batch=2, layers=8, seq_len=128)
    args = parser.parse_args()
    results = spawn(_rank, args.world_size, args, args.timeout)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"pp {args.world_size}, {args.microbatches} micro-batches of {args.batch} x {args.seq_len} tokens, "
          f"{args.preset} with {args.layers} layers, gloo on CPU; median of {args.rounds} rounds")
    print(f"{'schedule':<12} {'torch peer':<24} {'ours ms':>9} {'peer ms':>9} {'time x':>7} "
          f"{'ours MiB':>9} {'peer MiB':>9} {'mem x':>6} {'bubble':>7} {'ideal':>6} {'loss diff':>9}")
    for schedule, r in results.items():
        ms, mib = r["ms"], r["peak_saved_mib"]
        print(f"{schedule:<12} {r['peer']:<24} {ms['ours']:>9.1f} {ms['peer']:>9.1f} {ms['ours'] / ms['peer']:>7.2f} "
              f"{mib['ours']:>9.2f} {mib['peer']:>9.2f} {mib['ours'] / mib['peer']:>6.2f} {r['bubble']:>7.3f} "
              f"{r['bubble_ideal']:>6.3f} {r['loss_rel_diff']:>9.1e}")
    print("time x, mem x: ours / torch.distributed.pipelining (below 1: ours faster / smaller)")
    result = []
    for schedule, r in results.items():
        key = schedule.replace("-", "")
        result += [f"{key}_time={r['ms']['ours'] / r['ms']['peer']:.3f}",
                   f"{key}_mem={r['peak_saved_mib']['ours'] / r['peak_saved_mib']['peer']:.3f}",
                   f"{key}_bubble={r['bubble']:.3f}"]
    agreement = max(r["loss_rel_diff"] for r in results.values())
    print("RESULT name=pipeline " + " ".join(result) + f" loss_rel_diff={agreement:.3e}")


if __name__ == "__main__":
    main()
