"""configs/tiny-moe.toml trains at EP 2 with the progress bar and writes the expert-load plot (shortened)."""

from __future__ import annotations

import json
from pathlib import Path

from distributed.spawn import run_distributed

ROOT = Path(__file__).parent.parent.parent


def _run(rank: int, world_size: int, output_dir: str) -> str:
    from fivefold.config import load_config
    from fivefold.train.roles import run

    config = load_config(ROOT / "configs" / "tiny-moe.toml", [
        "--train.steps", "3", "--train.seq_len", "32", "--train.micro_batch_size", "2", "--train.eval_every", "3",
        "--train.eval_batches", "1", "--train.log_every", "1", "--train.output_dir", output_dir,
        "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.moe_ffn_dim", "32", "--checkpoint.every", "0", "--logging.tensorboard", "false"])
    result = run(config)
    return str(result.checkpoint)


def test_tiny_moe_config_trains_at_ep2_and_plots_expert_load(tmp_path):
    out = tmp_path / "moe"
    run_distributed(_run, 2, str(out), timeout=240)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "moe_load" in r]
    assert [r["step"] for r in logged] == [1, 2, 3]
    for r in logged:
        assert set(r["moe_load"]) == {"0", "1"} and all(len(v) == 8 for v in r["moe_load"].values())
        # 2 ranks x 2 sequences x 32 tokens x top-2 assignments per layer
        assert all(sum(v) == 2 * 2 * 32 * 2 for v in r["moe_load"].values())
        assert r["moe_alltoall_bytes"] > 0 and r["moe_dropped"] == 0.0 and r["moe_imbalance"] >= 1.0
        assert r["moe_max_received"] <= 2 * 64 * 2  # the bound: ep x tokens x min(k, E/ep)
    assert (out / "expert_load.png").stat().st_size > 0
