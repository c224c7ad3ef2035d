"""Resume that picks right, and output folders that lose nothing (issue item 3)."""

import dataclasses
from pathlib import Path
import json
import shutil

import pytest

from fivefold.config import JobConfig
from fivefold.errors import CheckpointError, ConfigError
from fivefold.train.checkpoint import TrainerState, list_checkpoints
from fivefold.train.metrics import read_metrics
from fivefold.train.resume import plan_start, resume_settings
from fivefold.train.trainer import Trainer


def change(job: JobConfig, **sections) -> JobConfig:
    out = dataclasses.replace(job)
    for section, values in sections.items():
        setattr(out, section, dataclasses.replace(getattr(out, section), **values))
    return out.validate()


@pytest.fixture
def finished(job):
    """A finished 6-step run with checkpoints at steps 3 and 6."""
    Trainer(job).fit()
    return job


def test_auto_takes_the_newest_verified_checkpoint_and_says_why_it_skipped_one(finished):
    out = Path(finished.train.output_dir)
    distcp = next((list_checkpoints(out)[-1] / "state").glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:-10] + b"0123456789")
    trainer = Trainer(change(finished, checkpoint={"resume": "auto"}, train={"steps": 8}))
    assert trainer.state.step == 3 and trainer.resumed_from.name == "step-000003"
    notes = trainer.checkpoints.plan.notes
    assert "skipping step-000006" in notes[0] and "fails its checksum" in notes[0] and "resuming from" in notes[1]


def test_auto_with_only_damaged_checkpoints_stops_and_lists_each(finished):
    for folder in list_checkpoints(finished.train.output_dir):
        (folder / "trainer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint(.|\n)*step-000006(.|\n)*step-000003(.|\n)*--overwrite"):
        Trainer(change(finished, checkpoint={"resume": "auto"}))


def test_a_finished_run_given_auto_says_it_is_complete(finished, capsys):
    result = Trainer(change(finished, checkpoint={"resume": "auto"})).fit()
    assert "is complete" in capsys.readouterr().out
    assert result.steps == 6 and result.final_loss == pytest.approx(read_metrics(result.metrics_path)[-2]["loss"])
    assert result.losses == []  # nothing was trained


def test_metrics_are_appended_with_the_restart_marked_and_a_torn_line_skipped(finished, capsys):
    path = Path(finished.train.output_dir) / "metrics.jsonl"
    before = path.read_text()
    path.write_text(before + '{"step": 9, "loss": 1.0, "lr"')  # a crash cut the last line
    Trainer(change(finished, checkpoint={"resume": "auto"}, train={"steps": 8})).fit()
    text = path.read_text()
    assert text.startswith(before)  # nothing truncated
    lines = text.splitlines()
    marker = json.loads(lines[len(before.splitlines()) + 1])
    assert marker["event"] == "resume" and marker["step"] == 6
    capsys.readouterr()
    timeline = read_metrics(path)
    assert "skipping a damaged line" in capsys.readouterr().out
    assert [r["step"] for r in timeline if "loss" in r] == [2, 4, 6, 8]


def test_the_timeline_drops_records_past_a_resume_point(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 2, "loss": 3.0}, {"step": 4, "loss": 2.0}, {"step": 6, "loss": 9.0},
               {"event": "resume", "step": 4}, {"step": 6, "loss": 1.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(2, 3.0), (4, 2.0), (6, 1.5)]


def test_a_fresh_run_into_another_runs_folder_is_refused_unless_overwrite(finished, capsys):
    with pytest.raises(ConfigError, match="holds another run .*step-000003.*--resume auto.*--overwrite"):
        Trainer(finished)
    (Path(finished.train.output_dir) / "notes.txt").write_text("mine")
    Trainer(change(finished, checkpoint={"overwrite": True}, train={"steps": 2})).fit()
    out = Path(finished.train.output_dir)
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    assert (out / "notes.txt").read_text() == "mine"  # only fivefold's own files go
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [2]


