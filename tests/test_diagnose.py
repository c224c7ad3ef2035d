"""`fivefold diagnose` (issue item 9) on a labelled subset of the corpus benchmarks/diagnosis.py builds in full.

Each class is produced the way it happens, in tiny single-process runs through the real command
line (so the records are the ones a user's run leaves); the multi-rank classes (rank_hung,
collective_timeout, launcher_died, completed after a restart) are diagnosed in
tests/distributed/test_faults.py, and the rules that read the launcher's exit codes and the
heartbeats are checked here on written records.
"""

import json
import time

import pytest

from fivefold.cli import main
from fivefold.reliability.diagnose import diagnose, format_diagnosis


@pytest.fixture
def train(corpus_dir, tmp_path):
    def run(output: str, *extra: str) -> int:
        return main(["train", "--data.source", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"),
                     "--data.val_fraction", "0.2", "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
                     "--train.steps", "4", "--train.seq_len", "32", "--train.micro_batch_size", "2",
                     "--train.eval_every", "0", "--checkpoint.every", "2", "--train.output_dir", str(tmp_path / output),
                     "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.plot", "false",
                     "--logging.sample_tokens", "0", *extra])
    return run


@pytest.mark.parametrize("kind, fault, code", [
    ("completed", [], 0),
    ("exception", ["--fault.kind", "exception", "--fault.step", "3"], 1),
    ("out_of_memory", ["--fault.kind", "oom", "--fault.step", "3"], 3),
    ("disk_full", ["--fault.kind", "disk_full", "--fault.step", "2"], 2),
    ("non_finite", ["--fault.kind", "nan", "--fault.step", "1", "--fault.count", "4", "--guard.max_rollbacks", "0"], 3),
    ("loss_spike", ["--train.steps", "14", "--fault.kind", "spike", "--fault.step", "13", "--guard.spike_zscore", "5",
                    "--guard.max_bad_steps", "1", "--guard.max_rollbacks", "0", "--guard.spike_window", "10"], 3),
])
def test_injected_faults_are_named(train, tmp_path, kind, fault, code, capsys):
    assert train("run", *fault) == code
    found = diagnose(tmp_path / "run")
    assert found.kind == kind, format_diagnosis(found)
    if kind != "completed":
        assert found.culprits == [0] and found.evidence[0].startswith("events/rank-00000.jsonl:")


def test_a_changed_setting_at_resume_is_a_config_error(train, tmp_path):
    assert train("run") == 0
    assert train("run", "--train.seed", "9", "--train.steps", "6", "--resume", "auto") == 2
    found = diagnose(tmp_path / "run")
    assert found.kind == "config_error" and "train.seed: 1234 -> 9" in found.evidence[0]


def test_a_damaged_checkpoint_given_to_resume_is_named(train, tmp_path):
    assert train("run") == 0
    distcp = next((tmp_path / "run" / "step-000004" / "state").glob("*.distcp"))
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0xFF
    distcp.write_bytes(bytes(data))
    assert train("run", "--train.steps", "6", "--resume", str(tmp_path / "run" / "step-000004")) == 2
    found = diagnose(tmp_path / "run")
    assert found.kind == "checkpoint_corrupt" and "fails its checksum" in found.evidence[0]


def test_a_damaged_token_cache_is_a_data_error(train, tmp_path):
    assert train("run") == 0
    cache = next((tmp_path / "cache").glob("tokens-*-train.bin"))
    cache.write_bytes(cache.read_bytes()[:-2] + b"\xff\xff")
    assert train("run2") == 2
    found = diagnose(tmp_path / "run2")
    assert found.kind == "data_error" and "fails its checksum" in found.evidence[0]


def _write(folder, name, records):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_rank_killed_by_a_signal_is_read_from_the_launcher(tmp_path):
    now = time.time()
    _write(tmp_path, "launcher.jsonl", [{"time": now - 5, "event": "start"},
                                        {"time": now, "event": "failed", "failures": {"1": -9, "0": -15}}])
    survivor_error = {"time": now - 1, "event": "error", "step": 7, "type": "RuntimeError", "attempt_id": "a",
                      "message": "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"}
    for rank in (0, 1):  # rank 0 only reacted to rank 1's death: its error is a consequence, not the cause
        _write(tmp_path, f"events/rank-0000{rank}.jsonl",
               [{"time": now - 4, "event": "start", "attempt_id": "a"}] + ([survivor_error] if rank == 0 else []))
        (tmp_path / "heartbeats").mkdir(exist_ok=True)
        (tmp_path / "heartbeats" / f"rank-0000{rank}.json").write_text(json.dumps(
            {"rank": rank, "attempt_id": "a", "state": "running", "step": 7, "time": now - 1}))
    found = diagnose(tmp_path)
    assert (found.kind, found.culprits, found.step) == ("rank_died", [1], 7)  # the SIGTERM is torchrun stopping rank 0
    assert "rank 1 killed by SIGKILL" in format_diagnosis(found)


def test_nothing_to_read_is_unknown(tmp_path):
    assert diagnose(tmp_path).kind == "unknown"
