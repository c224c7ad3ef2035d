"""Shared by the multi-rank benchmarks: spawn gloo ranks, and time variants in rotating order.

Every round runs one step of each variant, in an order that rotates per round so machine noise
hits all alike; a step's time is the max over ranks (the slowest rank sets the pace), and the
reported time is the median over rounds after the warm-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def machine() -> str:
    """The CPU the figures come from: its model name, the vector instructions torch's CPU kernels use here
    (AVX2, AVX512, ...: bf16 matmuls are emulated without AVX-512's bf16) and its cores. Machines lent under
    one name differ: a table measured on one does not carry to another."""
    name = ""
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        pass
    return (f"{name or platform.processor() or 'unknown CPU'}, torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores")


def _entry(rank: int, world_size: int, port: int, target: Callable, args: Any, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = target(rank, world_size, args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def spawn(target: Callable[[int, int, Any], Any], world_size: int, args: Any, timeout: float) -> Any:
    """Run target(rank, world_size, args) in `world_size` gloo ranks; return rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("forkserver")  # ranks fork from one process that imported torch once (seconds per rank)
    # torch._dynamo: imported lazily by the first model build (about 1.7 s per rank on 2 cores), once here instead
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "fivefold.train.roles"])
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, target, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout)
    for p in procs:
        p.join(timeout=30)
    return result


def timed_rounds(steps: dict[str, Callable[[torch.Tensor], Any]], make_batch: Callable[[], torch.Tensor],
                 warmup: int, rounds: int) -> tuple[dict[str, float], dict[str, Any], dict[str, float]]:
    """Median step time in ms per variant (max over ranks), each variant's last value, and its first loss.

    A step returns `(value, (loss_sum, tokens))`: the loss it computed, as this rank's sum over its
    tokens. The first round runs every variant on the same weights and batch, so their losses must
    agree: the third result is each variant's loss over all ranks (sum / tokens) in that round.
    """
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, Any] = {}
    first: dict[str, tuple[float, float]] = {}
    for round_index in range(warmup + rounds):
        shift = round_index % len(names)
        batch = make_batch()
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            last[name], loss = steps[name](batch)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            first.setdefault(name, loss)
            if round_index >= warmup:
                times[name].append(float(elapsed))
    losses = {}
    for name in names:
        total = torch.tensor([float(first[name][0]), float(first[name][1])], dtype=torch.float64)
        dist.all_reduce(total)
        losses[name] = float(total[0] / total[1])
    return {name: statistics.median(times[name]) * 1e3 for name in names}, last, losses


def loss_rel_diff(losses: dict[str, float], pairs: list[tuple[str, str]]) -> float:
    """Largest relative difference between the losses of compared variants (ours, peer)."""
    return max(abs(losses[ours] - losses[peer]) / abs(losses[peer]) for ours, peer in pairs)


def benchmark_model(args: Any):
    """The preset named by --preset (vocabulary 257 if unset), with --layers overriding its depth."""
    from fivefold.model import get_preset

    config = get_preset(args.preset)
    config.vocab_size = config.vocab_size or 257
    if args.layers:
        config.n_layers = args.layers
    return config


def trainer_config(args: Any, output: str, **sections: dict):
    """A JobConfig of real Trainers that take turns in one process: the --preset model (--layers deep), the
    benchmark's batch and rounds, no evaluation, checkpoints, logs or watchdog (a rank waiting for its turn
    is not hung); `sections` overrides fields per config section, e.g. data_parallel={"zero_stage": 3}."""
    import dataclasses

    from fivefold.config import JobConfig
    from fivefold.model import get_preset

    config = JobConfig()
    config.model = get_preset(args.preset)
    if args.layers:
        config.model.n_layers = args.layers
    config.train = dataclasses.replace(config.train, steps=args.warmup + args.rounds, seq_len=args.seq_len,
                                       micro_batch_size=args.batch, eval_every=0, output_dir=output)
    config.checkpoint = dataclasses.replace(config.checkpoint, enabled=False)
    config.logging = dataclasses.replace(config.logging, progress=False, tensorboard=False, plot=False, sample_prompt="")
    config.watchdog = dataclasses.replace(config.watchdog, enabled=False)
    for name, fields in sections.items():
        setattr(config, name, dataclasses.replace(getattr(config, name), **fields))
    return config.validate()


def trainers_taking_turns(rank: int, world_size: int, configs: dict[str, Callable[[str], Any]]) -> dict:
    """One Trainer per named config (built by configs[name](output_dir)) on this rank, quietly, with the
    environment torchrun would give it."""
    import contextlib
    import io
    import tempfile

    from fivefold.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    output = tempfile.mkdtemp()
    with contextlib.redirect_stdout(io.StringIO()):
        return {name: Trainer(make(f"{output}/{name}")) for name, make in configs.items()}


def zero_traffic_rounds(trainers: dict, warmup: int, rounds: int) -> dict[str, dict]:
    """Train the ZeRO trainers one step each in turn (the order rotating every round), and give, per name, the
    median step time (the slowest rank's), the data-parallel bytes of the last step (total, across nodes and
    by phase) and the first and last losses."""
    import contextlib
    import io

    for trainer in trainers.values():
        trainer.sync.traffic_metrics = lambda: {}  # the benchmark reads the counts itself
    names = list(trainers)
    times = {name: [] for name in names}
    losses = {name: [] for name in names}
    sent = {}
    with contextlib.redirect_stdout(io.StringIO()):  # the trainers' first-step memory tables
        for index in range(warmup + rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                trainer = trainers[name]
                trainer.sync.zero.traffic.take()
                dist.barrier()
                start = time.perf_counter()
                metrics = trainer.train_step()
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                sent[name] = trainer.sync.zero.traffic.take()
                losses[name].append(metrics["loss"])
                if index >= warmup:
                    times[name].append(float(elapsed))
    return {name: {"step_ms": statistics.median(times[name]) * 1e3, "bytes": sum(sent[name].values()),
                   "cross_node_bytes": sum(n for (_, over), n in sent[name].items() if over),
                   "first_loss": losses[name][0], "last_loss": losses[name][-1],
                   "phases": {f"{phase} ({'cross' if over else 'intra'})": n for (phase, over), n in sent[name].items()}}
            for name in names}


def run_variants(steps: dict[str, Callable], vocab_size: int, args: Any, seed: int):
    """Time step(inputs, labels) of each variant on random (batch, seq_len) token batches drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)

    def make_batch() -> torch.Tensor:
        return torch.randint(0, vocab_size, (args.batch, args.seq_len + 1), generator=generator)

    wrapped = {name: (lambda tokens, step=step: step(tokens[:, :-1], tokens[:, 1:])) for name, step in steps.items()}
    return timed_rounds(wrapped, make_batch, args.warmup, args.rounds)


def benchmark_arguments(doc: str) -> argparse.ArgumentParser:
    """The options every multi-rank benchmark takes; each script adds its own (ranks, ...)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0 = keep)")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--json", action="store_true")
    return parser
