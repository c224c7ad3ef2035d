"""Every bad input gets a clear error (issue item 10): a fuzz over generated bad settings and files.

Each case runs the real command line in-process and must end with a non-zero exit and exactly
one line `fivefold: error: ...` that names the setting or file, with no traceback; none may be
silently accepted. The settings cases are generated from the config schema itself, so a key
added later is fuzzed too: nan, inf and -inf for every float, a negative, a fraction and a word
for every integer, a non-boolean for every switch, an unknown name for every choice.
"""

import dataclasses
import json
import typing

import pytest

from fivefold.cli import main
from fivefold.config import SECTIONS, JobConfig

NEGATIVE_OK = {"data_parallel.replicate": "-1"}  # -1 means "all ranks"; -5 must still fail
CHOICES = {"data.tokenizer", "train.dtype", "train.device", "train.recompute", "optim.schedule", "data_parallel.param_dtype",
           "data_parallel.mode", "context_parallel.method", "pipeline_parallel.schedule", "pipeline_parallel.balance",
           "gradient_comm.reduce_dtype", "gradient_comm.allreduce_algorithm", "gradient_comm.schedule",
           "gradient_comm.compression", "parameter_server.sync", "fault.kind", "model.attention_bias", "model.qk_norm",
           "model.norm_position", "model.rope_scaling"}


def generated_settings() -> list[tuple[str, str]]:
    cases = []
    for section in SECTIONS:
        obj = getattr(JobConfig(), section)
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            key, kind = f"{section}.{f.name}", hints[f.name]
            if kind is float:
                cases += [(key, "nan"), (key, "inf"), (key, "-inf")]
            elif kind is int:
                cases += [(key, "-5"), (key, "2.5"), (key, "many")]
            elif kind is bool:
                cases.append((key, "maybe"))
            elif key in CHOICES:
                cases.append((key, "bogus"))
    return cases


SETTINGS = generated_settings()


def assert_one_clear_line(code: int, err: str, *names: str) -> None:
    assert code not in (0, 1), f"exit {code}: {err}"  # 1 would be an unexpected error (a traceback's message)
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[0].startswith("fivefold: error: "), err
    assert sum(line.startswith("fivefold: error") for line in lines) == 1, err
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"


def test_the_fuzz_covers_at_least_a_hundred_settings():
    assert len(SETTINGS) >= 100


@pytest.mark.parametrize("key, value", SETTINGS, ids=[f"{k}={v}" for k, v in SETTINGS])
def test_a_bad_setting_names_itself(key, value, capsys):
    code = main(["config", f"--{key}", value])
    assert_one_clear_line(code, capsys.readouterr().err, key)


@pytest.fixture
def train(corpus_dir, tmp_path, capsys):
    base = ["train", "--data.source", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"), "--data.val_fraction",
            "0.2", "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--train.steps", "2",
            "--train.seq_len", "32", "--train.micro_batch_size", "2", "--train.output_dir", str(tmp_path / "run"),
            "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.sample_tokens", "0"]

    def run(*extra: str) -> tuple[int, str]:
        code = main([*base, *extra])
        return code, capsys.readouterr().err
    return run


@pytest.mark.parametrize("extra, names", [
    (["--train.micro_batch_size", "1000000000"], ["train.micro_batch_size", "GiB"]),
    (["--model.dim", "1048576", "--model.n_heads", "4"], ["model.dim", "GiB"]),
    (["--train.eval_batches", "1000000000"], ["train.eval_batches"]),
    (["--train.seed", str(2**70)], ["train.seed"]),
    (["--model.ffn_dim_multiplier", "-1.3"], ["model.ffn_dim_multiplier"]),
    (["--nproc-per-node", "0"], ["--nproc-per-node"]),
    (["--nproc-per-node", "-2"], ["--nproc-per-node"]),
    (["--max-restarts", "-1"], ["--max-restarts"]),
    (["--resume", "/no/such/checkpoint"], ["no such folder"]),
    (["--fault.kind", "kill", "--fault.step", "9"], ["fault.step"]),
    (["--model.rope_scaling", "llama3"], ["model.rope_original_max_seq_len"]),
    (["--model.dim", "30"], ["model.head_dim"]),
    (["--init-from-hf", "/no/such/hf/folder"], ["model.init_from_hf", "no such folder"]),
    (["--model.init_from_hf", "/tmp"], ["config.json"]),
])
def test_impossible_runs_are_refused_before_any_work(train, tmp_path, extra, names):
    code, err = train(*extra)
    assert_one_clear_line(code, err, *names)
    assert not (tmp_path / "run" / "step-000002").exists()