def test_a_folder_with_only_diagnostics_of_a_failed_start_is_reused(job):
    out = Path(job.train.output_dir)
    (out / "events").mkdir(parents=True)
    (out / "events" / "rank-00000.jsonl").write_text('{"event": "start"}\n')
    (out / "failure.json").write_text("{}")
    assert plan_start(job, out).error is None
    Trainer(change(job, train={"steps": 1})).fit()
    assert not (out / "failure.json").exists()


def test_changed_data_settings_are_refused_listing_each_unless_allowed(finished):
    resumed = {"resume": "auto"}
    with pytest.raises(ConfigError, match=r"train.seed: 1234 -> 7.*train.seq_len: 32 -> 16.*--checkpoint.allow_changes"):
        Trainer(change(finished, checkpoint=resumed, train={"seed": 7, "seq_len": 16, "steps": 8}))
    with pytest.raises(ConfigError, match=r"the global batch .*: 4 -> 8 \(8 x 1 x 1\)"):
        Trainer(change(finished, checkpoint=resumed, train={"micro_batch_size": 8, "steps": 8}))
    with pytest.raises(ConfigError, match=r"the global batch .*: 4 -> 8 \(4 x 2 x 1\)"):
        Trainer(change(finished, checkpoint=resumed, train={"grad_accum_steps": 2, "steps": 8}))
    with pytest.raises(ConfigError, match=r"data.val_fraction: 0.2 -> 0.25"):
        Trainer(change(finished, checkpoint=resumed, data={"val_fraction": 0.25}, train={"steps": 8}))
    allowed = Trainer(change(finished, checkpoint={**resumed, "allow_changes": True}, train={"seed": 7, "steps": 8}))
    assert allowed.state.step == 6 and allowed.state.seed == 7  # trainer.json records the seed the run now uses
    split = Trainer(change(finished, checkpoint=resumed, train={"micro_batch_size": 2, "grad_accum_steps": 2, "steps": 8}))
    assert split.state.step == 6  # the same global batch, split otherwise: the same run


def test_other_data_is_refused_by_its_fingerprint(finished, tmp_path):
    source = tmp_path / "other-corpus"
    shutil.copytree(finished.data.source, source)
    (source / "doc00.txt").write_text("different text\n" * 30)
    with pytest.raises(ConfigError, match="data.source.*the training tokens"):
        Trainer(change(finished, checkpoint={"resume": "auto"}, data={"source": str(source)}, train={"steps": 8}))


@pytest.mark.parametrize("dp, accum", [(4, 3), (3, 4), (2, 6), (1, 12), (6, 2)])
def test_an_elastic_resume_keeps_the_global_batch(job, dp, accum):
    saved = TrainerState(step=4, tokens_seen=0, seed=1234, global_batch=12, data_parallel=4, grad_accum_configured=3)
    config = change(job, train={"micro_batch_size": 1, "grad_accum_steps": 3})
    before = {**config.to_dict(), "model": dataclasses.asdict(job.model)}
    before["train"] = {**before["train"], "grad_accum_steps": 5}  # what an earlier elastic resume saved
    settings = resume_settings(before, saved, config, dataclasses.asdict(job.model), dp, "")
    assert settings.grad_accum_steps == accum and not settings.refused
    if dp != 4:
        assert f"data-parallel ranks 4 -> {dp}" in settings.changed[0]


def test_an_elastic_resume_that_cannot_keep_the_global_batch_is_refused(job):
    saved = TrainerState(step=4, tokens_seen=0, seed=1234, global_batch=12, data_parallel=4)
    config = change(job, train={"micro_batch_size": 1, "grad_accum_steps": 3})
    before = {**config.to_dict(), "model": dataclasses.asdict(job.model)}
    settings = resume_settings(before, saved, config, dataclasses.asdict(job.model), 5, "")
    assert settings.refused and "12 -> 15" in settings.refused[0]
