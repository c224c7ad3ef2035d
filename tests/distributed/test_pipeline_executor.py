"""The pipeline executor runs exactly its schedule, splits the backward correctly, and reports what it measured."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import micro_model
from fivefold.model import build_model, materialize
from fivefold.parallel.pipeline.executor import WeightGradStore, _DeferWeightGradients
from fivefold.parallel.pipeline.schedules import PipelineShape, all_schedules, compute_order
from fivefold.parallel.pipeline.simulate import simulate

from distributed.spawn import run_distributed
from parity.harness import with_changes


def test_input_and_weight_passes_add_up_to_the_backward():
    """I gives the input gradient and the norm/embedding gradients, W the matrices' later: together, autograd's."""
    torch.manual_seed(0)
    config = micro_model(n_layers=2, vocab_size=64)
    reference = materialize(build_model(config), seed=1)
    split = materialize(build_model(config), seed=1)
    tokens = torch.randint(0, 64, (2, 12))
    reference(tokens).square().mean().backward()

    store = WeightGradStore()
    with _DeferWeightGradients(store):
        loss = split(tokens).square().mean()
    store.key = (0, 0)
    with _DeferWeightGradients(store):
        loss.backward()
    store.key = None
    matrices = {n for n, p in split.named_parameters() if p.ndim == 2 and n != "tok_embeddings.weight"}
    assert all(p.grad is None for n, p in split.named_parameters() if n in matrices)  # deferred to W
    assert split.norm.weight.grad is not None and split.tok_embeddings.weight.grad is not None
    assert store.pending() == len(matrices)
    store.compute((0, 0))
    assert store.pending() == 0
    for (name, a), (_, b) in zip(reference.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def _traced_run(rank, world_size, config):
    from fivefold.train.trainer import Trainer

    trainer = Trainer(config)
    trainer.fit()
    return [e.name for e in trainer.step_fn.executor.events if e.category == "compute"], trainer.step_fn.executor.peak_in_flight


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_executor_runs_the_schedule_and_writes_a_trace(job, tmp_path, schedule, virtual):
    pp, m = 2, 4
    config = with_changes(job, model={"n_layers": 4}, train={"steps": 2, "log_every": 1, "micro_batch_size": 2,
                                                             "grad_accum_steps": m, "eval_every": 0},
                          pipeline_parallel={"degree": pp, "schedule": schedule, "virtual": virtual},
                          logging={"pipeline_trace": True}, checkpoint={"enabled": False})
    results = run_distributed(_traced_run, pp, config, timeout=120)
    shape = PipelineShape(pp, m, virtual)
    peaks = simulate(all_schedules(schedule, shape)).peak_in_flight
    for rank, (names, peak) in enumerate(results):
        expected = [f"{op.value}{mb}@s{stage}" for op, mb, stage in compute_order(schedule, shape, rank)]
        assert names == expected + ["optimizer step"]
        assert peak == peaks[rank]  # micro-batch activations held at once, as the simulator predicts

    trace = json.loads((tmp_path / "run" / "pipeline_trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1}
    assert sum(e["cat"] == "compute" and e["name"].startswith("F") for e in complete) == m * pp * virtual
    assert any(e["cat"] == "comm" and "recv_act" in e["name"] for e in complete)
    assert trace["otherData"] == {"schedule": schedule, "ranks": pp, "microbatches": m, "virtual": virtual, "step": 2}
    from fivefold.cli import main

    png = tmp_path / "measured.png"
    assert main(["plot-schedule", "--trace", str(tmp_path / "run" / "pipeline_trace.json"), "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "bubble" in r]
    assert len(logged) == 2 and all(r["bubble"] > 0 for r in logged)
    assert logged[0]["bubble_ideal"] == pytest.approx({"1f1b": 1 / 4, "interleaved": 1 / 8, "zb-h1": 1 / 12}[schedule])


def _evaluate(rank, world_size, config):
    from fivefold.train.trainer import Trainer

    return Trainer(config).evaluate()


@pytest.mark.parametrize("pp,virtual,tied", [(2, 2, False), (4, 1, True)])
def test_pipeline_evaluation_matches_one_process(job, pp, virtual, tied):
    """Validation batches through the stages give the one-process validation loss of the same weights."""
    from fivefold.train.trainer import Trainer

    config = with_changes(job, model={"n_layers": 4, "tie_embeddings": tied}, train={"eval_batches": 3})
    expected = Trainer(config).evaluate()
    pipelined = with_changes(config, train={"grad_accum_steps": 4},
                             pipeline_parallel={"degree": pp, "virtual": virtual, "schedule": "interleaved" if virtual > 1 else "1f1b"})
    losses = run_distributed(_evaluate, pp, pipelined, timeout=120)
    assert all(loss == pytest.approx(expected, rel=1e-6) for loss in losses)


def _weight_copies_rank(rank, world_size, config):
    """Bytes of bf16 casts of this rank's weights that autograd keeps over one step, and the planner's count."""
    from fivefold.plan.cluster import PRESETS
    from fivefold.plan.estimate import estimate
    from fivefold.train.memory import saved_bytes_and_weight_casts
    from fivefold.train.trainer import Trainer

    trainer = Trainer(config)
    _, copies = saved_bytes_and_weight_casts(trainer.train_step, trainer.model.parameters())
    planned = estimate(config, world_size, PRESETS["h100-sxm"], vocab_size=trainer.model_config.vocab_size)
    planned = planned.per_pp_rank[rank]
    trainer.close()
    return copies, planned.weight_copies, trainer.step_fn.executor.peak_in_flight


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_micro_batches_in_flight_share_one_bf16_copy_of_each_weight(job, schedule, virtual):
    """The executor runs a step's compute in one autocast region, so the micro-batches a rank holds in flight
    (2 on 1F1B's first rank here) share autocast's bf16 copy of each weight instead of keeping one each; the
    planner counts exactly those bytes per rank (blocks, and the head on the last stage)."""
    config = with_changes(job, model={"n_layers": 4}, train={"steps": 1, "micro_batch_size": 2, "grad_accum_steps": 4,
                                                             "eval_every": 0, "dtype": "bf16"},
                          pipeline_parallel={"degree": 2, "schedule": schedule, "virtual": virtual},
                          checkpoint={"enabled": False})
    results = run_distributed(_weight_copies_rank, 2, config, timeout=120)
    assert results[0][2] >= 2  # more than one micro-batch in flight on the first rank
    for kept, planned, _ in results:
        assert kept == planned > 0
