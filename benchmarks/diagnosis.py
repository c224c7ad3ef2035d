"""Accuracy of `fivefold diagnose` over a labelled corpus of failed (and finished) tiny runs.

Each run is a fresh `fivefold train` process (torchrun for the multi-rank classes) of a micro
model into its own folder, with one failure made the way it happens: injected with `[fault]`
(kill, hang, stall, exception, oom, nan, spike, disk_full), a damaged checkpoint resumed, a damaged
token cache, a changed setting at resume, the launcher killed. The step, the failing rank, the
world size (1 or 2; 2 for the multi-rank classes), ZeRO or DDP and the checkpoint interval vary
from run to run (seeded). The diagnosis must name the class; for a fault of one rank, the rank too.

    python benchmarks/diagnosis.py                  # 13 classes x 8 runs = 104 runs (about 20 min on 2 cores)
    python benchmarks/diagnosis.py --per-class 1 --classes completed,disk_full     # a smoke run

Prints a confusion summary and `RESULT name=diagnosis accuracy=... culprit_accuracy=... runs=...`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from faults import corpus  # noqa: E402

CLASSES = ("completed", "exception", "out_of_memory", "disk_full", "non_finite", "loss_spike", "config_error",
           "checkpoint_corrupt", "data_error", "rank_died", "rank_hung", "collective_timeout", "launcher_died")
MULTI_RANK = ("rank_died", "rank_hung", "collective_timeout", "launcher_died")
WATCHDOG = ["--watchdog.heartbeat_s", "1", "--watchdog.collective_timeout_s", "5"]


def base(root: Path, run: Path, cache: Path, steps: int, every: int) -> list[str]:
    return ["--data.source", str(root / "corpus"), "--data.cache_dir", str(cache), "--data.val_fraction", "0.2",
            "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
            "--model.multiple_of", "16", "--model.max_seq_len", "64", "--train.steps", str(steps), "--train.seq_len", "32",
            "--train.micro_batch_size", "2", "--train.eval_every", "0", "--train.output_dir", str(run),
            "--checkpoint.every", str(every), "--logging.progress", "false", "--logging.tensorboard", "false",
            "--logging.plot", "false", "--logging.sample_tokens", "0", *WATCHDOG]


def cli(args: list[str], cwd: Path, timeout: float = 300) -> int:
    env = {**os.environ}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "fivefold", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout).returncode


def make_case(label: str, rng: random.Random, root: Path, run: Path) -> int | None:
    """Produce one run of class `label` in `run`; returns the rank to blame (None: the class has none)."""
    cache = root / "cache"
    step, every = rng.randint(3, 7), rng.choice([2, 3])
    ranks = 2 if label in MULTI_RANK else rng.choice([1, 2])
    rank = rng.randrange(ranks)
    layout = ["--nproc-per-node", str(ranks)] + (rng.choice([[], ["--data_parallel.shard", "2", "--data_parallel.zero_stage", "2"]])
                                                 if ranks == 2 else [])
    args = [*layout, *base(root, run, cache, 10, every)]
    if label == "completed":
        cli(args, root)
        return None
    if label in ("exception", "out_of_memory", "rank_died", "rank_hung", "collective_timeout"):
        kind = {"exception": "exception", "out_of_memory": "oom", "rank_died": "kill", "rank_hung": "hang",
                "collective_timeout": "stall"}[label]
        cli([*args, "--fault.kind", kind, "--fault.step", str(step), "--fault.rank", str(rank)], root)
        return rank
    if label == "disk_full":
        cli([*args, "--fault.kind", "disk_full", "--fault.step", str(every * rng.randint(1, 3))], root)
        return None
    if label == "non_finite":
        cli([*args, "--fault.kind", "nan", "--fault.step", str(step), "--fault.count", "20", "--fault.rank", str(rank),
             "--guard.max_rollbacks", str(rng.choice([0, 1]))], root)
        return None
    if label == "loss_spike":
        spike = [*layout, *base(root, run, cache, 18, every), "--fault.kind", "spike", "--fault.step", str(rng.randint(14, 16)),
                 "--fault.rank", str(rank), "--guard.spike_zscore", "5", "--guard.spike_window", "10",
                 "--guard.max_bad_steps", "1", "--guard.max_rollbacks", "0"]
        cli(spike, root)
        return None
    if label == "config_error":
        cli(args, root)
        change = rng.choice([["--train.seed", "99"], ["--train.seq_len", "16"], ["--train.micro_batch_size", "4"],
                             ["--data.val_fraction", "0.3"]])
        cli([*args, *change, "--train.steps", "12", "--resume", "auto"], root)
        return None
    if label == "checkpoint_corrupt":
        cli([*args, "--fault.kind", "corrupt_save", "--fault.step", "10"], root)
        cli([*args, "--train.steps", "12", "--resume", str(run / "step-000010")], root)
        return None
    if label == "data_error":
        own = root / f"cache-{run.name}"
        cli([*layout, *base(root, run.with_name(run.name + "-warm"), own, 2, 0)], root)
        token_file = next(own.glob("tokens-*-train.bin"))
        data = bytearray(token_file.read_bytes())
        data[rng.randrange(64, len(data))] ^= 0x10
        token_file.write_bytes(bytes(data))
        cli([*layout, *base(root, run, own, 10, every)], root)
        return None
    if label == "launcher_died":
        env = {**os.environ}
        env.pop("WORLD_SIZE", None)
        launcher = subprocess.Popen([sys.executable, "-m", "fivefold", "train", *layout,
                                     *base(root, run, cache, 100000, 100000)], cwd=root, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and len(list((run / "heartbeats").glob("rank-*.json"))) < 2:
            time.sleep(0.5)
        time.sleep(rng.uniform(1, 4))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        time.sleep(2)
        return None
    raise ValueError(label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--classes", default=",".join(CLASSES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from fivefold.reliability.diagnose import diagnose

    labels = [c for c in args.classes.split(",") if c]
    unknown = set(labels) - set(CLASSES)
    if unknown:
        raise SystemExit(f"unknown classes {sorted(unknown)}; choose from {', '.join(CLASSES)}")
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus(root / "corpus")
        for label in labels:
            for i in range(args.per_class):
                run = root / f"{label}-{i}"
                start = time.perf_counter()
                culprit = make_case(label, rng, root, run)
                found = diagnose(run)
                culprit_ok = culprit is None or culprit in found.culprits
                rows.append({"label": label, "found": found.kind, "culprit": culprit, "found_culprits": found.culprits,
                             "ok": found.kind == label, "culprit_ok": culprit_ok, "seconds": time.perf_counter() - start})
                print(f"{label:<19} -> {found.kind:<19} {'ok ' if found.kind == label else 'WRONG'}"
                      f"{'' if culprit_ok else f'  culprit {culprit} not in {found.culprits}'}", flush=True)
                shutil.rmtree(run, ignore_errors=True)
    correct = sum(r["ok"] for r in rows)
    culprits = [r for r in rows if r["culprit"] is not None]
    culprit_ok = sum(r["ok"] and r["culprit_ok"] for r in culprits)
    print(f"{correct}/{len(rows)} runs named correctly; culprit rank right in {culprit_ok}/{len(culprits)} "
          "runs with a culprit")
    print(f"RESULT name=diagnosis accuracy={correct / len(rows):.4f} "
          f"culprit_accuracy={culprit_ok / max(len(culprits), 1):.4f} runs={len(rows)} classes={len(labels)}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
