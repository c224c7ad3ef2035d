"""No code from files, and no damaged file read as data (issue items 1 and 2).

An attacker who can write a checkpoint folder can also rewrite its manifest, so each crafted file
here comes with a consistent manifest: what stops it is the restricted unpickler, the tensor-only
planner, the storage-path check and torch.load(weights_only=True), not the checksums. Accidental
damage (flipped bytes, truncation, a missing file, a damaged manifest) is caught by the manifest,
with an error naming the file and the step, in every path that reads a checkpoint.
"""

import dataclasses
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.filesystem import _StorageInfo

from fivefold.cli import main
from fivefold.errors import CheckpointError
from fivefold.reliability.manifest import write_manifest
from fivefold.reliability.safe_dcp import unpickle_metadata
from fivefold.train.checkpoint import open_checkpoint, read_weights, verify_checkpoint
from fivefold.train.trainer import Trainer


class Payload:
    """Unpickling this runs a shell command (the classic pickle attack)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    """A finished 4-step run (checkpoints at steps 2 and 4), copied fresh for each test."""
    from conftest import micro_model
    from fivefold.config import JobConfig

    root = tmp_path_factory.mktemp("trained")
    cfg = JobConfig()
    cfg.model = micro_model()
    cfg.data = dataclasses.replace(cfg.data, source=str(corpus_dir), cache_dir=str(root / "cache"), val_fraction=0.2)
    cfg.train = dataclasses.replace(cfg.train, steps=4, seq_len=32, micro_batch_size=2, eval_every=0,
                                    output_dir=str(root / "run"), peak_tflops=1.0)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=2)
    cfg.logging = dataclasses.replace(cfg.logging, progress=False, tensorboard=False, plot=False, sample_prompt="")
    Trainer(cfg.validate()).fit()
    return root / "run"


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def rewrite_manifest(folder: Path) -> None:
    """What an attacker does after changing a file: a manifest consistent with the new content."""
    body = json.loads((folder / "meta.json").read_text())
    write_manifest(folder, {k: body[k] for k in ("format", "step", "run_id", "written_at")})


def flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    position = len(data) // 2 if offset is None else offset
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------ item 1: no code
def test_crafted_metadata_pickle_is_refused_without_running_it(run, tmp_path, capsys):
    marker = tmp_path / "pwned"
    folder = run / "step-000004"
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(folder)
    with pytest.raises(CheckpointError, match=r"state/.metadata asks to load posix.system.*refused"):
        verify_checkpoint(folder)
    with pytest.raises(CheckpointError, match="refused"):
        read_weights(folder)
    for argv, stream in ((["verify", str(run)], "out"),
                         (["generate", "--checkpoint", str(folder), "--prompt", "x", "--max-new-tokens", "1"], "err"),
                         (["convert", "--checkpoint", str(folder), "--to", str(tmp_path / "hf")], "err")):
        assert main(argv) == 2
        assert "refused" in getattr(capsys.readouterr(), stream), argv
    assert not marker.exists()  # the payload never ran


def test_resume_of_a_crafted_checkpoint_runs_nothing(run, tmp_path, capsys, corpus_dir):
    marker = tmp_path / "pwned-resume"
    folder = run / "step-000004"
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(folder)
    args = ["train", "--data.source", str(corpus_dir), "--data.cache_dir", str(run.parent / "c"),
            "--data.val_fraction", "0.2", "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--model.multiple_of", "16", "--model.max_seq_len", "64", "--train.seq_len", "32",
            "--train.micro_batch_size", "2", "--train.steps", "6", "--train.output_dir", str(run),
            "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.sample_tokens", "0"]
    assert main([*args, "--resume", str(folder)]) == 2
    assert "refused" in capsys.readouterr().err
    assert main([*args, "--resume", "auto"]) == 0  # auto skips it, saying why, and resumes from step 2
    out = capsys.readouterr().out
    assert "skipping step-000004" in out and "resuming from" in out and "step-000002" in out
    assert not marker.exists()


def test_bytes_entries_are_refused_even_in_a_consistent_index(run):
    """DCP hands entries declared as bytes to torch.load(weights_only=False): a crafted index must not get there."""
    folder = run / "step-000004"
    path = folder / "state" / ".metadata"
    metadata = unpickle_metadata(path.read_bytes(), "test")
    fqn = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    path.write_bytes(pickle.dumps(metadata))
    rewrite_manifest(folder)
    with pytest.raises(CheckpointError, match=f"entry '{fqn}' is stored as BytesStorageMetadata.*refused"):
        read_weights(folder)


def test_storage_paths_outside_the_folder_are_refused(run):
    folder = run / "step-000004"
    path = folder / "state" / ".metadata"
    metadata: Metadata = unpickle_metadata(path.read_bytes(), "test")
    index: MetadataIndex = next(iter(metadata.storage_data))
    info: _StorageInfo = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../../../../etc/passwd")
    path.write_bytes(pickle.dumps(metadata))
    rewrite_manifest(folder)
    with pytest.raises(CheckpointError, match="points outside its folder"):
        verify_checkpoint(folder)


def test_rng_state_is_loaded_with_weights_only(run, tmp_path):
    marker = tmp_path / "pwned-rng"
    folder = run / "step-000004"
    buffer = io.BytesIO()
    torch.save({"cpu": Payload(marker)}, buffer)
    (folder / "rng.pt").write_bytes(buffer.getvalue())
    rewrite_manifest(folder)
    with pytest.raises(CheckpointError, match="rng.pt is not a readable RNG state"):
        verify_checkpoint(folder)
    assert not marker.exists()


# ------------------------------------------------------------------------------------ item 2: verified
@pytest.mark.parametrize("name", ["state/.metadata", "state/__0_0.distcp", "layout.json", "trainer.json", "config.json",
                                  "rng.pt", "tokenizer.txt"])
def test_a_flipped_byte_in_any_file_names_that_file_and_the_step(run, name, capsys):
    folder = run / "step-000004"
    flip(folder / name)
    with pytest.raises(CheckpointError, match=rf"step-000004 \(step 4\): {name} fails its checksum"):
        verify_checkpoint(folder)
    assert main(["verify", str(run)]) == 2
    out = capsys.readouterr().out
    assert f"BAD  {folder}" in out and f"OK   {run / 'step-000002'}" in out


def test_truncated_missing_and_unlisted_files(run):
    folder = run / "step-000004"
    distcp = folder / "state" / "__0_0.distcp"
    distcp.write_bytes(distcp.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="__0_0.distcp has 100 bytes, its manifest says"):
        verify_checkpoint(folder)
    (folder / "layout.json").unlink()
    with pytest.raises(CheckpointError, match="layout.json is missing"):
        open_checkpoint(folder).read_json("layout.json")
    with pytest.raises(CheckpointError, match="not listed in its manifest"):
        open_checkpoint(folder).read_bytes("extra.bin")


def test_a_damaged_manifest_is_told_apart_from_a_damaged_file(run):
    folder = run / "step-000004"
    body = json.loads((folder / "meta.json").read_text())
    body["step"] = 5  # valid JSON, wrong content
    (folder / "meta.json").write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="meta.json fails its own checksum"):
        open_checkpoint(folder)
    (folder / "meta.json").write_bytes(b"\x00\xff garbage")
    with pytest.raises(CheckpointError, match="not a readable manifest"):
        open_checkpoint(folder)


def test_checkpoints_of_the_earlier_format_are_refused_with_the_way_out(run):
    folder = run / "step-000004"
    body = json.loads((folder / "meta.json").read_text())
    write_manifest(folder, {**{k: body[k] for k in ("step", "run_id", "written_at")}, "format": 2})
    with pytest.raises(CheckpointError, match="has format 2; this fivefold reads format 3.*fivefold convert"):
        open_checkpoint(folder)


# ------------------------------------------------------------------------------------ exports
def test_export_is_readable_checksummed_and_verified_on_load(run, tmp_path, capsys):
    from fivefold.model.hf import load_hf

    out = tmp_path / "hf"
    assert main(["convert", "--checkpoint", str(run), "--to", str(out)]) == 0
    files = [p for p in out.iterdir() if p.is_file()]
    assert {"model.safetensors", "config.json", "tokenizer.txt", "fivefold-manifest.json"} == {p.name for p in files}
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in files) and out.stat().st_mode & 0o777 == 0o755
    assert main(["verify", str(out)]) == 0
    weights = read_weights(run / "step-000004")
    loaded = load_hf(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    flip(out / "model.safetensors", offset=-8)
    with pytest.raises(CheckpointError, match="model.safetensors fails its checksum"):
        load_hf(out)
    capsys.readouterr()
    assert main(["verify", str(out)]) == 2 and "BAD" in capsys.readouterr().out
    assert main(["convert", "--checkpoint", str(run), "--to", str(out)]) == 0  # an earlier export is replaced
    foreign = tmp_path / "someone-elses"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(["convert", "--checkpoint", str(run), "--to", str(foreign)]) == 2
    assert (foreign / "notes.txt").read_text() == "keep me"


CHECKPOINT_FILES = ["state/.metadata", "state/__0_0.distcp", "layout.json", "trainer.json", "config.json", "rng.pt",
                    "tokenizer.txt", "meta.json"]
READ_BY_GENERATE = {"state/.metadata", "state/__0_0.distcp", "layout.json", "config.json", "tokenizer.txt", "meta.json"}


@pytest.mark.parametrize("damage", ["emptied", "halved", "flipped"])
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_every_damaged_file_is_one_clear_line_for_every_reader(run, name, damage, capsys):
    """24 damaged checkpoints: `generate` (for the files it reads) and `verify` (all of them) name the file."""
    folder = run / "step-000004"
    path = folder / name
    data = path.read_bytes()
    if damage == "emptied":
        path.write_bytes(b"")
    elif damage == "halved":
        path.write_bytes(data[: len(data) // 2])
    else:
        flip(path)
    if name in READ_BY_GENERATE:
        code = main(["generate", "--checkpoint", str(folder), "--prompt", "x", "--max-new-tokens", "1"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("fivefold: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert name in err
    assert main(["verify", str(folder)]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"BAD  {folder}") and name in out and "Traceback" not in out
