"""NVMe offload (ZeRO-Infinity) against ZeRO-Offload in host memory and no offload, in the same run, on 2 gloo ranks.

Variants, each a real Trainer on the same config and seed (ZeRO-2 over 2 ranks):

    zero2       optimizer states in the process's memory (the plain variant)
    cpu         ZeRO-Offload: fp32 masters and AdamW moments in host memory, the step on the CPU
    nvme        ZeRO-Infinity: the same states in a swap file under --nvme-path, streamed through a ring of
                three page-aligned slots by a read / step / write pipeline (parallel/nvme_offload.py)

On this CPU machine "host" and "device" are one memory, so `cpu` differs from `zero2` only by the copy of
the master; what the benchmark shows is what the drive costs: the optimizer step's time, the bytes the
swap file moves per step, the drive throughput that step reached, and the optimizer bytes each rank keeps
in memory (measured, trainer.report.model_state_bytes). The peer for the I/O is a probe of the drive
itself: the same bytes written, then read back, with O_DIRECT by as many threads as the two ranks' I/O
pools (a drive that serves reads and writes at once can beat it: it is a reference, not a ceiling). Rounds run one optimizer step of every variant in
rotating order; times are the slowest rank's, medians after the warm-up. `nvme` must equal `cpu` bitwise.

    python benchmarks/nvme_offload.py --preset tiny --rounds 6 --nvme-path /path/on/a/local/drive
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from ranks import benchmark_arguments, spawn, trainer_config, trainers_taking_turns

from fivefold.parallel.nvme_offload import IO_THREADS

VARIANTS = {"zero2": {}, "cpu": {"offload": True}, "nvme": {"offload": True, "nvme_path": "<set>"}}


def _config(args, options: dict, output: str):
    if "nvme_path" in options:
        options = {**options, "nvme_path": args.nvme_path, "nvme_sub_group": args.sub_group}
    return trainer_config(args, output, data_parallel=dict(zero_stage=2, shard=2, replicate=1, **options))


def _rank(rank: int, world_size: int, args) -> dict:
    import contextlib
    import io

    trainers = trainers_taking_turns(rank, world_size, {name: functools.partial(_config, args, options)
                                                        for name, options in VARIANTS.items()})
    names = list(VARIANTS)
    steps = {name: [] for name in names}
    optimizer = {name: [] for name in names}
    losses = {name: [] for name in names}
    for name, trainer in trainers.items():  # time the optimizer step alone as well
        def timed(lr, sync=trainer.sync, original=trainer.sync.step, name=name):
            start = time.perf_counter()
            original(lr)
            optimizer[name].append(time.perf_counter() - start)
        trainer.sync.step = timed
    quiet = contextlib.redirect_stdout(io.StringIO())  # the trainers' first-step memory tables
    quiet.__enter__()
    moved = []
    for index in range(args.warmup + args.rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            nvme = trainers[name].sync.nvme if name == "nvme" else None
            before = nvme.bytes_read + nvme.bytes_written if nvme else 0
            dist.barrier()
            start = time.perf_counter()
            metrics = trainers[name].train_step()
            if nvme:
                moved.append(nvme.bytes_read + nvme.bytes_written - before)
            elapsed = torch.tensor([time.perf_counter() - start, optimizer[name][-1]])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            losses[name].append(metrics["loss"])
            if index >= args.warmup:
                steps[name].append(float(elapsed[0]))
                optimizer[name][-1] = float(elapsed[1])
    quiet.__exit__(None, None, None)
    rows = {}
    for name, trainer in trainers.items():
        nvme = trainer.sync.nvme if name == "nvme" else None
        measured = trainer.report.model_state_bytes
        timed_rounds = optimizer[name][args.warmup:]
        rows[name] = {"step_ms": statistics.median(steps[name]) * 1e3,
                      "optimizer_ms": statistics.median(timed_rounds) * 1e3,
                      "optimizer_bytes": measured.optimizer, "parameters": trainer.parallel.parameters,
                      "first_loss": losses[name][0], "last_loss": losses[name][-1], "losses": losses[name]}
        if nvme:
            rows[name].update(file_bytes=nvme.file_bytes, moved_per_step=moved[-1], direct_io=nvme.direct,
                              host_slots=sum(t.numel() for t in nvme.host_tensors()),
                              drive_gbs=moved[-1] / (rows[name]["optimizer_ms"] / 1e3) / 1e9)
        trainer.sync.close()
    return rows


def drive_gbs(directory: str, nbytes: int, depth: int) -> float:
    """The drive's own throughput for the same traffic: `nbytes` written, then read back, in 8 MiB O_DIRECT
    requests from `depth` threads (the requests the two ranks' I/O pools keep in flight), in GB/s of both."""
    import mmap
    import os
    from concurrent.futures import ThreadPoolExecutor

    chunk = 8 << 20
    buffers = [mmap.mmap(-1, chunk) for _ in range(depth)]
    path = os.path.join(directory, "drive-probe.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    offsets = list(range(0, nbytes, chunk))
    os.posix_fallocate(fd, 0, len(offsets) * chunk)  # reserved first, as the swap file is
    try:
        with ThreadPoolExecutor(depth) as pool:
            start = time.perf_counter()
            list(pool.map(lambda k: os.pwrite(fd, buffers[k % depth], offsets[k]), range(len(offsets))))
            list(pool.map(lambda k: os.preadv(fd, [buffers[k % depth]], offsets[k]), range(len(offsets))))
            return 2 * len(offsets) * chunk / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        os.remove(path)


def main() -> None:
    parser = benchmark_arguments(__doc__)
    parser.add_argument("--nvme-path", default="", help="directory on a local drive (default: a temporary one)")
    parser.add_argument("--sub-group", type=int, default=1 << 20, help="data_parallel.nvme_sub_group (elements)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.nvme_path or None) as drive:
        args.nvme_path = drive
        rows = spawn(_rank, 2, args, args.timeout)
        # both ranks' swap traffic of one step, through the drive with nothing else running
        probe = drive_gbs(drive, rows["nvme"]["moved_per_step"], 2 * IO_THREADS)
    if args.json:
        print(json.dumps({"config": vars(args), "results": rows}, indent=2))
    base, cpu, nvme = rows["zero2"], rows["cpu"], rows["nvme"]
    print(f"{args.preset} ({base['parameters']:,} parameters), ZeRO-2 over 2 gloo ranks, per-rank batch "
          f"{args.batch} x {args.seq_len}, median of {args.rounds} rounds; swap files in {args.nvme_path} "
          f"({'O_DIRECT' if nvme['direct_io'] else 'page cache: the file system refused O_DIRECT'})")
    print(f"{'variant':<7} {'step (ms)':>10} {'optimizer (ms)':>15} {'optimizer bytes in memory':>26} {'last loss':>10}")
    for name, row in rows.items():
        print(f"{name:<7} {row['step_ms']:>10.1f} {row['optimizer_ms']:>15.1f} {row['optimizer_bytes']:>26,} "
              f"{row['last_loss']:>10.4f}")
    print(f"nvme swap file {nvme['file_bytes']:,} B per rank, host slots {nvme['host_slots']:,} B "
          f"(sub-groups of {args.sub_group:,} elements); {nvme['moved_per_step']:,.0f} B read + written per step "
          f"({nvme['drive_gbs']:.2f} GB/s per rank during the optimizer step, {2 * nvme['drive_gbs']:.2f} for both; the "
          f"drive probe, the same bytes written, then read back, by {2 * IO_THREADS} threads with O_DIRECT: {probe:.2f} GB/s)")
    exact = nvme["losses"] == cpu["losses"]
    print(f"nvme losses {'equal' if exact else 'DIFFER from'} cpu offload's bitwise")
    print(f"RESULT name=nvme_offload nvme_vs_cpu_time={nvme['step_ms'] / cpu['step_ms']:.3f} "
          f"nvme_vs_zero2_time={nvme['step_ms'] / base['step_ms']:.3f} "
          f"nvme_vs_cpu_optimizer_time={nvme['optimizer_ms'] / cpu['optimizer_ms']:.3f} "
          f"nvme_memory_vs_cpu={nvme['optimizer_bytes'] / cpu['optimizer_bytes']:.3f} "
          f"drive_gbs={2 * nvme['drive_gbs']:.3f} drive_probe_gbs={probe:.3f} "
          f"vs_probe={2 * nvme['drive_gbs'] / probe:.3f} loss_rel_diff={abs(nvme['last_loss'] - cpu['last_loss']):.3e}")
    if not exact:
        raise SystemExit("nvme offload diverged from cpu offload")


if __name__ == "__main__":
    main()
