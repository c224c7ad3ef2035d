"""What a newcomer hit (issue item 11): threads per rank, no silent phases, help that helps, clear errors."""

import os
import subprocess
import sys
import time

import pytest
import torch

from fivefold.cli import main
from fivefold.progress import announce
from fivefold.train.setup import available_cores, cap_threads, threads_per_rank


def test_ranks_times_threads_fit_the_cores(monkeypatch):
    cores = available_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads_per_rank(0) == max(1, cores // 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert threads_per_rank(0) == cores and threads_per_rank(3) == 3
    before = torch.get_num_threads()
    try:
        assert cap_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_long_phase_says_what_it_does_and_a_short_one_stays_quiet():
    lines = []
    with announce("quick", lines.append, after=0.5):
        pass
    with announce("tokenising 3 files", lines.append, after=0.2):
        time.sleep(0.5)
    assert lines[0] == "tokenising 3 files ..." and lines[1].startswith("tokenising 3 files: done in")
    assert len(lines) == 2


def test_help_is_instant_and_does_not_import_torch():
    code = ("import sys\nfrom fivefold.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr


def test_train_help_shows_the_overrides_and_the_reference(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--section.key VALUE" in text and "--section.key=VALUE" in text
    assert "fivefold config --reference" in text and "--max-restarts" in text and "--overwrite" in text


def test_plot_schedule_on_a_missing_trace_is_a_clear_error(capsys, tmp_path):
    assert main(["plot-schedule", "--trace", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fivefold: error: --trace") and "pipeline_trace.json" in err and "Traceback" not in err


def test_generate_names_the_checkpoint_it_loaded(job, capsys):
    from fivefold.train.trainer import Trainer

    folder = Trainer(job).fit().checkpoint
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(job.train.output_dir), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert f"generating from {folder} (step 6, verified)" in captured.err and captured.out.startswith("def ")


def test_an_unexpected_error_is_one_line_unless_debug(monkeypatch, capsys):
    import fivefold.cli as cli

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_info", broken)
    assert main(["info", "--model", "tiny"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fivefold: internal error: KeyError") and "--debug" in err and "Traceback" not in err
    with pytest.raises(KeyError):
        main(["--debug", "info", "--model", "tiny"])
