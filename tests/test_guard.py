"""The non-finite guard (issue item 4): skip, roll back, stop; never a non-finite checkpoint; loss spikes."""

import dataclasses
from pathlib import Path
import math

import pytest
import torch

from fivefold.cli import main
from fivefold.errors import TrainingFault
from fivefold.reliability.guard import Action, Check, NonFiniteGuard
from fivefold.train.checkpoint import list_checkpoints, read_weights
from fivefold.train.metrics import read_metrics
from fivefold.train.trainer import Trainer


def change(job, **sections):
    out = dataclasses.replace(job)
    for section, values in sections.items():
        setattr(out, section, dataclasses.replace(getattr(out, section), **values))
    return out.validate()


# ------------------------------------------------------------------------------------ the policy, alone
def test_the_policy_skips_then_rolls_back_then_stops():
    guard = NonFiniteGuard(max_bad_steps=2, max_rollbacks=1, spike_zscore=0, spike_window=50, group=None,
                           distributed=False)
    good, bad = Check(False, "", 1.0), Check(True, "non-finite loss", math.nan)
    assert guard.after_step(good, 0, True) is Action.CONTINUE
    assert guard.after_step(bad, 0, True) is Action.CONTINUE  # skipped
    assert guard.after_step(good, 0, True) is Action.CONTINUE  # the streak is broken
    assert guard.after_step(bad, 0, True) is Action.CONTINUE
    assert guard.after_step(bad, 0, True) is Action.ROLLBACK  # K = 2 in a row
    assert guard.after_step(bad, 1, True) is Action.CONTINUE
    assert guard.after_step(bad, 1, True) is Action.STOP  # R = 1 rollback already spent
    assert guard.after_step(bad, 0, can_skip=False) is Action.STOP  # a scheme that cannot withhold an update


def test_checks_read_the_loss_and_the_norm():
    guard = NonFiniteGuard(3, 2, spike_zscore=4.0, spike_window=20, group=None, distributed=False, replicas=1)
    assert guard.check(torch.tensor(math.inf), 1.0, 10).reason == "non-finite loss"
    assert guard.check(torch.tensor(5.0), math.nan, 10).reason == "non-finite gradient norm"
    assert not guard.check(torch.tensor(5.0), None, 10).bad  # a scheme without a local norm
    for value in [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.1, 1.9, 2.0, 2.0]:
        guard.after_step(Check(False, "", value), 0, True)
    assert not guard.check(torch.tensor(21.0), 1.0, 10).bad  # loss 2.1: within the spread
    spike = guard.check(torch.tensor(60.0), 1.0, 10)  # loss 6.0
    assert spike.bad and spike.reason.startswith("loss spike (z =")


# ------------------------------------------------------------------------------------ in training
def test_a_non_finite_step_updates_nothing_and_is_counted(job):
    trainer = Trainer(change(job, fault={"kind": "nan", "step": 3}, checkpoint={"every": 0}))
    for _ in range(2):
        trainer.train_step()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    metrics = trainer.train_step()  # step 3: NaN loss on this rank
    assert metrics["skipped"] == "non-finite loss" and metrics["skipped_steps"] == 1
    assert all(torch.equal(v, weights[k]) for k, v in trainer.model.state_dict().items())
    for p, state in trainer.optimizer.state.items():
        assert all(torch.equal(state[k], moments[id(p)][k]) for k in state)  # AdamW's step count too
    assert math.isfinite(trainer.train_step()["loss"])  # and the run goes on
    assert trainer.state.skipped_steps == 1


def test_repeated_bad_steps_roll_back_to_the_checkpoint_before_them(job):
    """K = 3 bad steps from step 5: back to step 3 (the checkpoint before the streak), data of 5-7 skipped, lr x 0.5."""
    config = change(job, train={"steps": 9}, fault={"kind": "nan", "step": 5, "count": 3}, checkpoint={"every": 3},
                    guard={"rollback_lr_factor": 0.5})
    result = Trainer(config).fit()
    out = Path(config.train.output_dir)
    metrics = read_metrics(out / "metrics.jsonl", notice=None)
    assert [r["step"] for r in metrics if "loss" in r and "skipped" not in r][-1] == 9
    state = __import__("json").loads((out / "step-000009" / "trainer.json").read_text())
    assert state["rollbacks"] == 1 and state["skipped_steps"] == 3 and state["lr_scale"] == 0.5
    assert state["data_offset"] == 4  # step 4 reads the batch of step 8: the bad batches 5-7 are not replayed
    assert all(math.isfinite(x) for x in result.losses)
    events = (out / "events" / "rank-00000.jsonl").read_text()
    assert '"event": "rollback"' in events and '"to": 3' in events


def test_bad_steps_past_the_rollbacks_allowed_stop_the_run_naming_the_step(job, capsys):
    config = change(job, train={"steps": 9}, fault={"kind": "nan", "step": 4, "count": 9}, checkpoint={"every": 3},
                    guard={"max_rollbacks": 1})
    with pytest.raises(TrainingFault, match=r"training stopped at step \d+: non-finite loss"):
        Trainer(config).fit()


def test_no_checkpoint_to_roll_back_to_stops_with_the_fix(job):
    config = change(job, fault={"kind": "nan", "step": 1, "count": 3}, checkpoint={"every": 0})
    with pytest.raises(TrainingFault, match="no verified checkpoint to roll back to.*checkpoint.every"):
        Trainer(config).fit()


def test_the_cli_exit_code_of_a_stopped_run_is_a_fault(job, capsys, corpus_dir, tmp_path):
    argv = ["train", "--data.source", str(corpus_dir), "--data.cache_dir", str(job.data.cache_dir), "--data.val_fraction",
            "0.2", "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--train.steps", "4",
            "--train.seq_len", "32", "--train.micro_batch_size", "2", "--train.output_dir", str(tmp_path / "cli"),
            "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.sample_tokens", "0",
            "--fault.kind", "nan", "--fault.step", "1", "--fault.count", "4", "--guard.max_rollbacks", "0"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert err.startswith("fivefold: error: training stopped at step 3: non-finite loss") and "Traceback" not in err


def test_a_non_finite_state_is_never_saved(job):
    config = change(job, checkpoint={"every": 0})
    trainer = Trainer(config)
    trainer.train_step()
    first = trainer.save()
    with torch.no_grad():
        next(trainer.model.parameters())[0].fill_(math.inf)
    trainer.state.step += 1
    assert trainer.save() is None  # refused: no folder written
    assert [p.name for p in list_checkpoints(config.train.output_dir)] == [first.name]
    assert all(torch.isfinite(w).all() for w in read_weights(first).values())


def test_a_loss_spike_is_skipped_when_detection_is_on(job, tmp_path):
    config = change(job, train={"steps": 16, "eval_every": 0}, fault={"kind": "spike", "step": 14},
                    guard={"spike_zscore": 6.0, "spike_window": 10}, checkpoint={"every": 0})
    skipped = [r for r in read_metrics(Trainer(config).fit().metrics_path) if "skipped" in r]
    assert [r["step"] for r in skipped] == [14] and skipped[0]["skipped"].startswith("loss spike (z =")
    off = change(config, guard={"spike_zscore": 0.0}, train={"output_dir": str(tmp_path / "off")})
    assert not [r for r in read_metrics(Trainer(off).fit().metrics_path) if "skipped" in r]  # off by default