def _files(tmp_path):
    """(what, command-line extra) of bad files, made on demand."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\x00\xff\xfe[train]\x00")
    not_toml = tmp_path / "bad.toml"
    not_toml.write_text("[train\nsteps = = 3\n")
    nul_text = tmp_path / "nul" / "a.txt"
    nul_text.parent.mkdir()
    nul_text.write_bytes(b"some text\x00\x01\x02 and binary")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_bytes(b'{"text": "ok"}\n\xff\xfe\x00garbage\n')
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"body": "x"}\n')
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    garbage_tok = tmp_path / "tokenizer.json"
    garbage_tok.write_bytes(b"\x89PNG not a tokenizer")
    json_tok = tmp_path / "json-tokenizer.json"
    json_tok.write_text(json.dumps({"version": "1.0", "model": "nonsense"}))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {
        "binary toml": (["--config", str(binary)], str(binary)),
        "malformed toml": (["--config", str(not_toml)], str(not_toml)),
        "toml is a folder": (["--config", str(empty)], str(empty)),
        "missing toml": (["--config", str(tmp_path / "none.toml")], "none.toml"),
        "binary text file": (["--data.source", str(nul_text.parent)], "a.txt"),
        "binary jsonl": (["--data.source", str(bad_jsonl)], "bad.jsonl"),
        "jsonl without the field": (["--data.source", str(no_field)], "data.jsonl_field"),
        "folder without text": (["--data.source", str(empty)], "data.source"),
        "missing data": (["--data.source", str(tmp_path / "nowhere")], "nowhere"),
        "unsupported file type": (["--data.source", str(binary)], "binary.toml"),
        "garbage tokenizer.json": (["--data.tokenizer", str(garbage_tok)], "tokenizer.json"),
        "json that is no tokenizer": (["--data.tokenizer", str(json_tok)], "json-tokenizer.json"),
        "missing tokenizer": (["--data.tokenizer", str(tmp_path / "tok" / "tokenizer.json")], "tokenizer.json"),
        "output_dir is a file": (["--train.output_dir", str(a_file)], "train.output_dir"),
        "resume from a file": (["--resume", str(a_file)], "a-file"),
    }


BAD_FILES = ["binary toml", "malformed toml", "toml is a folder", "missing toml", "binary text file", "binary jsonl",
             "jsonl without the field", "folder without text", "missing data", "unsupported file type",
             "garbage tokenizer.json", "json that is no tokenizer", "missing tokenizer", "output_dir is a file",
             "resume from a file"]


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_names_itself(train, tmp_path, case):
    extra, name = _files(tmp_path)[case]
    code, err = train(*extra)
    assert_one_clear_line(code, err, name)


@pytest.mark.parametrize("damage", ["truncated header", "wrong magic", "flipped token", "wrong vocabulary", "padded"])
def test_a_damaged_token_cache_is_named_with_the_fix(train, tmp_path, damage):
    assert train()[0] == 0
    cache = next((tmp_path / "cache").glob("tokens-*-train.bin"))
    data = bytearray(cache.read_bytes())
    if damage == "truncated header":
        data = data[:20]
    elif damage == "wrong magic":
        data[:8] = b"NOTTOKEN"
    elif damage == "flipped token":
        data[100] ^= 0x01
    elif damage == "wrong vocabulary":
        data[12:16] = (1000).to_bytes(4, "little")
    else:
        data += b"\0\0"
    cache.write_bytes(bytes(data))
    code, err = train("--train.output_dir", str(tmp_path / "run2"))
    assert_one_clear_line(code, err, str(cache))
    assert "delete" in err or "rebuilt" in err
