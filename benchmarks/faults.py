"""Faults, measured: detection latencies, the training stall of a checkpoint save, and goodput under failures.

    detection   2-rank jobs under `fivefold train` (torchrun): a rank killed (torchrun's agent sees
                its exit), a rank stopped with SIGSTOP (fivefold's watchdog, heartbeats every
                --heartbeat s: goal <= 2 heartbeats, <= 30 s at the default 10 s), a NaN loss (the
                guard: the same step). Latency = the detector's record time minus the faulty rank's
                last heartbeat, written at the start of the step it failed in.
    stall       seconds the training thread spends in one checkpoint save, fivefold sync vs async,
                beside torch.distributed.checkpoint's own `save` and `async_save` (the peer) on the
                same state dict, interleaved with training steps; median over --saves saves
    goodput     useful steps per second of a run with a rank killed every --fail-every steps and
                --max-restarts to recover (asynchronous checkpoints every --ckpt-every steps),
                beside the same run without faults

Prints a table and `RESULT name=faults ...`; --json for machines.

    python benchmarks/faults.py                       # defaults: heartbeat 10 s, 150 steps, a failure every 50
    python benchmarks/faults.py --heartbeat 1 --steps 40 --fail-every 20 --saves 3   # quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

WORDS = "def class return import self value data train model token layer batch step loss grad".split()


def corpus(folder: Path) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(40):
        lines = [f"{rng.choice(WORDS)} {rng.choice(WORDS)}_{rng.randint(0, 9)} = {rng.choice(WORDS)}({rng.randint(0, 99)})"
                 for _ in range(rng.randint(20, 40))]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return folder


def job_args(root: Path, output: str, steps: int, dim: int) -> list[str]:
    return ["--data.source", str(root / "corpus"), "--data.cache_dir", str(root / "cache"), "--data.val_fraction", "0.2",
            "--model.dim", str(dim), "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
            "--model.multiple_of", "16", "--model.max_seq_len", "64", "--train.steps", str(steps), "--train.seq_len",
            "64", "--train.micro_batch_size", "4", "--train.eval_every", "0", "--train.output_dir", str(root / output),
            "--optim.warmup_steps", "2", "--logging.progress", "false", "--logging.tensorboard", "false",
            "--logging.plot", "false", "--logging.sample_tokens", "0"]


def fivefold(args: list[str], cwd: Path, timeout: float = 1800) -> tuple[int, float, str]:
    """`fivefold train` with `args`: (exit code, seconds, the end of its stderr)."""
    env = {**os.environ}
    env.pop("WORLD_SIZE", None)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "fivefold", "train", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    return out.returncode, time.perf_counter() - start, out.stderr[-3000:]


def last_beat(run: Path, rank: int) -> float:
    return json.loads((run / "heartbeats" / f"rank-{rank:05d}.json").read_text())["time"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def detection(root: Path, heartbeat: float) -> dict[str, float]:
    watchdog = ["--watchdog.heartbeat_s", str(heartbeat), "--watchdog.collective_timeout_s", str(max(60, 4 * heartbeat))]
    out = {}
    run = root / "dead"
    fivefold(["--nproc-per-node", "2", *job_args(root, "dead", 1000, 32), *watchdog, "--fault.kind", "kill",
              "--fault.step", "20", "--fault.rank", "1"], root)
    failed = [r for r in records(run / "launcher.jsonl") if r["event"] == "failed"][-1]
    out["dead_rank_s"] = failed["time"] - last_beat(run, 1)
    run = root / "hung"
    fivefold(["--nproc-per-node", "2", *job_args(root, "hung", 1000, 32), *watchdog, "--fault.kind", "hang",
              "--fault.step", "20", "--fault.rank", "1"], root)
    failure = json.loads((run / "failure.json").read_text())
    out["hung_rank_s"] = failure["time"] - last_beat(run, 1)
    out["hung_rank_heartbeats"] = out["hung_rank_s"] / heartbeat
    run = root / "nan"
    fivefold(["--nproc-per-node", "2", *job_args(root, "nan", 30, 32), *watchdog, "--fault.kind", "nan",
              "--fault.step", "20", "--fault.rank", "1", "--checkpoint.every", "10"], root)
    bad = [r for r in records(run / "events" / "rank-00000.jsonl") if r["event"] == "bad_step"]
    out["nan_steps"] = bad[0]["step"] - 20 if bad else float("nan")  # 0: the step it happened in
    return out


def stall(root: Path, saves: int, dim: int) -> dict[str, float]:
    """Training-thread seconds per save: ours sync and async, DCP's save and async_save on the same state."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fivefold.config import load_config
    from fivefold.train.trainer import Trainer
    from fivefold.train.train_state import capture_training_state

    def trainer(name: str, async_save: bool) -> Trainer:
        config = load_config(None, [*job_args(root, name, 10**6, dim), "--checkpoint.every", "0",
                                    "--checkpoint.async_save", str(async_save).lower(), "--checkpoint.keep_last", "2"])
        return Trainer(dataclasses.replace(config))

    results: dict[str, list[float]] = {"ours_sync": [], "ours_async": [], "dcp_save": [], "dcp_async_save": []}
    ours = {"ours_sync": trainer("stall-sync", False), "ours_async": trainer("stall-async", True)}
    state_bytes = 0
    for round_index in range(saves + 1):  # the first round warms up
        for name, run in ours.items():
            run.train_step()
            run.state.step += 1
            start = time.perf_counter()
            run.save()
            if round_index:
                results[name].append(time.perf_counter() - start)
        peer = ours["ours_sync"]
        state = capture_training_state(peer.parallel)
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        for name, save in (("dcp_save", dcp.save), ("dcp_async_save", dcp.async_save)):
            peer.train_step()
            folder = root / f"{name}-{round_index}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                start = time.perf_counter()
                handle = save(capture_training_state(peer.parallel), checkpoint_id=str(folder), no_dist=True)
                spent = time.perf_counter() - start
                if name == "dcp_async_save":
                    handle.result()
            if round_index:
                results[name].append(spent)
    for run in ours.values():
        run.checkpoints.close()
    torch.set_num_threads(torch.get_num_threads())
    out = {f"{name}_ms": statistics.median(times) * 1e3 for name, times in results.items()}
    out["state_mb"] = state_bytes / 1e6
    return out


