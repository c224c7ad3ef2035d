"""Checkpoints: exact resume, atomic writes, retention by write order, mismatch errors."""

import dataclasses
import json

import pytest
import torch

from fivefold.errors import CheckpointError
from fivefold.train.checkpoint import latest_checkpoint, list_checkpoints, read_weights
from fivefold.train.resume import plan_start
from fivefold.train.trainer import Trainer


def test_resume_is_bit_exact(job, tmp_path):
    """2N steps in one run == N steps, save, new process state, resume, N steps: identical losses and bits."""
    job.checkpoint = dataclasses.replace(job.checkpoint, every=0)
    straight = Trainer(job).fit()
    reference = Trainer(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume="auto")))
    # Load the finished run's weights through a fresh trainer to compare against later.
    final_weights = {k: v.clone() for k, v in reference.model.state_dict().items()}

    interrupted = dataclasses.replace(job, train=dataclasses.replace(job.train, output_dir=str(tmp_path / "resumed")))
    first = Trainer(interrupted)
    first_losses = [first.train_step()["loss"] for _ in range(3)]
    first.save()
    torch.manual_seed(999)  # disturb the global RNG: resume must restore it
    second = Trainer(dataclasses.replace(interrupted, checkpoint=dataclasses.replace(job.checkpoint, resume="auto")))
    assert second.state.step == 3
    rest = second.fit()
    assert first_losses + rest.losses == straight.losses  # exactly equal floats
    for name, tensor in second.model.state_dict().items():
        assert torch.equal(tensor, final_weights[name]), name


def test_retention_and_atomicity(job):
    job.checkpoint = dataclasses.replace(job.checkpoint, every=1, keep_last=2)
    run = Trainer(job)
    run.fit()
    out = run.output_dir
    assert [p.name for p in list_checkpoints(out)] == ["step-000005", "step-000006"]
    # A crash mid-save leaves only a temporary folder, or a step folder without meta.json: both ignored.
    (out / ".tmp-step-000007-12345").mkdir()
    broken = out / "step-000008"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(out).name == "step-000006"
    explicit = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume=str(broken)))
    assert "no meta.json" in plan_start(explicit, out).error
    run.save()
    assert not (out / ".tmp-step-000007-12345").exists() and not broken.exists()  # incomplete folders removed


def test_pruning_keeps_the_most_recently_written_of_this_run(job):
    """A checkpoint written after higher-numbered ones (a rollback) survives; another run's are never touched."""
    job.checkpoint = dataclasses.replace(job.checkpoint, every=2, keep_last=2)
    run = Trainer(job)
    run.fit()  # step-000004, step-000006
    out = run.output_dir
    foreign = out / "step-000099"
    (out / "step-000006").rename(foreign)  # pretend another run wrote this one
    meta = json.loads((foreign / "meta.json").read_text())
    meta["run_id"] = "another-run"
    (foreign / "meta.json").write_text(json.dumps(meta))
    run.state.step = 2  # as after a rollback: a lower step, written last
    run.save()
    run.checkpoints.wait()
    assert sorted(p.name for p in list_checkpoints(out)) == ["step-000002", "step-000004", "step-000099"]
    run.state.step = 3
    run.save()
    assert sorted(p.name for p in list_checkpoints(out)) == ["step-000002", "step-000003", "step-000099"]


def test_checkpoint_files(job):
    job.checkpoint = dataclasses.replace(job.checkpoint, every=0)
    folder = Trainer(job).fit().checkpoint
    names = {p.name for p in folder.iterdir()}
    assert {"state", "layout.json", "rng.pt", "trainer.json", "config.json", "meta.json", "tokenizer.txt"} <= names
    assert (folder / "state" / ".metadata").is_file() and list((folder / "state").glob("*.distcp"))
    torch.load(folder / "rng.pt", weights_only=True)
    trainer_state = json.loads((folder / "trainer.json").read_text())
    assert trainer_state["step"] == 6 and trainer_state["global_batch"] == 4 and trainer_state["data_parallel"] == 1
    manifest = json.loads((folder / "meta.json").read_text())
    listed = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {"meta.json"}
    assert set(manifest["files"]) == listed and manifest["format"] == 3 and manifest["hash"] == "xxh3-128"
    layout = json.loads((folder / "layout.json").read_text())
    assert list(layout)[0] == "layers.0/decay" and list(layout)[-3:] == ["tok_embeddings/decay", "norm/no_decay", "output/decay"]


def test_weights_read_back_without_the_trainer(job):
    """The consolidated weights read from the DCP state equal the trained model's."""
    job.checkpoint = dataclasses.replace(job.checkpoint, every=0)
    trainer = Trainer(job)
    folder = trainer.fit().checkpoint
    weights = read_weights(folder)
    expected = dict(trainer.model.named_parameters())
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name].detach().cpu()), name


def test_resume_with_another_model_is_refused(job):
    Trainer(job).fit()
    changed = dataclasses.replace(job, model=dataclasses.replace(job.model, dim=64),
                                  checkpoint=dataclasses.replace(job.checkpoint, resume="auto"))
    with pytest.raises(CheckpointError, match="model.dim"):
        Trainer(changed)


def test_resume_none_and_missing_folder(job, tmp_path):
    assert plan_start(job, tmp_path / "empty").resume_from is None
    auto = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume="auto"))
    plan = plan_start(auto, tmp_path / "empty")
    assert plan.resume_from is None and "starting fresh" in plan.notes[0]
    missing = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume=str(tmp_path / "nope")))
    assert "no such folder" in plan_start(missing, tmp_path).error
