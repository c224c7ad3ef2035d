"""Run `python -m fivefold ...` as a user would (torchrun underneath for --nproc-per-node > 1)."""

import os
import subprocess
import sys


def run_cli(args, cwd, timeout=240, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "fivefold", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def micro_args(corpus_dir, tmp_path, output: str, steps: int = 10) -> list[str]:
    """A micro model on the test corpus, quiet: the arguments every fault test starts from."""
    return ["--data.source", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"), "--data.val_fraction", "0.2",
            "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
            "--model.multiple_of", "16", "--model.max_seq_len", "64", "--train.steps", str(steps), "--train.seq_len", "32",
            "--train.micro_batch_size", "2", "--train.eval_every", "0", "--train.output_dir", str(tmp_path / output),
            "--optim.lr", "1e-2", "--optim.warmup_steps", "2", "--logging.progress", "false",
            "--logging.tensorboard", "false", "--logging.plot", "false", "--logging.sample_tokens", "0"]
