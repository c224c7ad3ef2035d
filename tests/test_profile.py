"""Measured compute profiles (plan/profile.py): `fivefold bench compute` writes one, and `plan --profile` /
`simulate --profile` price a layout's forward passes by it, carried to the layout's shard by the model."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fivefold.cli import main
from fivefold.config import load_config
from fivefold.errors import ConfigError
from fivefold.plan.cluster import load_cluster
from fivefold.plan.efficiency import Efficiency
from fivefold.plan.estimate import degrees_of, estimate, model_for, pass_costs
from fivefold.plan.profile import ComputeProfile, load_profile
from fivefold.plan.profile_measure import measure_profile
from fivefold.sim.step import simulate_step

SHAPE = ["--model.preset", "tiny", "--model.n_layers", "2", "--model.vocab_size", "257", "--train.seq_len", "32",
         "--train.micro_batch_size", "2"]


def _config(*overrides: str):
    return load_config(None, [*SHAPE, *overrides])


@pytest.fixture(scope="module")
def measured() -> ComputeProfile:
    return measure_profile(_config(), repeats=2)


def test_bench_compute_writes_a_profile_plan_and_simulate_read(tmp_path, capsys):
    """The CLI measures the config's model (two processes at once, as a 2-rank job's ranks share this host) and
    writes JSON that loads back equal; plan and simulate take it."""
    path = tmp_path / "profile.json"
    assert main(["bench", "compute", *SHAPE, "--out", str(path), "--repeats", "2", "--ranks", "2"]) == 0
    assert "dense block" in capsys.readouterr().out
    profile = load_profile(str(path))
    assert profile.block > 0 and profile.core > 0 and profile.head > 0 and profile.moe_block == 0
    assert profile.micro_batch_size == 2 and profile.seq_len == 32 and profile.dtype == "fp32"
    assert load_profile(str(path)) == ComputeProfile(**{k: v for k, v in json.loads(path.read_text()).items()
                                                        if k != "format"})
    assert main(["plan", *SHAPE, "--gpus", "1", "--cluster", "h100-sxm", "--profile", str(path)]) == 0
    assert "measured passes" in capsys.readouterr().out
    assert main(["simulate", *SHAPE, "--gpus", "2", "--cluster", "h100-sxm", "--profile", str(path)]) == 0
    assert "measured passes" in capsys.readouterr().out


@pytest.mark.parametrize("options,threads", [
    (["--threads", "1"], 1),  # the flag
    (["--train.threads", "1"], 1),  # the job's own cap, when --threads is not given
    (["--threads", "2", "--train.threads", "1"], 2),  # the flag wins
    ([], None),  # one rank's share of this host's cores
])
def test_bench_compute_measures_with_the_threads_asked(tmp_path, options, threads):
    import torch

    from fivefold.train.setup import available_cores

    path, before = tmp_path / "profile.json", torch.get_num_threads()
    assert main(["bench", "compute", *SHAPE, "--out", str(path), "--repeats", "1", *options]) == 0
    assert load_profile(str(path)).threads == (threads or available_cores())
    assert torch.get_num_threads() == before  # measured in this process, whose threads are left as they were


@pytest.mark.parametrize("option", [["--repeats", "0"], ["--ranks", "0"], ["--threads", "-1"]])
def test_bench_compute_refuses_bad_counts_before_measuring(tmp_path, capsys, option):
    path = tmp_path / "profile.json"
    assert main(["bench", "compute", *SHAPE, "--out", str(path), *option]) != 0
    assert "--repeats and --ranks must be >= 1 and --threads >= 0" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize("option,message", [
    (["--vocab-size", "-1"], "--vocab-size -1: must be >= 0"),
    (["--device", "tpu"], "--device 'tpu': use cpu, cuda or cuda:N"),
])
def test_bench_compute_refuses_a_bad_vocabulary_or_device(tmp_path, capsys, option, message):
    path = tmp_path / "profile.json"
    assert main(["bench", "compute", *SHAPE, "--out", str(path), *option]) != 0
    assert message in capsys.readouterr().err
    assert not path.exists()


def test_measured_passes_are_priced_as_measured_and_scaled_by_the_model(measured):
    """At the profiled shape on one rank the forward passes are the measured ones; on a tp 2 rank each part is the
    measured one times the model's ratio of the shard's work to the whole; a MoE model's profile has both blocks."""
    h100 = load_cluster("h100-sxm")
    config = _config()
    model = model_for(config)
    modelled = Efficiency(0.5)
    profiled = Efficiency(0.5, 0.0, measured)
    one = degrees_of(config, 1)
    costs = pass_costs(config, model, one, h100, profiled)
    assert (costs.block[False], costs.core, costs.head) == pytest.approx((measured.block, measured.core, measured.head))
    tp2 = _config("--tensor_parallel.degree", "2")
    two = degrees_of(tp2, 2)
    shard, whole = pass_costs(tp2, model, two, h100, modelled), pass_costs(tp2, model, one, h100, modelled)
    scaled = pass_costs(tp2, model, two, h100, profiled)
    assert scaled.block[False] == pytest.approx(measured.block * shard.block[False] / whole.block[False])
    assert scaled.head == pytest.approx(measured.head * shard.head / whole.head)
    # a longer sequence: the model's ratio again (its attention core grows faster than the rest)
    longer = _config("--train.seq_len", "64")
    model_long = pass_costs(longer, model, one, h100, modelled)
    assert pass_costs(longer, model, one, h100, profiled).core == pytest.approx(
        measured.core * model_long.core / pass_costs(config, model, one, h100, modelled).core)
    moe = _config("--model.preset", "tiny-moe", "--model.n_layers", "2", "--model.moe_layer_freq", "2")
    moe_profile = measure_profile(moe, repeats=1)
    assert moe_profile.block > 0 and moe_profile.moe_block > 0
    moe_costs = pass_costs(moe, model_for(moe), degrees_of(moe, 1), h100, Efficiency(0.5, 0.0, moe_profile))
    assert moe_costs.block == pytest.approx({False: moe_profile.block, True: moe_profile.moe_block})
    assert 0 < moe_costs.routed < moe_costs.block[True]