def goodput(root: Path, steps: int, fail_every: int, ckpt_every: int, dim: int) -> dict[str, float]:
    """Steps per second without faults and with a rank killed every `fail_every` steps (torchrun restarts the job
    from its last checkpoint). The watchdog keeps its default heartbeat: a killed rank is found by its exit, and a
    short one (--heartbeat, for the detection runs) can call a rank of the fault-free run hung when a loaded host
    starves its heartbeat thread for 1.5 heartbeats. At 1 s a CI run of 2026-11-28 lost its fault-free run under
    load (its reason unrecorded then; not reproduced alone)."""
    common = ["--nproc-per-node", "2", "--checkpoint.every", str(ckpt_every), "--checkpoint.async_save", "true"]
    code, clean, stderr = fivefold([*common, *job_args(root, "clean", steps, dim)], root)
    assert code == 0, f"the fault-free run failed (exit {code}); its stderr ends:\n{stderr}"
    failures = steps // fail_every  # at steps fail_every, 2 fail_every, ... (each in its own attempt)
    code, faulty, stderr = fivefold([*common, "--max-restarts", str(failures), *job_args(root, "faulty", steps, dim),
                                     "--fault.kind", "kill", "--fault.step", str(fail_every), "--fault.every",
                                     str(fail_every), "--fault.rank", "1"], root)
    assert code == 0, f"the run with failures did not recover (exit {code}); its stderr ends:\n{stderr}"
    return {"goodput_clean": steps / clean, "goodput_faulty": steps / faulty, "goodput_ratio": clean / faulty,
            "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heartbeat", type=float, default=10.0, help="watchdog.heartbeat_s for the detection runs")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--fail-every", type=int, default=50)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--dim", type=int, default=256, help="model width of the stall and goodput runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus(root / "corpus")
        found = detection(root, args.heartbeat)
        with contextlib.redirect_stdout(io.StringIO()):  # the trainers' own lines
            saving = stall(root, args.saves, args.dim)
        run = goodput(root, args.steps, args.fail_every, args.ckpt_every, args.dim)
    print(f"detection: dead rank {found['dead_rank_s']:.2f} s (torchrun's agent); hung rank {found['hung_rank_s']:.2f} s "
          f"= {found['hung_rank_heartbeats']:.2f} heartbeats of {args.heartbeat:g} s (goal <= 2, <= 30 s at the default); "
          f"NaN loss: the step it happened in + {found['nan_steps']:.0f}")
    print(f"save stall per checkpoint ({saving['state_mb']:.1f} MB of state): ours sync {saving['ours_sync_ms']:.1f} ms, "
          f"ours async {saving['ours_async_ms']:.1f} ms, dcp.save {saving['dcp_save_ms']:.1f} ms, "
          f"dcp.async_save {saving['dcp_async_save_ms']:.1f} ms")
    print(f"goodput: {run['goodput_clean']:.2f} steps/s without faults, {run['goodput_faulty']:.2f} steps/s with "
          f"{run['failures']} rank failure(s) in {args.steps} steps (one every {args.fail_every}), restarts included: "
          f"{run['goodput_ratio']:.2f} of the fault-free goodput")
    fields = {**found, **saving, **run,
              "async_vs_sync_stall": saving["ours_async_ms"] / saving["ours_sync_ms"],
              "async_vs_dcp_async_stall": saving["ours_async_ms"] / saving["dcp_async_save_ms"]}
    print("RESULT name=faults " + " ".join(f"{k}={v:.4g}" for k, v in fields.items()))
    if args.json:
        print(json.dumps({"args": vars(args), **fields}))


if __name__ == "__main__":
    main()
