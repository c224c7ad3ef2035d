"""The command line, end to end: info, train, generate, and errors with exit code 2."""

import pytest

from fivefold.cli import main


def test_info_llama3_8b(capsys):
    assert main(["info", "--model", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out
    assert "GQA (8 kv heads)" in out and "mixed-precision Adam" in out


def test_config_prints_the_resolved_config(capsys):
    import json

    assert main(["config", "--model.preset", "small", "--train.steps", "7"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["train"]["steps"] == 7 and resolved["model"]["dim"] == 768


def test_unknown_preset_exits_2(capsys):
    assert main(["info", "--model", "llama-8b"]) == 2
    assert "did you mean 'llama3-8b'" in capsys.readouterr().err


def test_bad_override_fails_before_work(capsys, tmp_path):
    assert main(["train", "--train.output_dir", str(tmp_path / "x"), "--optim.lrr", "1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_train_then_generate(capsys, tmp_path, corpus_dir):
    run = tmp_path / "run"
    args = [
        "train", "--data.source", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"), "--data.val_fraction", "0.2",
        "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--train.steps", "4", "--train.seq_len", "32",
        "--train.micro_batch_size", "2", "--train.output_dir", str(run), "--train.peak_tflops", "1",
        "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.sample_tokens", "5",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "checkpoint:" in out and "unigram baseline" in out and "sample:" in out
    assert main(["generate", "--checkpoint", str(run / "step-000004"), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("def ")
    assert main(["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--no-cache"]) == 0
    assert capsys.readouterr().out == greedy  # run folder -> newest checkpoint; cache == no cache
    assert main([*args, "--train.steps", "6", "--resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_plot_schedule_writes_a_png_and_names_bad_settings(capsys, tmp_path):
    out = tmp_path / "interleaved.png"
    assert main(["plot-schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["plot-schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved",
                 "--output", str(tmp_path / "bad.png")]) == 2
    assert "multiple of pp (4)" in capsys.readouterr().err


def test_a_reader_that_goes_away_stops_the_command_quietly():
    """`fivefold ... | head -1`: the closed pipe ends the command without an 'internal error' message."""
    import subprocess
    import sys

    reader = subprocess.Popen([sys.executable, "-m", "fivefold", "simulate", "--cluster", "h100-sxm", "--gpus", "16",
                               "--config", "configs/tiny.toml", "--vocab-size", "257", "--top-links", "40"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.close()  # nobody reads: the first print meets a closed pipe
    _, err = reader.communicate(timeout=120)
    assert b"internal error" not in err and b"Traceback" not in err, err