def test_planner_and_simulator_price_a_step_by_the_profile(measured):
    """One rank: the planner's step and the simulated step both run the measured passes (backward twice the
    forward), so they agree and differ from the modelled step."""
    h100 = load_cluster("h100-sxm")
    config = _config()
    profiled = Efficiency(0.5, 0.0, measured)
    planned = estimate(config, 1, h100, profiled).time
    assert planned.compute == pytest.approx(3 * (2 * measured.block + measured.head))
    simulated = simulate_step(config, 1, h100, profiled)
    assert simulated.time == pytest.approx(planned.total, rel=1e-9)
    assert estimate(config, 1, h100, 0.5).time.compute != pytest.approx(planned.compute)


def test_a_profile_of_another_model_or_a_bad_file_is_refused(tmp_path, measured):
    h100 = load_cluster("h100-sxm")
    wide = _config("--model.dim", "512")
    with pytest.raises(ConfigError, match="model.dim 256 .profile. vs 512"):
        estimate(wide, 1, h100, Efficiency(0.5, 0.0, measured))
    bf16 = _config("--train.dtype", "bf16")
    with pytest.raises(ConfigError, match="compute dtype fp32 .profile. vs bf16"):
        estimate(bf16, 1, h100, Efficiency(0.5, 0.0, measured))
    path = tmp_path / "p.json"
    good = json.loads(measured.to_json())
    for broken, message in ((None, "no such file"), ("{", "not valid JSON"), ({**good, "format": "x"}, "not a"),
                            ({**good, "block": -1}, "block = -1"), ({**good, "seq_len": 0}, "seq_len = 0"),
                            ({k: v for k, v in good.items() if k != "head"}, "expected the keys"),
                            ({**good, "model": {"dim": 256}}, "model must name"),
                            ({**good, "block": float("nan")}, "block = nan"), ({**good, "head": float("inf")}, "head = inf"),
                            ({**good, "extra": 1}, "expected the keys"), ({**good, "dtype": "fp8"}, "dtype = 'fp8'"),
                            ({**good, "threads": -1}, "threads = -1"), ({**good, "device": 3}, "device = 3"),
                            ({**good, "compiled": "yes"}, "compiled = 'yes'"),
                            ({**good, "loss_chunk_tokens": -1}, "loss_chunk_tokens = -1"),
                            ({**good, "expert_kernel": "fast"}, "expert_kernel = 'fast'")):
        if broken is None:
            target = str(tmp_path / "missing.json")
        else:
            path.write_text(broken if isinstance(broken, str) else json.dumps(broken))
            target = str(path)
        with pytest.raises(ConfigError, match=message):
            load_profile(target)
    assert dataclasses.replace(measured, threads=3).threads == 3
    path.write_text(json.dumps({k: v for k, v in good.items()
                               if k not in ("threads", "device", "compiled", "loss_chunk_tokens", "expert_kernel")}))
    assert load_profile(str(path)).threads == 0  # the optional keys may be absent (files of earlier versions)


def test_a_profile_measures_the_passes_as_the_job_runs_them(measured):
    """Under train.compile the blocks and the loss are compiled while measured, and with train.loss_chunk_tokens
    the head is the chunked one; the profile says which, prices such a job's head as measured, and is refused
    for a job that runs its passes otherwise (eager passes priced a compiled 1B step 43% long on an H200)."""
    from fivefold.parallel.compile import compiled_graphs

    h100 = load_cluster("h100-sxm")
    before = compiled_graphs()
    compiled = measure_profile(_config("--train.compile", "true"), repeats=1)
    assert compiled.compiled and compiled_graphs() > before
    chunked_job = _config("--train.loss_chunk_tokens", "16")
    chunked = measure_profile(chunked_job, repeats=1)
    assert chunked.loss_chunk_tokens == 16 and not chunked.compiled
    costs = pass_costs(chunked_job, model_for(chunked_job), degrees_of(chunked_job, 1), h100,
                       Efficiency(0.5, 0.0, chunked))
    assert costs.head == pytest.approx(chunked.head)
    for job, profile, message in ((_config("--train.compile", "true"), measured, "train.compile false .profile. vs true"),
                                  (_config(), compiled, "train.compile true .profile. vs false"),
                                  (chunked_job, measured, "train.loss_chunk_tokens 0 .profile. vs 16"),
                                  (_config(), chunked, "train.loss_chunk_tokens 16 .profile. vs 0")):
        with pytest.raises(ConfigError, match=message):
            estimate(job, 1, h100, Efficiency(0.5, 0.0, profile))


def test_a_moe_profile_times_the_expert_kernel_the_job_runs(monkeypatch):
    """The MoE block is measured with the job's expert_parallel.kernel (`auto` resolved as the runtime resolves
    it), the profile names it, and a job with the other kernel is refused (on an H200 the loop kernel's MoE step
    took 2.9 times the grouped one's, docs/planner.md)."""
    from fivefold.model.moe import ExpertKernel

    ran = []
    resolve = ExpertKernel.resolve
    monkeypatch.setattr(ExpertKernel, "resolve", lambda self, x, experts: ran.append(resolve(self, x, experts)) or ran[-1])
    moe = ["--model.preset", "tiny-moe", "--model.n_layers", "1", "--model.vocab_size", "257", "--train.seq_len", "32",
           "--train.micro_batch_size", "2"]
    profiles = {}
    for kernel in ("loop", "grouped", "auto"):
        ran.clear()
        profiles[kernel] = measure_profile(load_config(None, [*moe, "--expert_parallel.kernel", kernel]), repeats=1)
        expected = "grouped" if kernel == "auto" else kernel  # tiny-moe's widths meet the grouped GEMM's alignment
        assert profiles[kernel].expert_kernel == expected and set(ran) == {expected}
        assert profiles[kernel].moe_block > 0 and profiles[kernel].block == 0
    loop_job = load_config(None, [*moe, "--expert_parallel.kernel", "loop"])
    with pytest.raises(ConfigError, match="expert_parallel.kernel grouped .profile. vs loop"):
        estimate(loop_job, 1, load_cluster("h100-sxm"), Efficiency(0.5, 0.0, profiles["grouped"]))
    assert estimate(loop_job, 1, load_cluster("h100-sxm"), Efficiency(0.5, 0.0, profiles["loop"])).time.total > 0
    assert measure_profile(_config(), repeats=1).expert_kernel == ""  # a dense model has no MoE block
