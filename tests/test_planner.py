"""The planner: cluster files, per-rank counts, pipeline peaks and extrapolation, the calculator, search, CLI.

The planner-vs-runtime check of parameters and model-state bytes per rank, layout by layout, is in
tests/distributed/test_plan_vs_runtime.py.
"""

import dataclasses
import json

import pytest

from fivefold.cli import main
from fivefold.config import load_config
from fivefold.errors import ConfigError
from fivefold.model.presets import PRESETS, get_preset
from fivefold.parallel.pipeline.schedules import PipelineShape, all_schedules, peak_in_flight
from fivefold.parallel.pipeline.simulate import Costs, simulate
from fivefold.plan.calculator import budget
from fivefold.plan.cluster import PRESETS as CLUSTERS
from fivefold.plan.cluster import STREAMING_SHARE, cluster_from_dict, cluster_toml, load_cluster
from fivefold.plan.estimate import PipelineRuns, estimate
from fivefold.plan.flops import count_parameters
from fivefold.plan.memory import nvme_host_bytes, zero_model_states
from fivefold.plan.parameters import rank_parameters, rank_tensors
from fivefold.plan.search import search


@pytest.mark.parametrize("name", list(PRESETS))
def test_one_rank_holds_the_whole_count(name):
    model = get_preset(name)
    model.vocab_size = model.vocab_size or 257
    count, held = count_parameters(model), rank_parameters(model, list(range(model.n_layers)), True, True)
    assert held.total == count.total and held.experts == count.routed_experts


def test_splits_add_up_to_the_whole():
    """tp pieces of the split tensors, pipeline stages and expert shards add back up to the model."""
    model = get_preset("mixtral-8x7b")
    whole = count_parameters(model).total
    stages = [rank_parameters(model, list(range(i * 8, i * 8 + 8)), i == 0, i == 3, pipelined=True) for i in range(4)]
    assert sum(s.total for s in stages) == whole
    experts = rank_parameters(model, list(range(32)), True, True, ep=8)
    assert experts.experts * 8 == count_parameters(model).routed_experts


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)])
def test_closed_form_peak_in_flight_equals_the_simulator(schedule, virtual):
    for pp in (2, 3, 4, 5):
        for m in range(pp, 5 * pp + 1, pp):
            shape = PipelineShape(pp, m, virtual)
            sim = simulate(all_schedules(schedule, shape))
            assert {r: peak_in_flight(schedule, shape, r) for r in range(pp)} == sim.peak_in_flight, (pp, m)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_long_pipelines_are_extrapolated_exactly(schedule, virtual):
    """Past saturation each group of pp micro-batches adds the same time: the two-run extrapolation equals a
    full simulation, with uneven stages and send latency."""
    runs = PipelineRuns()
    for pp in (2, 4):
        for m in range(pp, 16 * pp + 1, pp):
            costs = Costs(1.0, 2.0, 1.0, 1.0, 0.1, tuple([1.0] * (pp * virtual - 1) + [1.4]))
            fast = runs.run(schedule, pp, m, virtual, costs)
            full = simulate(all_schedules(schedule, PipelineShape(pp, m, virtual)), costs)
            assert fast[0] == pytest.approx(full.makespan, rel=1e-12) and fast[1] == full.peak_in_flight


def test_stage_scale_slows_only_its_stage():
    shape = PipelineShape(2, 4)
    plain = simulate(all_schedules("1f1b", shape), Costs())
    doubled = simulate(all_schedules("1f1b", shape), Costs(stage_scale=(2.0, 2.0)))
    assert doubled.makespan == pytest.approx(2 * plain.makespan)
    last_slow = simulate(all_schedules("1f1b", shape), Costs(stage_scale=(1.0, 2.0)))
    assert plain.makespan < last_slow.makespan < doubled.makespan


def test_the_175b_worked_example():
    """Narayanan et al.'s example: 175B on 300B tokens at 160 TFLOP/s per GPU: about 800 GPUs for 30 days."""
    gpt3 = get_preset("gpt3-175b")
    gpus = budget(gpt3, 300e9, 2048, 160e12, days=30).gpus
    assert 750 <= gpus <= 800
    assert 28 <= budget(gpt3, 300e9, 2048, 160e12, gpus=800).days <= 30
    with pytest.raises(ConfigError, match="exactly one"):
        budget(gpt3, 300e9, 2048, 160e12, gpus=800, days=30)
    with pytest.raises(ConfigError, match="finite"):
        budget(gpt3, 300e9, 2048, 160e12, days=float("inf"))


def test_cluster_files_round_trip_and_bad_ones_name_the_key(tmp_path):
    for spec in CLUSTERS.values():
        path = tmp_path / f"{spec.name}.toml"
        path.write_text(cluster_toml(spec))
        assert load_cluster(str(path)) == dataclasses.replace(spec)
    good = json.loads(json.dumps(CLUSTERS["h100-sxm"].to_dict()))
    for change, named in ((("intra", "bandwidth_gbs", -1), "intra.bandwidth_gbs"), (("accelerator", "memory_gib", 0), "memory_gib"),
                          ((None, "accelerators_per_node", 0), "accelerators_per_node"), ((None, "colour", 1), "colour")):
        data = json.loads(json.dumps(good))
        section, key, value = change
        (data[section] if section else data)[key] = value
        with pytest.raises(ConfigError, match=named):
            cluster_from_dict(data)
    with pytest.raises(ConfigError, match="neither a preset"):
        load_cluster(str(tmp_path / "missing.toml"))
    for bad in ({"broadcast": {"bandwidth_gbs": 1, "latency_us": 1}}, {"all_reduce": {"bandwidth_gbs": 0, "latency_us": 1}}):
        with pytest.raises(ConfigError, match="collectives"):
            cluster_from_dict(good | {"collectives": bad})
    assert CLUSTERS["h100-sxm"].accelerator.peak_flops("bf16") == 989.5e12
    with pytest.raises(ConfigError, match="fp8"):
        CLUSTERS["a100-80gb"].accelerator.peak_flops("fp8")


H100_STREAMED = STREAMING_SHARE * 3350e9  # bytes per second the H100 preset's memory-bound kernels move


def _config(*overrides):
    return load_config(None, ["--model.preset", "llama3-8b", "--train.seq_len", "2048", "--train.micro_batch_size", "1",
                              "--train.dtype", "bf16", *overrides])


@pytest.mark.parametrize("overrides, forward, backward", [
    ([], (), ()),
    # Qwen3's per-head gains: each gradient summed (head_dim x 4 bytes)
    (["--model.qk_norm", "head"], (), (128 * 4,) * 2),
    # OLMo 2's norm over the projection: each token's sum of squares (s / cp tokens x 4 bytes) both ways
    (["--model.qk_norm", "projection", "--context_parallel.degree", "2"], (1024 * 4,) * 2, (1024 * 4,) * 2),
    # 8 key/value heads over tp 16: wk's and wv's gradients in a kv_heads x head_dim x dim buffer, biases too
    (["--tensor_parallel.degree", "16", "--model.attention_bias", "qkv"], (),
     (8 * 128 * 4096 * 4,) * 2 + (8 * 128 * 4,) * 2),
])
def test_attention_all_reduces_are_the_runtimes_and_priced(overrides, forward, backward):
    """plan/estimate.py `attention_all_reduces` lists what parallel/tensor_parallel.py sends (checked call by call
    against a recorded step in tests/distributed/test_step_traffic.py); the planner's tp term prices each once
    per block and micro-batch, the forward ones again under full recomputation."""
    from fivefold.plan.estimate import attention_all_reduces, degrees_of, model_for, native_collective

    tp = ["--tensor_parallel.degree", "4"] if "--tensor_parallel.degree" not in overrides else []
    config = load_config(None, ["--model.preset", "llama3-8b", "--train.seq_len", "2048", "--train.micro_batch_size", "1",
                                "--train.grad_accum_steps", "2", *tp, *overrides])
    gpus = 2 * 16 if "--tensor_parallel.degree" in overrides else 4 * (2 if "--context_parallel.degree" in overrides else 1)
    d = degrees_of(config, gpus)
    assert attention_all_reduces(config, model_for(config), d) == (forward, backward)
    cluster = CLUSTERS["h100-sxm"]
    plain = dataclasses.replace(config, model=dataclasses.replace(config.model, qk_norm="none", attention_bias="none",
                                                                  n_kv_heads=max(config.model.n_kv_heads, d.tp)))
    if not forward and not backward:
        return
    link = cluster.collective_link("all_reduce", d.tp)
    per_block = [sum(native_collective("all_reduce", n, d.tp, link) for n in calls) for calls in (forward, backward)]
    for recompute, again in (("none", 0), ("full", 1)):
        with_recompute = [dataclasses.replace(c, train=dataclasses.replace(c.train, recompute=recompute)) for c in (config, plain)]
        extra = estimate(with_recompute[0], gpus, cluster).time.tp - estimate(with_recompute[1], gpus, cluster).time.tp
        assert extra == pytest.approx(2 * 32 * ((1 + again) * per_block[0] + per_block[1]), rel=1e-9)


def test_estimate_components():
    config = _config("--tensor_parallel.degree", "4", "--tensor_parallel.sequence_parallel", "true",
                     "--data_parallel.zero_stage", "1", "--data_parallel.shard", "4", "--data_parallel.param_dtype", "bf16")
    found = estimate(config, 16, CLUSTERS["h100-sxm"])
    assert (found.degrees.dp, found.degrees.tp) == (4, 4)
    psi = found.memory.parameter_count
    assert psi == rank_parameters(get_preset("llama3-8b"), list(range(32)), True, True, tp=4).total
    states = zero_model_states(psi, 1, 4, True)
    assert (found.memory.parameters, found.memory.gradients, found.memory.optimizer) == \
        (states.parameters, states.gradients, states.optimizer)
    assert found.fits and 0 < found.mfu < 0.5 and found.time.tp > 0 and found.time.dp > 0
    assert found.tokens_per_step == 4 * 2048
    offload = estimate(_config("--tensor_parallel.degree", "4", "--data_parallel.zero_stage", "1", "--data_parallel.shard",
                               "4", "--data_parallel.offload", "true"), 16, CLUSTERS["h100-sxm"])
    assert offload.memory.optimizer == 0 and offload.memory.host > 0 and offload.time.offload > 0
    nvme = estimate(_config("--tensor_parallel.degree", "4", "--data_parallel.zero_stage", "1", "--data_parallel.shard",
                            "4", "--data_parallel.offload", "true", "--data_parallel.nvme_path", "/tmp"), 16,
                    CLUSTERS["h100-sxm"])
    # NVMe: the states move to the drive (as much as the host held), the host keeps three slots of the largest group
    assert nvme.memory.optimizer == 0 and nvme.memory.nvme == offload.memory.host
    # the largest flat group: embedding + head over tp 4, over 4 shards (+ the final norm, kept in an upper bound)
    largest = -(-(get_preset("llama3-8b").vocab_size * 4096 * 2 // 4 + 4096) // 4)
    assert nvme.memory.host == 3 * 3 * 4 * (1 << 24)  # the default sub-group, 16 Mi elements, bounds it
    whole = estimate(_config("--tensor_parallel.degree", "4", "--data_parallel.zero_stage", "1", "--data_parallel.shard",
                             "4", "--data_parallel.offload", "true", "--data_parallel.nvme_path", "/tmp",
                             "--data_parallel.nvme_sub_group", str(1 << 30)), 16, CLUSTERS["h100-sxm"])
    assert whole.memory.host == nvme_host_bytes([largest], 1 << 30) == 3 * 3 * 4096 * -(-largest * 4 // 4096)
    shard = psi / 4
    drives = 2 * 12 * shard * 8 / (CLUSTERS["h100-sxm"].nvme_bandwidth_gbs * 1e9)
    assert nvme.time.offload == pytest.approx(offload.time.offload + drives)


def test_priority_schedule_hides_behind_the_next_forward_and_pays_per_slice():
    """gradient_comm.schedule = priority (P3): the slices may stay on the wire into the next step's first forward, so
    where DDP's reduction is longer than backward less of it is exposed than FIFO's; each slice costs one more small
    all-reduce (the readiness vector, 4 bytes per slice: quadratic in the slices), so a 1B model's 4,700 slices of
    1 MiB expose more than FIFO on a slow link while 64 MiB slices expose less;
    and no gradient norm is taken (the schedule refuses clipping)."""
    from fivefold.plan.cluster import LinkSpec

    slow = dataclasses.replace(CLUSTERS["h100-sxm"], accelerators_per_node=1, inter=LinkSpec(1.0, 50.0))
    common = ["--model.preset", "llama3.2-1b", "--train.seq_len", "512", "--train.max_grad_norm", "0"]
    fifo = estimate(load_config(None, common), 2, slow)
    priority = estimate(load_config(None, [*common, "--gradient_comm.schedule", "priority", "--gradient_comm.slice_mb",
                                           "64"]), 2, slow)
    fine = estimate(load_config(None, [*common, "--gradient_comm.schedule", "priority"]), 2, slow)  # 1 MiB slices
    assert fifo.time.dp > priority.time.dp > 0 and fine.time.dp > priority.time.dp
    assert fifo.time.compute == priority.time.compute
    clipped = estimate(load_config(None, [*common[:-2], "--train.max_grad_norm", "1.0"]), 2, slow)
    assert priority.time.optimizer < fifo.time.optimizer < clipped.time.optimizer


def _scalars(config, gpus, cluster) -> float:
    from fivefold.plan.estimate import degrees_of, model_for, scalar_time

    return scalar_time(config, model_for(config), degrees_of(config, gpus), cluster)


def test_step_scalar_all_reduces_are_priced_in_the_update():
    """The step's scalar all-reduces (plan/estimate.py step_scalars): the token count over dp x cp, the gradient
    norm's over ZeRO's shard block, tp and pp, the guard's verdict over every rank; none on one rank; each priced
    as the backend's all-reduce of its bytes on its link, in the optimizer phase."""
    from fivefold.comm.cost import native_collective
    from fivefold.plan.estimate import degrees_of, model_for, step_scalars

    h100 = CLUSTERS["h100-sxm"]

    def calls(*overrides, gpus=8):
        config = _config(*overrides)
        return sorted(step_scalars(config, model_for(config), degrees_of(config, gpus)))

    assert calls(gpus=1) == []
    assert calls() == [("guard", 24, 8, 8), ("token count", 4, 8, 8)]
    assert calls("--tensor_parallel.degree", "2", "--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "2",
                 "--data_parallel.zero_stage", "1", "--data_parallel.shard", "2") == [
        ("gradient norm", 8, 2, 2), ("gradient norm", 8, 2, 4), ("gradient norm", 8, 2, 8), ("guard", 24, 8, 8),
        ("token count", 4, 2, 4)]
    assert [c for c in calls("--guard.enabled", "false") if c[0] == "guard"] == []
    config = _config()
    assert _scalars(config, 8, h100) == pytest.approx(sum(
        native_collective("all_reduce", n, 8, h100.collective_link("all_reduce", 8)) for n in (4, 24)))


def test_memory_bound_terms():
    """AdamW moves 28 bytes per parameter it updates (its ZeRO shard) at the share of the memory bandwidth that
    memory-bound kernels reach (the GPU presets: 0.74 of the data sheet's, measured on an H200), after the gradient
    norm and clipping's 12 over the same shard; without a bandwidth the memory-bound terms are left out, and compute
    is then the matmul time alone."""
    h100 = CLUSTERS["h100-sxm"]
    assert h100.accelerator.memory_efficiency == STREAMING_SHARE == 0.74
    config = _config("--data_parallel.zero_stage", "1", "--data_parallel.shard", "8")
    found = estimate(config, 8, h100)
    assert found.time.optimizer - _scalars(config, 8, h100) == \
        pytest.approx((28 + 12) * found.memory.parameter_count / 8 / H100_STREAMED)
    blind = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, memory_bandwidth_gbs=0.0))
    plain = estimate(config, 8, blind)
    assert plain.time.optimizer == pytest.approx(_scalars(config, 8, blind)) and plain.time.compute < found.time.compute


def test_the_memory_efficiency_scales_every_memory_bound_term_and_is_read_from_a_cluster_file(tmp_path):
    """Halving the share memory-bound kernels reach doubles the seconds of what is priced by bytes: the optimizer
    step and clipping, the bytes a block writes beside its matmuls and the head's logits (the compute left at the
    matmul rate), the codecs' local work; a cluster file carries the share and refuses one outside (0, 1]."""
    h100 = CLUSTERS["h100-sxm"]
    config = _config("--data_parallel.zero_stage", "1", "--data_parallel.shard", "8")

    def at(share: float):
        return dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, memory_efficiency=share))

    full, half = estimate(config, 8, at(1.0)), estimate(config, 8, at(0.5))
    assert half.time.optimizer - _scalars(config, 8, at(0.5)) == \
        pytest.approx(2 * (full.time.optimizer - _scalars(config, 8, at(1.0))))
    blind = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, memory_bandwidth_gbs=0.0))
    matmuls = estimate(config, 8, blind).time.compute
    assert half.time.compute - matmuls == pytest.approx(2 * (full.time.compute - matmuls)) and full.time.compute > matmuls
    assert at(0.5).accelerator.codec_seconds("int8", 1e6, 4) == pytest.approx(2 * at(1.0).accelerator.codec_seconds("int8", 1e6, 4))
    path = tmp_path / "pod.toml"
    path.write_text(cluster_toml(at(0.5)))
    assert load_cluster(str(path)).accelerator.memory_efficiency == 0.5
    path.write_text(cluster_toml(at(0.5)).replace("memory_efficiency = 0.5", "memory_efficiency = 1.5"))
    with pytest.raises(ConfigError, match=r"accelerator.memory_efficiency = 1.5: must be in \(0, 1\]"):
        load_cluster(str(path))
    for bad in ("nan", "inf", "0", "-0.5", "true"):
        path.write_text(cluster_toml(at(0.5)).replace("memory_efficiency = 0.5", f"memory_efficiency = {bad}"))
        with pytest.raises(ConfigError, match=r"accelerator.memory_efficiency = .*: must be a positive finite number"):
            load_cluster(str(path))
    path.write_text(cluster_toml(at(0.5)).replace("memory_efficiency = 0.5\n", ""))
    assert load_cluster(str(path)).accelerator.memory_efficiency == 1.0  # a measured bandwidth is reached


def test_an_infeasible_layout_is_refused_by_the_runtime_rules():
    with pytest.raises(ConfigError, match="tensor_parallel.degree"):
        estimate(_config("--tensor_parallel.degree", "3"), 3, CLUSTERS["h100-sxm"])
    with pytest.raises(ConfigError, match="do not fit cluster"):
        estimate(_config(), 64, dataclasses.replace(CLUSTERS["h100-sxm"], nodes=2))


def test_search_ranks_feasible_layouts_and_writes_a_config_train_accepts(tmp_path):
    config = _config()
    result = search(config, 16, CLUSTERS["h100-sxm"], 32)
    assert result.ranked and result.considered == len(result.ranked) + sum(result.rejected.values())
    assert "memory" in result.rejected and "data_parallel.zero_stage" in result.rejected  # DDP of 8B does not fit
    times = [float(f"{e.time.total:.3g}") for _, e in result.ranked[:50]]  # ties: least memory first
    assert times == sorted(times)
    assert all(e.fits for _, e in result.ranked)
    out = tmp_path / "best.toml"
    code = main(["plan", "--model.preset", "llama3-8b", "--train.seq_len", "2048", "--train.dtype", "bf16",
                 "--gpus", "16", "--search", "--global-batch", "32", "--top", "3", "--write-best", str(out),
                 "--json", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "memory.png"), "--workers", "2"])
    assert code == 0
    best = load_config(str(out))
    assert best == result.ranked[0][0]
    from fivefold.train.launch import check_before_launch

    check_before_launch(dataclasses.replace(best, train=dataclasses.replace(best.train, output_dir=str(tmp_path / "run"))), 16)
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["search"]["top"][0]["step_seconds"]["total"] == pytest.approx(result.ranked[0][1].time.total)
    from fivefold.plan.workers import can_fork

    assert report["search"]["workers"] == (2 if can_fork() else 1)  # two processes, one process's winner
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_a_search_from_a_scattering_pipeline_layout_searches_every_layout():
    """The search gives every tp > 1 layout sequence parallelism, whose stage messages are split already: a base
    config with pipeline_parallel.scatter_gather (valid for its own pp 2 x tp 2 without sp) searches the same
    layouts as one without, instead of refusing all of them."""
    plain = search(_config(), 16, CLUSTERS["h100-sxm"], 32, refine=5)
    scattering = search(_config("--pipeline_parallel.degree", "2", "--tensor_parallel.degree", "2",
                                "--pipeline_parallel.scatter_gather", "true"), 16, CLUSTERS["h100-sxm"], 32, refine=5)
    assert (scattering.considered, scattering.rejected) == (plain.considered, plain.rejected)
    assert [c.pipeline_parallel for c, _ in scattering.ranked] == [c.pipeline_parallel for c, _ in plain.ranked]


def test_refusing_a_family_at_once_gives_the_one_by_one_result(monkeypatch):
    """The search checks the data-parallel rules once per family of layouts (they read none of what varies
    inside it): the same candidates are considered, refused for the same reasons in the same numbers, and
    ranked the same as when every layout is validated on its own."""
    import functools

    import fivefold.plan.search as search_module

    config = _config()
    fast = search(config, 16, CLUSTERS["h100-sxm"], 32, refine=5)
    monkeypatch.setattr(search_module, "candidates", functools.partial(search_module.candidates, refuse_families=False))
    slow = search(config, 16, CLUSTERS["h100-sxm"], 32, refine=5)
    assert fast.rejected["data_parallel.zero_stage"] > 0
    assert (fast.considered, fast.rejected, fast.examples, fast.rebalanced) == \
        (slow.considered, slow.rejected, slow.examples, slow.rebalanced)
    assert [c for c, _ in fast.ranked] == [c for c, _ in slow.ranked]


def test_a_search_shared_by_forked_workers_finds_what_one_process_finds():
    """Three processes price the first pass's candidates (plan/workers.py, forked on Linux) and the merge by each
    candidate's place gives one process's result: the same considered and refused counts in the same order, the
    same first example of each reason, the same layouts moved to fit, the same ranking and predictions."""
    from fivefold.plan.workers import can_fork

    config = _config()
    one = search(config, 16, CLUSTERS["h100-sxm"], 32, refine=5)
    three = search(config, 16, CLUSTERS["h100-sxm"], 32, refine=5, workers=3)
    assert three.workers == (3 if can_fork() else 1) and one.workers == 1
    assert one.rebalanced > 0 and len(one.rejected) >= 3
    assert (three.considered, list(three.rejected.items()), list(three.examples.items()), three.rebalanced) == \
        (one.considered, list(one.rejected.items()), list(one.examples.items()), one.rebalanced)
    assert [(c, e.time.total, e.memory.total) for c, e in three.ranked] == \
        [(c, e.time.total, e.memory.total) for c, e in one.ranked]
    with pytest.raises(ConfigError, match="--workers = 0"):
        search(config, 16, CLUSTERS["h100-sxm"], 32, workers=0)


def test_pipeline_stages_are_moved_to_fit_memory():
    """1F1B's first rank keeps the most micro-batches in flight: under an 80 GiB cap the balanced 8/8/8/8 split of
    Llama-3 8B does not fit (96.1 GiB on rank 0), and moving blocks off the fullest ranks gives an uneven split
    that does, which the runtime's own checks accept as written."""
    from fivefold.plan.search import fit_stages

    config = _config("--train.seq_len", "4096", "--train.micro_batch_size", "2", "--pipeline_parallel.degree", "4",
                     "--pipeline_parallel.layers_per_stage", "8,8,8,8", "--train.grad_accum_steps", "8")
    split = _moved_to_fit(config, 80)
    assert split[0] < 8 and split != [8, 8, 8, 8]
    tight = _capped(55)
    assert fit_stages(config, estimate(config, 4, tight), 4, tight) is None  # the ranks' total is over their caps


def _capped(gib: float):
    h100 = CLUSTERS["h100-sxm"]
    return dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, memory_gib=gib))


def _moved_to_fit(config, gib: float) -> list[int]:
    """The split fit_stages moves a 4-rank Llama-3 8B layout to under a `gib` cap, checked: the balanced split is
    over on rank 0, the moved one fits with every block placed, its estimate agrees, the runtime accepts it."""
    from fivefold.parallel.validate import check_config
    from fivefold.plan.search import fit_stages

    capped = _capped(gib)
    balanced = estimate(config, 4, capped)
    assert not balanced.fits and balanced.memory_rank == 0
    moved, found = fit_stages(config, balanced, 4, capped)
    split = moved.pipeline_parallel.layers_per_stage
    assert found.fits and sum(split) == 32 and len(split) == len(config.pipeline_parallel.layers_per_stage)
    assert estimate(moved, 4, capped).memory.total == found.memory.total
    check_config(moved)
    return split


def test_interleaved_stages_are_moved_to_fit_memory():
    """Interleaved (v = 2, stage s on rank s mod 4): a rank's activations are bounded by its largest stage, so
    blocks leave the over-full rank's largest stage for the neighbouring stage of another rank; under a 104 GiB
    cap the balanced 4 x 8 split of Llama-3 8B does not fit (118.3 GiB on rank 0: 11 micro-batch x stage pairs in
    flight) and the moved one does, as the runtime accepts it."""
    config = _config("--train.seq_len", "4096", "--train.micro_batch_size", "2", "--pipeline_parallel.degree", "4",
                     "--pipeline_parallel.schedule", "interleaved", "--pipeline_parallel.virtual", "2",
                     "--pipeline_parallel.layers_per_stage", "4,4,4,4,4,4,4,4", "--train.grad_accum_steps", "8")
    split = _moved_to_fit(config, 104)
    assert len(split) == 8 and max(split[0], split[4]) < 4


def test_plan_command_estimate_and_calculator(capsys, tmp_path):
    assert main(["plan", "--config", "configs/tiny.toml", "--gpus", "1", "--cluster", "a100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "step time" in out
    assert main(["plan", "--model.preset", "gpt3-175b", "--train.seq_len", "2048", "--tokens", "300e9", "--days", "30",
                 "--achieved-tflops", "160"]) == 0
    assert " 779 GPUs for 30.0 days" in capsys.readouterr().out
    assert main(["plan", "--config", "configs/tiny.toml", "--gpus", "1", "--cluster", str(tmp_path / "none.toml")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["plan", "--config", "configs/tiny.toml", "--gpus", "1", "--search", "--workers", "-1"]) == 2
    assert "--workers -1: a number of processes" in capsys.readouterr().err


# ---- published rows (plan/published.py): the calibration table's inputs are the paper's models


def test_sc21_rows_have_the_published_parameter_counts_and_flops():
    """Each Table 1 row built as our model has the published size within the table's rounding (0.05B)
    plus 0.5% (Megatron's learned positions and biases, which ours lacks), and the paper's FLOP count per
    iteration equals ours with full recomputation's extra forward (4/3 x the blocks' training FLOPs; the
    head is not recomputed), to the SwiGLU width's rounding."""
    from fivefold.plan.flops import count_parameters, flops_per_token
    from fivefold.plan.published import SC21_TABLE1, paper_flops, sc21_config

    for run in SC21_TABLE1:
        config = sc21_config(run)
        assert (config.tensor_parallel.degree, config.pipeline_parallel.degree) == (run.tp, run.pp)
        assert config.train.micro_batch_size * config.train.grad_accum_steps * run.dp == run.batch
        params = count_parameters(config.model).total / 1e9
        assert abs(params - run.params_billion) <= 0.05 + 0.005 * run.params_billion, (run.name, params)
        head = 2 * config.model.dim * config.model.vocab_size
        per_token = 4 / 3 * (flops_per_token(config.model, config.train.seq_len) - 3 * head) + 3 * head
        assert per_token * run.batch * config.train.seq_len == pytest.approx(paper_flops(run), rel=1e-4), run.name


def test_sc21_rows_plan_on_the_a100_preset():
    """Every row fits an A100-80GB as the paper ran it, and its predicted rate is a plausible share of peak."""
    from fivefold.plan.published import SC21_TABLE1, paper_flops, sc21_config

    cluster = load_cluster("a100-80gb")
    for run in SC21_TABLE1[:6]:
        found = estimate(sc21_config(run), run.gpus, cluster, 0.5)
        assert found.fits, run.name
        rate = paper_flops(run) / (found.time.total * run.gpus)
        assert 0.25 * cluster.accelerator.peak_flops("bf16") < rate < 0.55 * cluster.accelerator.peak_flops("bf16")


def test_native_collective_links_are_fitted_round_trip_and_price_the_planner(tmp_path):
    """A link fitted to a collective's times in the ring form reproduces them; a cluster file carrying it
    round-trips, and the planner prices that collective (inside a node) on it, the rest on the intra link."""
    from fivefold.comm.cost import Link, fit_native_link, native_collective

    truth = Link(alpha=800e-6, beta=1 / 0.7e9)
    for collective, p in (("all_reduce", 4), ("reduce_scatter", 2), ("all_gather", 4), ("all_to_all", 3)):
        sizes = [256e3, 1e6, 4e6]
        fitted = fit_native_link(collective, p, sizes, [native_collective(collective, n, p, truth) for n in sizes])
        assert fitted.alpha == pytest.approx(truth.alpha) and fitted.beta == pytest.approx(truth.beta)
    from fivefold.plan.cluster import LinkSpec

    base = CLUSTERS["h100-sxm"]
    slow = dataclasses.replace(base, collectives={"all_reduce": LinkSpec(5.0, 50.0)})
    path = tmp_path / "slow.toml"
    path.write_text(cluster_toml(slow))
    assert load_cluster(str(path)) == slow
    assert slow.collective_link("all_reduce", 8).beta == pytest.approx(1 / 5e9)
    assert slow.collective_link("all_reduce", 16) == base.link_for(16)  # across nodes: the links as before
    assert slow.collective_link("all_gather", 8) == base.link_for(8)
    config = _config("--tensor_parallel.degree", "8")
    fast, slower = estimate(config, 8, base), estimate(config, 8, slow)
    activation = 1 * 2048 * 4096 * 2  # one micro-batch's bf16 activations: what each all-reduce sums
    ratio = native_collective("all_reduce", activation, 8, slow.collective_link("all_reduce", 8)) / \
        native_collective("all_reduce", activation, 8, base.link_for(8))
    for cluster, result in ((base, fast), (slow, slower)):  # 4 per block, the embedding's, the head's; the loss's 3
        link = cluster.collective_link("all_reduce", 8)
        assert result.time.tp == pytest.approx((4 * 32 + 2) * native_collective("all_reduce", activation, 8, link)
                                               + 3 * native_collective("all_reduce", 2048 * 4, 8, link))
    assert ratio > 10
    assert slower.time.compute == fast.time.compute
    # sequence parallelism prices its regions as all-gather + reduce-scatter instead: the slow all-reduce link
    # prices only the loss's 3 all-reduces and the norms' weight-gradient sums (2 per block and the final norm's)
    sp = _config("--tensor_parallel.degree", "8", "--tensor_parallel.sequence_parallel", "true")

    def dearer(n: float) -> float:
        return native_collective("all_reduce", n, 8, slow.collective_link("all_reduce", 8)) - \
            native_collective("all_reduce", n, 8, base.link_for(8))

    assert estimate(sp, 8, slow).time.tp - estimate(sp, 8, base).time.tp == pytest.approx(
        3 * dearer(2048 * 4) + (2 * 32 + 1) * dearer(4096 * 4))


def test_a_collectives_measured_times_are_read_at_the_ranks_they_were_timed_over(tmp_path):
    """A native collective's measured times (bench comm writes them beside the fitted line) price it at the world
    size they were timed at: exact at a timed size, linear between two, the line's slope beyond them (never
    below the nearer point or the line, whichever is less); at any other size of group the line alone. They
    round-trip through the cluster file, a malformed table is refused naming the key, and the planner's
    tensor-parallel all-reduces are priced on them."""
    from fivefold.comm.cost import Link, native_collective
    from fivefold.plan.cluster import LinkSpec

    points = ((16384.0, 400e-6), (524288.0, 2000e-6), (4194304.0, 4400e-6))
    line = Link(alpha=200e-6, beta=1 / 1.4e9)
    link = dataclasses.replace(line, measured=points, ranks=2)
    for size, seconds in points:
        assert native_collective("all_reduce", size, 2, link) == pytest.approx(seconds)
    middle = (524288 + 4194304) / 2
    assert native_collective("all_reduce", middle, 2, link) == pytest.approx(3200e-6)
    beyond = 8 * 4194304
    assert native_collective("all_reduce", beyond, 2, link) == pytest.approx(
        4400e-6 + native_collective("all_reduce", beyond, 2, line) - native_collective("all_reduce", 4194304, 2, line))
    assert native_collective("all_reduce", 8, 2, link) == pytest.approx(
        min(400e-6, native_collective("all_reduce", 8, 2, line)))
    for p in (3, 4):
        assert native_collective("all_reduce", 524288, p, link) == native_collective("all_reduce", 524288, p, line)
    base = CLUSTERS["h100-sxm"]
    spec = LinkSpec(1.4, 200.0, 2, tuple((size, seconds * 1e6) for size, seconds in points))
    timed = dataclasses.replace(base, collectives={"all_reduce": spec})
    path = tmp_path / "timed.toml"
    path.write_text(cluster_toml(timed))
    assert load_cluster(str(path)) == timed
    assert [x for point in timed.collective_link("all_reduce", 2).measured for x in point] == \
        pytest.approx([x for point in points for x in point])
    data = json.loads(json.dumps(timed.to_dict()))
    for bad in ({"measured": [[16384, 400.0]]}, {"measured": [[16384, 400.0], [16384, 500.0]]},
                {"measured": [[16384, -1.0], [32768, 500.0]]}, {"ranks": 1}, {"ranks": 0}, {"measured": []},
                {"measured": [[1, 2, 3], [4, 5, 6]]}, {"measured": [[16384, float("nan")], [32768, 500.0]]},
                {"measured": [[16384, 400.0], [float("inf"), 500.0]]}, {"ranks": True},
                {"measured": "fast"}, {"spread": 3}):
        broken = json.loads(json.dumps(data))
        broken["collectives"]["all_reduce"].update(bad)
        with pytest.raises(ConfigError, match="collectives.all_reduce"):
            cluster_from_dict(broken)
    plain = dataclasses.replace(base, collectives={"all_reduce": LinkSpec(1.4, 200.0)})
    assert cluster_from_dict(json.loads(json.dumps(plain.to_dict()))) == plain  # no times: ranks 0, measured []
    config = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--train.seq_len", "128",
                                "--train.micro_batch_size", "4", "--tensor_parallel.degree", "2"])
    def extra(n: float) -> float:
        return native_collective("all_reduce", n, 2, link) - native_collective("all_reduce", n, 2, line)

    # two all-reduces of the activations per block in forward, two in backward, the embedding's and the head's;
    # the loss's three of 4 bytes per token
    calls = 4 * config.model.n_layers + 2
    assert estimate(config, 2, timed).time.tp - estimate(config, 2, plain).time.tp == pytest.approx(
        calls * extra(4 * 128 * 256 * 4) + 3 * extra(4 * 128 * 4))


def test_a_collectives_times_over_smaller_groups_price_those_groups(tmp_path):
    """Measured over 4 ranks, a native collective also carries its times over groups of 2 inside them (every group
    calling at once: on shared cores a pair's call waits on the other ranks too, which the four-rank line does not
    see). A group of 2 reads those times (exact at a timed size, linear between), a group of 4 the world's, any
    other size the line. They round-trip through the cluster file; a malformed `subgroups` is refused naming the key.
    The planner and the simulator price a dp2 x tp2 job's pair collectives on them: its tensor-parallel all-reduces
    take the pairs' extra time, call by call, in both."""
    from fivefold.comm.cost import Link, native_collective
    from fivefold.plan.cluster import LinkSpec, SubgroupTimes
    from fivefold.plan.efficiency import Efficiency
    from fivefold.sim.step import simulate_step

    world = ((16384.0, 3000e-6), (4194304.0, 9000e-6))
    pairs = ((16384.0, 1900e-6), (524288.0, 2600e-6), (4194304.0, 5700e-6))
    line = Link(alpha=500e-6, beta=1 / 1.4e9)
    link = dataclasses.replace(line, measured=world, ranks=4, subgroups=((2, pairs),))
    for size, seconds in pairs:
        assert native_collective("all_reduce", size, 2, link) == pytest.approx(seconds)
    assert native_collective("all_reduce", (524288 + 4194304) / 2, 2, link) == pytest.approx(4150e-6)
    assert native_collective("all_reduce", 16384, 4, link) == pytest.approx(3000e-6)
    assert native_collective("all_reduce", 16384, 8, link) == native_collective("all_reduce", 16384, 8, line)
    assert native_collective("all_reduce", 16384, 2, dataclasses.replace(link, subgroups=())) == \
        native_collective("all_reduce", 16384, 2, line)  # no pair times: the line, as before

    base = dataclasses.replace(CLUSTERS["h100-sxm"], accelerators_per_node=4)
    us = lambda points: tuple((size, seconds * 1e6) for size, seconds in points)  # noqa: E731
    spec = LinkSpec(1.4, 500.0, 4, us(world), (SubgroupTimes(2, us(pairs)),))
    timed = dataclasses.replace(base, collectives={"all_reduce": spec})
    path = tmp_path / "timed.toml"
    path.write_text(cluster_toml(timed))
    assert "subgroups = [{ranks = 2, measured = [[16384.0, 1900.0]" in path.read_text()
    assert load_cluster(str(path)) == timed
    data = json.loads(json.dumps(timed.to_dict()))
    assert cluster_from_dict(data) == timed
    for bad in ([{"ranks": 3, "measured": [[16384, 1.0], [32768, 2.0]]}],  # not a divisor of 4
                [{"ranks": 4, "measured": [[16384, 1.0], [32768, 2.0]]}],  # not smaller than 4
                [{"ranks": 2, "measured": [[16384, 1.0]]}],  # one point
                [{"ranks": 2, "measured": [[16384, 1.0], [32768, 2.0]], "spread": 1}],
                [{"ranks": 2, "measured": [[16384, 1.0], [32768, 2.0]]}] * 2, "pairs", [2],
                [{"ranks": 2, "measured": [[16384, float("nan")], [32768, 2.0]]}],  # a time not finite
                [{"ranks": 2, "measured": [[16384, 1.0], [float("inf"), 2.0]]}]):
        broken = json.loads(json.dumps(data))
        broken["collectives"]["all_reduce"]["subgroups"] = bad
        with pytest.raises(ConfigError, match="collectives.all_reduce.*subgroups"):
            cluster_from_dict(broken)
    bare = json.loads(json.dumps(data))  # pair times beside no times of the world's
    del bare["collectives"]["all_reduce"]["ranks"], bare["collectives"]["all_reduce"]["measured"]
    with pytest.raises(ConfigError, match="subgroups"):
        cluster_from_dict(bare)

    plain = dataclasses.replace(timed, collectives={"all_reduce": dataclasses.replace(spec, subgroups=())})
    config = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--train.seq_len", "128",
                                "--train.micro_batch_size", "4", "--tensor_parallel.degree", "2"])
    flat = dataclasses.replace(link, subgroups=())

    def extra(n: float) -> float:
        return native_collective("all_reduce", n, 2, link) - native_collective("all_reduce", n, 2, flat)

    calls = 4 * config.model.n_layers + 2  # as in the test above: the blocks', the embedding's and the head's
    expected = calls * extra(4 * 128 * 256 * 4) + 3 * extra(4 * 128 * 4)
    assert expected > 0
    assert estimate(config, 4, timed).time.tp - estimate(config, 4, plain).time.tp == pytest.approx(expected)
    simulated = [simulate_step(config, 4, cluster, Efficiency(0.5), vocab_size=257, record_spans=False).time
                 for cluster in (plain, timed)]
    assert simulated[1] > simulated[0]


def test_a_collectives_measured_times_are_read_nondecreasing_in_size():
    """More bytes cannot take less time: a measured time below a smaller size's (a mean that met a stall) is pooled
    with its neighbours into their mean (the least-squares nondecreasing fit), so the planner never prices a larger
    call below a smaller one; times already rising are read as they are."""
    from fivefold.comm.cost import Link, native_collective, nondecreasing

    rising = ((16384.0, 1e-3), (65536.0, 2e-3), (262144.0, 3e-3))
    assert nondecreasing(rising) == rising
    # one run of this machine: 256 KB measured slower than 512 KB and 1 MB
    noisy = ((16384.0, 1074e-6), (65536.0, 1751e-6), (262144.0, 3176e-6), (524288.0, 1237e-6), (1048576.0, 2208e-6),
             (4194304.0, 5355e-6))
    pooled = (3176e-6 + 1237e-6) / 2  # 2.2065 ms, still below 1 MB's 2.208
    assert [t for _, t in nondecreasing(noisy)] == pytest.approx([1074e-6, 1751e-6, pooled, pooled, 2208e-6, 5355e-6])
    assert nondecreasing(((1.0, 5.0), (2.0, 4.0), (3.0, 3.0))) == ((1.0, 4.0), (2.0, 4.0), (3.0, 4.0))
    link = Link(alpha=600e-6, beta=1 / 1.1e9, measured=noisy, ranks=2)
    times = [native_collective("all_reduce", n, 2, link) for n in (16384, 100000, 262144, 400000, 524288, 1 << 20, 4 << 20)]
    assert times == sorted(times)
    assert native_collective("all_reduce", 524288, 2, link) == pytest.approx(pooled)


def test_parameter_server_layout_is_planned_as_the_runtime_builds_it():
    """data_parallel.mode = ps: workers hold the runtime's own model-state formula (fp32 weights and gradients,
    no optimizer); the largest server shard is the runtime's ServerLayout over the real model's parameters; the
    busiest server's link carries every worker's push and pull; bsp keeps a push buffer per worker."""
    from fivefold.model import build_model, materialize
    from fivefold.parallel.parameter_server import ParameterServerSync, ServerLayout
    from fivefold.plan.estimate import server_memory, server_shards

    def ps(servers, sync="bsp"):
        return load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--data_parallel.mode", "ps",
                                  "--parameter_server.servers", str(servers), "--parameter_server.sync", sync])

    cluster = CLUSTERS["h100-sxm"]
    model = get_preset("tiny")
    model.vocab_size = 257
    sizes = [p.numel() for p in materialize(build_model(model), "cpu").parameters()]
    for servers in (1, 2, 3):
        layout = ServerLayout.balance(sizes, 4, servers)
        assert server_shards(model, servers, 4) == [sum(sizes[i] for i in layout.owned(s)) for s in range(servers)]
    one, two = estimate(ps(1), 5, cluster), estimate(ps(2), 6, cluster)
    assert one.degrees.dp == two.degrees.dp == 4 and one.tokens_per_step == two.tokens_per_step
    psi = one.memory.parameter_count
    assert psi == sum(sizes)
    assert (one.memory.parameters, one.memory.gradients, one.memory.optimizer) == \
        tuple(ParameterServerSync.expected_model_states(None, psi).__dict__.values())
    assert one.memory.buckets == 0 and one.memory.buffers == 2 * 4 * psi  # the step's flat push and pull copies
    assert one.server == server_memory(ps(1), psi, 4)
    assert one.server.buffers == 5 * 4 * psi and one.server.optimizer == 8 * psi
    assert estimate(ps(1, "asp"), 5, cluster).server.buffers == 4 * psi
    shard = max(server_shards(model, 2, 4))
    assert two.server.parameter_count == shard < psi
    link = cluster.link_for(5)
    assert one.time.dp == pytest.approx(2 * 4 * link.message(4 * psi))  # the one server's link, both ways
    assert two.time.dp < one.time.dp and one.time.compute == two.time.compute
    with pytest.raises(ConfigError, match="data_parallel.mode = ps"):
        search(ps(1), 5, cluster, 8)


# ---- the attention core's own efficiency (plan/efficiency.py)


def test_attention_core_runs_at_its_own_share_of_peak():
    """The core's forward (4 q s FLOPs per token) is priced at peak x the attention share and the rest at peak x
    the matmul share: halving the attention share adds exactly one core per block pass (forward, two backward,
    one more forward under selective recomputation); 0 and a bare number mean one share for all."""
    from fivefold.plan.efficiency import Efficiency

    cluster = CLUSTERS["h100-sxm"]
    for recompute, passes in (("none", 3), ("selective", 4)):
        config = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--train.seq_len", "256",
                                    "--train.grad_accum_steps", "2", "--train.recompute", recompute])
        plain = estimate(config, 1, cluster, 0.5).time
        assert estimate(config, 1, cluster, Efficiency(0.5)).time == plain
        assert estimate(config, 1, cluster, Efficiency(0.5, 0.5)).time == plain
        slow = estimate(config, 1, cluster, Efficiency(0.5, 0.25)).time
        model, t = config.model, config.train
        core = 4 * model.dim * t.seq_len * t.micro_batch_size * t.seq_len / cluster.accelerator.peak_flops("fp32") / 0.5
        extra = passes * t.grad_accum_steps * model.n_layers * core
        assert slow.compute - plain.compute == pytest.approx(extra, rel=1e-9)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="efficiency"):
            Efficiency(bad)
    with pytest.raises(ConfigError, match="attention efficiency = -0.1"):
        Efficiency(0.5, -0.1)
    for bad in ("2", "nan", "inf", "-1"):
        assert main(["plan", "--model.preset", "tiny", "--model.vocab_size", "257", "--gpus", "1",
                     "--attention-efficiency", bad]) == 2


def test_routed_experts_run_at_their_own_share_of_peak():
    """--expert-efficiency prices a MoE block's routed expert GEMMs (2 x k of E experts' matmul parameters per token)
    at their own share: halving it adds exactly those GEMMs' seconds again to the MoE block and to `routed` (the part
    a busier EP rank scales), with and without the width law; a dense block, a dense model and an unset share
    (0: the matmuls') are unchanged; out of range, nan or inf is refused naming the option."""
    from fivefold.plan.efficiency import Efficiency
    from fivefold.plan.estimate import degrees_of, model_for, pass_costs, routed_parameters_per_token

    cluster = CLUSTERS["h100-sxm"]
    config = load_config(None, ["--model.preset", "tiny-moe", "--model.vocab_size", "257", "--train.seq_len", "128",
                                "--model.n_layers", "2", "--model.moe_first_dense", "1"])
    model, d = model_for(config), degrees_of(config, 1)
    assert model.moe_layers == [1]  # a dense block and a MoE block
    tokens = config.train.micro_batch_size * config.train.seq_len
    moe = model.moe_layers[0]
    gemms = 2 * routed_parameters_per_token(model, moe) * tokens / cluster.accelerator.peak_flops("fp32")
    for half_width in (0.0, 64.0):
        plain = pass_costs(config, model, d, cluster, Efficiency(0.5, half_width=half_width))
        assert pass_costs(config, model, d, cluster, Efficiency(0.5, half_width=half_width, experts=0.0)) == plain
        slow = pass_costs(config, model, d, cluster, Efficiency(0.5, half_width=half_width, experts=0.25))
        assert slow.block[False] == plain.block[False] and slow.head == plain.head
        assert slow.block[True] - plain.block[True] == pytest.approx(gemms / 0.25 - plain.routed, rel=1e-9)
        assert slow.routed == pytest.approx(gemms / 0.25, rel=1e-9)
    narrowest = min(model.dim, model.expert_hidden_dim)
    assert plain.routed == pytest.approx(gemms * (1 + 64 / narrowest) / 0.5, rel=1e-9)  # the width law's
    dense = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257"])
    assert estimate(dense, 1, cluster, Efficiency(0.5, experts=0.1)).time == estimate(dense, 1, cluster, 0.5).time
    assert estimate(config, 1, cluster, Efficiency(0.5, experts=0.1)).time.compute > estimate(config, 1, cluster,
                                                                                             0.5).time.compute
    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="expert efficiency"):
            Efficiency(0.5, experts=bad)
    for bad in ("2", "nan", "inf", "-1"):
        assert main(["plan", "--model.preset", "tiny-moe", "--model.vocab_size", "257", "--gpus", "1",
                     "--expert-efficiency", bad]) == 2


def test_block_pass_overhead_is_paid_once_per_block_pass(tmp_path):
    """accelerator.pass_overhead_us adds a fixed cost to every block forward: 3 passes per block and micro-batch
    (forward, backward twice), 4 under full recomputation (the forward again); it round-trips through the
    cluster file, and a negative, nan, infinite or non-numeric one is refused naming the key."""
    h100 = CLUSTERS["h100-sxm"]
    slow = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, pass_overhead_us=250.0))
    for recompute, passes in (("none", 3), ("selective", 3), ("full", 4)):
        config = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--train.seq_len", "256",
                                    "--train.grad_accum_steps", "2", "--train.recompute", recompute])
        extra = estimate(config, 1, slow).time.compute - estimate(config, 1, h100).time.compute
        assert extra == pytest.approx(passes * 2 * config.model.n_layers * 250e-6, rel=1e-9)
    path = tmp_path / "slow.toml"
    path.write_text(cluster_toml(slow))
    assert load_cluster(str(path)) == slow
    data = json.loads(json.dumps(slow.to_dict()))
    for bad in (-1, float("nan"), float("inf"), "10"):
        data["accelerator"]["pass_overhead_us"] = bad
        with pytest.raises(ConfigError, match="accelerator.pass_overhead_us"):
            cluster_from_dict(data)


_MOE_VARIANTS = [  # the MoE switches that change which operators a block runs, at tiny-moe's width
    [],
    ["--model.moe_capacity_factor", "1.25"],
    ["--model.moe_score", "sigmoid", "--model.moe_groups", "4", "--model.moe_topk_groups", "2",
     "--model.moe_shared_gate", "true"],
    ["--model.attention", "mla", "--model.q_lora_rank", "64", "--model.kv_lora_rank", "64",
     "--model.qk_nope_head_dim", "32", "--model.qk_rope_head_dim", "16", "--model.v_head_dim", "32"],
]


@pytest.mark.parametrize("changes", _MOE_VARIANTS)
@pytest.mark.parametrize("kernel", ["grouped", "loop"])
def test_a_blocks_operators_are_counted_on_a_small_copy(changes, kernel):
    """The small copy the planner counts (plan/operators.py) dispatches exactly the operators of the full-width
    blocks, dense and MoE, on both expert kernels and under each routing switch that adds operators."""
    from fivefold.plan.operators import count_block_operators, small_copy

    model = load_config(None, ["--model.preset", "tiny-moe", "--model.vocab_size", "257", *changes]).model
    dense = dataclasses.replace(model, n_experts=0)
    for full in (model, dense):
        assert count_block_operators(small_copy(full), 0, kernel) == count_block_operators(full, 0, kernel, seq=64)


def test_a_moe_blocks_fixed_cost_scales_with_its_operators():
    """A MoE block's pass overhead is the dense block's times the ratio of the operators the runtime's two blocks
    (tiny-moe's, and the same model without experts) dispatch, counted here at full width; the loop kernel
    runs more of them than the grouped GEMM; without a pass overhead nothing is counted or added."""
    from fivefold.plan.estimate import degrees_of, model_for, pass_costs
    from fivefold.plan.operators import count_block_operators

    h100 = CLUSTERS["h100-sxm"]
    slow = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, pass_overhead_us=250.0))
    ratios = {}
    for kernel in ("grouped", "loop"):
        config = load_config(None, ["--model.preset", "tiny-moe", "--model.vocab_size", "257", "--train.seq_len", "128",
                                    "--expert_parallel.kernel", kernel])
        model, d = model_for(config), degrees_of(config, 1)
        extra = pass_costs(config, model, d, slow, 0.5).block[True] - pass_costs(config, model, d, h100, 0.5).block[True]
        ratios[kernel] = count_block_operators(model, 0, kernel) / count_block_operators(
            dataclasses.replace(model, n_experts=0), 0)
        assert extra == pytest.approx(250e-6 * ratios[kernel], rel=1e-9)
    assert 1.5 < ratios["grouped"] < ratios["loop"]


def _context_parallel_block_difference(more, less, gpus: int, *changes: str, preset: str = "tiny") -> dict[bool, float]:
    """Each block kind's forward cost on cluster `more` less on `less`: `preset` at seq 128 on `gpus` cp ranks."""
    from fivefold.plan.estimate import degrees_of, model_for, pass_costs

    config = load_config(None, ["--model.preset", preset, "--model.vocab_size", "257", "--train.seq_len", "128",
                                "--context_parallel.degree", str(gpus), *changes])
    model, d = model_for(config), degrees_of(config, gpus)
    high, low = pass_costs(config, model, d, more, 0.5), pass_costs(config, model, d, less, 0.5)
    return {kind: high.block[kind] - low.block[kind] for kind in low.block}


def test_ring_attentions_own_operators_add_to_a_blocks_fixed_cost():
    """Context parallelism with a ring adds ring attention's operators (plan/operators.py
    `ring_attention_operators`, the loopback count tests/distributed/test_ring_operators.py holds to a real ring's)
    to every block's pass overhead, dense and MoE alike, as a share of a dense block's: more for a longer ring, the
    same for a double ring of as many ranks, 2D's ring counted, Ulysses none; its FLOPs are priced as before."""
    from fivefold.plan.operators import ring_attention_operators

    h100 = CLUSTERS["h100-sxm"]
    slow = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, pass_overhead_us=250.0))

    def overhead(gpus: int, *changes: str, preset: str = "tiny") -> dict[bool, float]:
        return _context_parallel_block_difference(slow, h100, gpus, *changes, preset=preset)

    model = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257"]).model
    two, four = ring_attention_operators(model, 2), ring_attention_operators(model, 4)
    assert 0.2 < two < four and ring_attention_operators(model, 4, 2) == pytest.approx(four)
    assert overhead(2)[False] == pytest.approx(250e-6 * (1 + two), rel=1e-9)
    assert overhead(4, "--context_parallel.inner_ring", "2")[False] == pytest.approx(250e-6 * (1 + four), rel=1e-9)
    assert overhead(4, "--context_parallel.method", "2d", "--context_parallel.heads", "2")[False] == \
        pytest.approx(250e-6 * (1 + two), rel=1e-9)
    assert overhead(2, "--context_parallel.method", "ulysses")[False] == pytest.approx(250e-6, rel=1e-9)
    assert overhead(1)[False] == pytest.approx(250e-6, rel=1e-9)
    moe_ring = ring_attention_operators(load_config(None, ["--model.preset", "tiny-moe", "--model.vocab_size", "257"]).model, 2)
    assert overhead(2, preset="tiny-moe")[True] - overhead(1, preset="tiny-moe")[True] == \
        pytest.approx(250e-6 * moe_ring, rel=1e-9)


def test_ring_attentions_own_python_adds_the_measured_operators_per_ring_step():
    """A host that measured ring attention's own Python (accelerator.ring_step_operators, plan/ring_host.py) adds
    that many of a dense block's operators per ring step to every block's fixed cost, beside the counted ones: ring
    steps, not ranks (a double ring of 4 and 2D's ring of 2 over 4 ranks); nothing for Ulysses or without cp."""
    from fivefold.plan.estimate import degrees_of, model_for, pass_costs
    from fivefold.plan.operators import dense_block_operators

    h100 = CLUSTERS["h100-sxm"]
    counted = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, pass_overhead_us=250.0))
    measured = dataclasses.replace(counted, accelerator=dataclasses.replace(counted.accelerator, ring_step_operators=20.0))

    def added(gpus: int, *changes: str, preset: str = "tiny") -> dict[bool, float]:
        return _context_parallel_block_difference(measured, counted, gpus, *changes, preset=preset)

    dense = dense_block_operators(load_config(None, ["--model.preset", "tiny"]).model)
    assert dense == 108  # tiny's small copy, as plan/operators.py counts it
    assert added(2)[False] == pytest.approx(250e-6 * 2 * 20.0 / dense, rel=1e-9)
    assert added(4)[False] == pytest.approx(250e-6 * 4 * 20.0 / dense, rel=1e-9)
    assert added(4, "--context_parallel.inner_ring", "2")[False] == pytest.approx(added(4)[False], rel=1e-9)
    assert added(4, "--context_parallel.method", "2d", "--context_parallel.heads", "2")[False] == \
        pytest.approx(added(2)[False], rel=1e-9)
    assert added(2, "--context_parallel.method", "ulysses")[False] == 0.0 and added(1)[False] == 0.0
    moe = added(2, preset="tiny-moe")  # a MoE block's ring runs the same Python, priced on the dense block's count
    assert moe[True] == pytest.approx(250e-6 * 2 * 20.0 / dense, rel=1e-9)
    free = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, ring_step_operators=20.0))
    config = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--context_parallel.degree", "2"])
    model, d = model_for(config), degrees_of(config, 2)  # no fixed cost per block (a GPU preset): nothing to add
    assert pass_costs(config, model, d, free, 0.5) == pass_costs(config, model, d, h100, 0.5)


def test_ring_host_measurement_reads_the_functions_own_time_per_counted_operator():
    """plan/ring_host.py: the ring's functions' own time P over the rest of the block's time per counted operator,
    per ring step, averaged over the rings; on this host a real profile gives a positive figure, rows for rings 2
    and 4 with their counted operators."""
    from fivefold.plan.operators import count_block_operators, dense_small_copy, loopback_ring
    from fivefold.model.presets import PRESETS
    from fivefold.plan.ring_host import measure_ring_host, ring_step_operators_of

    # ring 2: 400 us of Python beside 1,600 us for 160 operators (10 us each): 40 operators, 20 a step;
    # ring 4: 600 us beside 1,800 us for 180: 60 operators, 15 a step; the mean 17.5
    assert ring_step_operators_of([[2, 400.0, 2000.0, 160], [4, 600.0, 2400.0, 180]]) == pytest.approx(17.5)
    assert ring_step_operators_of([]) == 0.0 and ring_step_operators_of([[2, 5.0, 5.0, 100]]) == 0.0
    result = measure_ring_host(passes=3)
    small = dense_small_copy(PRESETS["tiny"])
    assert [row[0] for row in result["measured"]] == [2, 4]
    for ring, python, total, counted in result["measured"]:
        assert 0 < python < total and counted == count_block_operators(small, 0, core=loopback_ring(ring))
    assert result["ring_step_operators"] == pytest.approx(ring_step_operators_of(result["measured"]))
    assert result["ring_step_operators"] > 0


def test_grouped_gemms_fixed_cost_grows_with_the_experts_a_rank_holds(tmp_path):
    """A host that measured the grouped GEMM's fixed cost per expert (accelerator.expert_group_us,
    plan/expert_host.py) adds it to a MoE block's forward three times (gate, up, down) per expert the rank holds:
    8 experts on one rank, 4 under ep2, 2 under ep4 (etp slices each expert, it does not split them), 5 slots under
    ep2 with one EPLB replica per rank; backward pays
    twice the forward, so the step grows by nine calls per expert and MoE block; nothing for a dense block, under
    the loop kernel (its matmuls are counted operators), or on a host that did not measure it."""
    from fivefold.plan.estimate import degrees_of, model_for, pass_costs

    h100 = CLUSTERS["h100-sxm"]
    measured = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, expert_group_us=80.0))

    def added(gpus: int, *changes: str) -> tuple[dict[bool, float], float]:
        config = load_config(None, ["--model.preset", "tiny-moe", "--model.vocab_size", "257", "--model.n_layers", "4",
                                    "--train.seq_len", "128", *changes])
        model, d = model_for(config), degrees_of(config, gpus)
        high, low = pass_costs(config, model, d, measured, 0.5), pass_costs(config, model, d, h100, 0.5)
        step = estimate(config, gpus, measured, 0.5).time.compute - estimate(config, gpus, h100, 0.5).time.compute
        return {kind: high.block[kind] - low.block[kind] for kind in low.block}, step

    moe_layers = len(load_config(None, ["--model.preset", "tiny-moe", "--model.n_layers", "4"]).model.moe_layers)
    load = [400.0, 300.0, 100.0, 50.0, 50.0, 40.0, 30.0, 30.0]  # a measured load for EPLB's replicas
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "moe_load": {str(i): load for i in range(4)}}) + "\n")
    for gpus, experts, changes in ((1, 8, ()), (2, 4, ("--expert_parallel.degree", "2")),
                                   (4, 2, ("--expert_parallel.degree", "4")),
                                   (4, 4, ("--expert_parallel.degree", "2", "--expert_parallel.tensor", "2")),
                                   (2, 5, ("--expert_parallel.degree", "2", "--expert_parallel.replicas", "1",
                                           "--expert_parallel.load_from", str(tmp_path)))):
        block, step = added(gpus, *changes)
        assert block[True] == pytest.approx(3 * experts * 80e-6, rel=1e-9) and block.get(False, 0.0) == 0.0
        assert step == pytest.approx(9 * experts * 80e-6 * moe_layers, rel=1e-6)
    loop, _ = added(1, "--expert_parallel.kernel", "loop")
    assert loop[True] == 0.0
    config = load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257"])
    model, d = model_for(config), degrees_of(config, 1)
    assert pass_costs(config, model, d, measured, 0.5) == pass_costs(config, model, d, h100, 0.5)


def test_expert_group_measurement_is_the_slope_per_expert_and_call():
    """plan/expert_host.py: the least-squares slope of a forward and backward's time over the experts holding the
    same rows, per grouped call (nine); a real measurement on this host times one expert and eight, eight dearer."""
    from fivefold.plan.expert_host import CALLS, EXPERTS, measure_expert_groups, expert_group_us_of

    assert CALLS == 9 and EXPERTS == 8
    assert expert_group_us_of([[1, 1000.0], [8, 1000.0 + 7 * 9 * 50.0]]) == pytest.approx(50.0)
    assert expert_group_us_of([[1, 1000.0], [2, 1090.0], [4, 1270.0]]) == pytest.approx(10.0)
    assert expert_group_us_of([[1, 1000.0], [8, 900.0]]) == 0.0  # a slope that does not rise: none
    assert expert_group_us_of([[1, 1000.0]]) == 0.0 and expert_group_us_of([]) == 0.0
    result = measure_expert_groups(rounds=3, passes=2)
    assert [row[0] for row in result["measured"]] == [1, 8] and all(us > 0 for _, us in result["measured"])
    assert result["expert_group_us"] == pytest.approx(expert_group_us_of(result["measured"]))
    assert result["expert_group_us"] > 0


def test_parameter_server_roles_on_one_host_take_turns_with_its_cores():
    """Parameter servers on a CPU host (accelerator.shared_cores; rates measured with every rank computing): the
    workers compute while the servers wait for their pushes, and the servers update while the workers wait, so each
    role runs at CoreSharing.speed of its own count. 2 cores, 4 ranks of one thread: 2 workers have a core each
    (4 x 1 / 2 / efficiency times the shared rate); 3 workers share 2 cores (4 / 3 times)."""
    h100 = CLUSTERS["h100-sxm"]
    host = dataclasses.replace(h100, accelerators_per_node=4, accelerator=dataclasses.replace(
        h100.accelerator, shared_cores=2, oversubscribed_efficiency=0.8))

    def ps(servers: int):
        return load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--train.seq_len", "128",
                                  "--data_parallel.mode", "ps", "--parameter_server.servers", str(servers)])

    for servers, workers_speed, servers_speed in ((2, 4 / 2 / 0.8, 4 / 2 / 0.8), (1, 4 / 3, 4 / 2 / 0.8)):
        plain, shared = estimate(ps(servers), 4, h100).time, estimate(ps(servers), 4, host).time
        assert shared.compute == pytest.approx(plain.compute / workers_speed, rel=1e-12)
        assert shared.optimizer == pytest.approx(plain.optimizer / servers_speed, rel=1e-12)
        assert shared.dp == plain.dp  # the pushes and pulls: the links'


def test_ranks_sharing_a_hosts_cores_lend_them_in_the_pipeline_bubble(tmp_path):
    """accelerator.shared_cores (a CPU host, rates measured with every rank computing): the pipeline is
    simulated with processor sharing, so the bubble shrinks and the passes beside idle ranks take less
    than priced; the step's compute + pipeline parts are then the shared simulation's makespan. Layouts
    without a pipeline, jobs past one node, and enough cores for every rank's threads are unchanged; the
    field round-trips through the cluster file and a bad one is refused naming it."""
    h100 = CLUSTERS["h100-sxm"]

    def sharing(cores: int, per_node: int = 8):
        return dataclasses.replace(h100, accelerators_per_node=per_node,
                                   accelerator=dataclasses.replace(h100.accelerator, shared_cores=cores))

    def tiny(*overrides):
        return load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--model.n_layers", "4",
                                  "--train.seq_len", "128", *overrides])

    pp4 = tiny("--pipeline_parallel.degree", "4", "--train.grad_accum_steps", "8")
    plain, shared = estimate(pp4, 4, h100), estimate(pp4, 4, sharing(2))
    assert shared.time.total < plain.time.total and shared.time.bubble < plain.time.bubble
    assert 0.5 <= shared.time.compute / plain.time.compute < 1  # two cores for four: at most twice as fast
    pipeline_part = (shared.time.compute + shared.time.pp_comm + shared.time.bubble)
    plain_part = (plain.time.compute + plain.time.pp_comm + plain.time.bubble)
    # ranks x threads <= cores (4 cores, 1 thread each; 8 cores, 2 threads each): nobody has a core to lend
    def same(a, b) -> bool:
        return dataclasses.astuple(a) == pytest.approx(dataclasses.astuple(b), rel=1e-9)

    for roomy in (sharing(4), sharing(8)):
        assert same(estimate(pp4, 4, roomy).time, plain.time)
    # the job spans two hosts: not modelled
    assert same(estimate(pp4, 4, sharing(2, per_node=2)).time, estimate(pp4, 4, sharing(0, per_node=2)).time)
    dp4 = tiny()
    assert same(estimate(dp4, 4, sharing(2)).time, estimate(dp4, 4, h100).time)
    # the shared simulation bounds: no faster than the two cores' whole capacity, no slower than unshared
    assert plain_part / 2 < pipeline_part < plain_part
    path = tmp_path / "cpu.toml"
    path.write_text(cluster_toml(sharing(2)))
    assert load_cluster(str(path)) == sharing(2)
    data = json.loads(json.dumps(sharing(2).to_dict()))
    for bad in (-1, 1.5, "2", True):
        data["accelerator"]["shared_cores"] = bad
        with pytest.raises(ConfigError, match="accelerator.shared_cores"):
            cluster_from_dict(data)
    data["accelerator"]["shared_cores"] = 2
    for bad in (0, 1.5, float("nan"), "1"):
        data["accelerator"]["oversubscribed_efficiency"] = bad
        with pytest.raises(ConfigError, match="accelerator.oversubscribed_efficiency"):
            cluster_from_dict(data)
    # a host losing throughput to time-slicing: a pipeline rank alone gains more than its share of the cores
    lossy = dataclasses.replace(sharing(2), accelerator=dataclasses.replace(sharing(2).accelerator,
                                                                           oversubscribed_efficiency=0.5))
    assert estimate(pp4, 4, lossy).time.total < shared.time.total


MLA = dict(attention="mla", kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("changes", [
    {}, dict(attention_bias="all", mlp_bias=True, qk_norm="head"), dict(attention_bias="qkv", qk_norm="projection"),
    MLA, {**MLA, "q_lora_rank": 0}, dict(tie_embeddings=True),
    dict(n_experts=8, moe_top_k=2, moe_ffn_dim=32, moe_shared_experts=1, moe_shared_gate=True, moe_first_dense=1),
])
def test_tensors_the_optimizer_updates_are_the_models(changes):
    """rank_tensors counts the meta-device model's parameter tensors and (ZeRO) its flat groups
    (parallel/flat_groups.py), whole and per pipeline stage, and an expert-parallel rank's share of the experts."""
    from fivefold.model import build_model
    from fivefold.parallel.expert_parallel import cut_experts
    from fivefold.parallel.expert_placement import contiguous_placement
    from fivefold.parallel.flat_groups import flat_group_layout

    model = dataclasses.replace(get_preset("tiny"), vocab_size=257, **changes)
    layers = list(range(model.n_layers))
    net = build_model(model)
    assert rank_tensors(model, layers, True, True) == sum(1 for _ in net.parameters())
    assert rank_tensors(model, layers, True, True, flat=True) == len(flat_group_layout(net))
    # a pipeline stage: the first holds the embedding, the last the final norm and head (its own copy when tied)
    first = [n for n, _ in net.named_parameters() if n.startswith(("tok_embeddings.", "layers.0.", "layers.1."))]
    last = [n for n, _ in net.named_parameters() if n.startswith(("norm.", "output.", "layers.2.", "layers.3."))]
    tied = 1 if model.tie_embeddings else 0
    assert rank_tensors(model, [0, 1], True, False, pipelined=True) == len(first)
    assert rank_tensors(model, [2, 3], False, True, pipelined=True) == len(last) + tied
    if model.n_experts:
        cut_experts(net, {layer: contiguous_placement(model.n_experts, 4) for layer in model.moe_layers}, 0)
        assert rank_tensors(model, layers, True, True, ep=4) == sum(1 for _ in net.parameters())
        assert rank_tensors(model, layers, True, True, ep=4, flat=True) == \
            len([g for g in flat_group_layout(net) if g.numel])


@pytest.mark.parametrize("changes", [{}, dict(tie_embeddings=True), dict(attention_bias="all", mlp_bias=True, qk_norm="projection"),
                                     dict(qk_norm="head"), MLA,
                                     dict(n_experts=8, moe_top_k=2, moe_ffn_dim=32, moe_shared_experts=1)])
def test_flat_group_sizes_are_the_runtimes_flat_groups(changes):
    """flat_group_sizes (the planner's and the simulator's ZeRO groups) is the runtime's flat_group_layout on the
    meta-device model, group for group in order, with an expert-parallel rank's experts cut as the runtime cuts
    them; under tensor parallelism its groups add up to the rank's exact Ψ (the runtime's tp-cut groups are checked
    call for call by tests/distributed/test_step_traffic.py, dp2-tp2-zero3-biases), and so does `local_tensor`'s
    cut of every tensor. Until 2026-11-28 the tp cut
    (`local_tensor`) kept the column-parallel biases and projection q/k norms whole and cut a replicated kv head
    below one head."""
    from fivefold.model import build_model
    from fivefold.parallel.expert_parallel import cut_experts
    from fivefold.parallel.expert_placement import contiguous_placement
    from fivefold.parallel.flat_groups import flat_group_layout, is_expert_group
    from fivefold.plan.parameters import flat_group_sizes, local_tensor, padded_vocab

    model = dataclasses.replace(get_preset("tiny"), vocab_size=257, **changes)
    layers = list(range(model.n_layers))
    for ep in (1, 4) if model.n_experts else (1,):
        net = build_model(model)
        if ep > 1:
            cut_experts(net, {layer: contiguous_placement(model.n_experts, ep) for layer in model.moe_layers}, 0)
        runtime = [g for g in flat_group_layout(net) if g.numel]
        dense, routed = flat_group_sizes(model, ep=ep).of(layers, True, True)
        root = [g.numel for g in runtime if g.unit == model.n_layers]
        assert dense == root[:1] + [g.numel for g in runtime if g.unit < model.n_layers and not is_expert_group(g.key)] \
            + root[1:]
        assert routed == [g.numel for g in runtime if is_expert_group(g.key)]
        assert len(dense) + len(routed) == rank_tensors(model, layers, True, True, ep=ep, flat=True)
    for tp in (1, 2, 4, 8):  # 8: each rank holds one query head and a replica of a kv head (the model has 4)
        dense, routed = flat_group_sizes(model, tp).of(layers, True, True)
        counted = rank_parameters(model, layers, True, True, tp=tp)
        assert (sum(dense), sum(routed)) == (counted.dense, counted.experts)
        # the simulator's DDP buckets, PowerSGD's shares and the priority schedule's slices cut each tensor alike
        vocab = padded_vocab(model.vocab_size, tp)
        assert sum(local_tensor(name, tuple(p.shape), vocab, tp, 1, model.head_size)[0]
                   for name, p in build_model(model).named_parameters()) == counted.total
    first, _ = flat_group_sizes(model).of([0, 1], True, False)  # a pipeline stage's: the embedding's and its blocks'
    assert len(first) == 1 + 2 * 2


def test_zero_prices_one_collective_per_flat_group():
    """ZeRO's collectives are issued per flat group (parallel/zero.py), so on a link where each costs a latency
    the data-parallel term counts them: ZeRO-3 gathers the blocks' groups in every forward and backward and
    reduce-scatters every group, per micro-batch, and gathers the root's groups (embedding, final norm, head) once
    a step; ZeRO-1 reduce-scatters every group once and gathers the updated weights per group, exposed."""
    from fivefold.comm.cost import native_collective
    from fivefold.plan.cluster import LinkSpec
    from fivefold.plan.parameters import flat_group_sizes

    slow = dataclasses.replace(CLUSTERS["h100-sxm"], intra=LinkSpec(1e6, 1e6), collectives={})  # 1 s a message
    link = slow.collective_link("all_gather", 2)
    common = ["--model.preset", "tiny", "--model.n_layers", "4", "--train.seq_len", "64", "--train.micro_batch_size", "1",
              "--data_parallel.shard", "2", "--train.grad_accum_steps", "2"]
    model = dataclasses.replace(get_preset("tiny"), n_layers=4, vocab_size=257)
    groups, _ = flat_group_sizes(model).of(list(range(4)), True, True)
    blocks, _ = flat_group_sizes(model).of(list(range(4)), False, False)
    assert (len(groups), len(blocks)) == (11, 8)

    def each(kind: str, sizes: list[int]) -> float:
        return sum(native_collective(kind, 4 * n, 2, link) for n in sizes)

    zero3 = estimate(load_config(None, [*common, "--data_parallel.zero_stage", "3"]), 2, slow, vocab_size=257).time
    per_micro = 2 * each("all_gather", blocks) + each("reduce_scatter", groups)
    root = each("all_gather", groups) - each("all_gather", blocks)
    assert zero3.dp == pytest.approx(2 * per_micro + root, rel=1e-3)  # less the micro-seconds of compute it hides behind
    zero1 = estimate(load_config(None, [*common, "--data_parallel.zero_stage", "1"]), 2, slow, vocab_size=257).time
    assert zero1.dp == pytest.approx(each("reduce_scatter", groups) + each("all_gather", groups), rel=1e-3)


def test_optimizer_step_is_priced_at_the_accelerators_optimizer_rate(tmp_path):
    """The optimizer phase is 28 bytes per parameter the rank updates at accelerator.optimizer_gbs (default the
    memory bandwidth: a fused kernel) plus optimizer_tensor_us per tensor: parameter tensors under DDP, flat groups
    under ZeRO (each rank updating its shard), on the busiest pipeline rank, after the gradient norm and clipping
    over the same gradients at the memory bandwidth (4 + 8 bytes each; 4 with train.max_grad_norm = 0); the
    parameter servers' update too. The fields round-trip through a cluster file, a bad or unknown one is refused
    naming it."""
    h100 = CLUSTERS["h100-sxm"]
    cpu = dataclasses.replace(h100, accelerator=dataclasses.replace(h100.accelerator, optimizer_gbs=10.0,
                                                                    optimizer_tensor_us=20.0))
    model = dataclasses.replace(get_preset("tiny"), vocab_size=257)
    layers = list(range(model.n_layers))

    def tiny(*overrides):
        return load_config(None, ["--model.preset", "tiny", "--model.vocab_size", "257", "--train.seq_len", "128",
                                  *overrides])

    def update(config, gpus, cluster):  # the optimizer phase without the step's scalar all-reduces
        return estimate(config, gpus, cluster).time.optimizer - _scalars(config, gpus, cluster)

    psi = rank_parameters(model, layers, True, True).total
    clip = 12 / H100_STREAMED  # seconds per gradient: its norm (4 bytes) and scaling (8), as the H100 preset streams
    ddp = update(tiny(), 2, cpu)
    assert ddp == pytest.approx(28 * psi / 10e9 + rank_tensors(model, layers, True, True) * 20e-6 + clip * psi)
    unclipped = update(tiny("--train.max_grad_norm", "0"), 2, cpu)
    assert unclipped == pytest.approx(ddp - 8 * psi / H100_STREAMED)
    zero = update(tiny("--data_parallel.zero_stage", "1", "--data_parallel.shard", "2"), 2, cpu)
    assert zero == pytest.approx(28 * psi / 2 / 10e9 + rank_tensors(model, layers, True, True, flat=True) * 20e-6
                                 + clip * psi / 2)
    stages = [[0, 1], [2, 3]]
    pp = update(tiny("--model.n_layers", "4", "--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "2"), 2, cpu)
    model4 = dataclasses.replace(model, n_layers=4)
    assert pp == pytest.approx(max((28 / 10e9 + clip) * rank_parameters(model4, s, i == 0, i == 1, pipelined=True).total
                                   + rank_tensors(model4, s, i == 0, i == 1, pipelined=True) * 20e-6
                                   for i, s in enumerate(stages)))
    # defaults: the memory bandwidth, nothing per tensor
    assert update(tiny(), 2, h100) == pytest.approx(40 * psi / H100_STREAMED)
    # a parameter server's update: the summed pushes at memory bandwidth, AdamW at the optimizer rate
    from fivefold.plan.estimate import server_loads

    ps = tiny("--data_parallel.mode", "ps", "--parameter_server.servers", "1")  # 4 workers, 1 server
    found = estimate(ps, 5, cpu)
    (elements, tensors), = server_loads(model, 1, 4)
    assert elements == psi and tensors == rank_tensors(model, layers, True, True)
    assert found.time.optimizer == pytest.approx(4 * 4 * psi / H100_STREAMED + 28 * psi / 10e9 + tensors * 20e-6 + clip * psi)
    # two servers (3 workers): the slower server's update, each over its own elements and tensors
    two = estimate(tiny("--data_parallel.mode", "ps", "--parameter_server.servers", "2"), 5, cpu)
    assert two.time.optimizer == pytest.approx(max(3 * 4 * e / H100_STREAMED + 28 * e / 10e9 + n * 20e-6 + clip * e
                                                   for e, n in server_loads(model, 2, 3)))
    # asp: a server steps per push, unclipped; each worker clipped its own whole gradient before pushing; in the
    # steady state a worker waits for its own push, update and pull, or for the server's queue when that is longer
    # (4 pushes taken and stepped one after another): here the server is the bottleneck
    per_push = 4 * psi / H100_STREAMED + 28 * psi / 10e9 + tensors * 20e-6
    asp = estimate(tiny("--data_parallel.mode", "ps", "--parameter_server.sync", "asp"), 5, cpu).time
    assert asp.optimizer == pytest.approx(per_push)
    assert asp.total == pytest.approx(found.time.dp / 2 + 4 * per_push)
    assert asp.dp == pytest.approx(found.time.dp / 2 + 4 * per_push - asp.compute - asp.optimizer)
    assert asp.dp >= clip * psi + found.time.dp / 4
    # ssp with staleness 0 keeps the workers in lock step: everything one after another
    lock = estimate(tiny("--data_parallel.mode", "ps", "--parameter_server.sync", "ssp", "--parameter_server.staleness",
                         "0"), 5, cpu).time
    assert lock.optimizer == pytest.approx(4 * per_push) and lock.dp == pytest.approx(found.time.dp + clip * psi)
    path = tmp_path / "cpu.toml"
    path.write_text(cluster_toml(cpu))
    assert load_cluster(str(path)) == cpu
    posted = dataclasses.replace(cpu, accelerator=dataclasses.replace(cpu.accelerator, p2p_post_us=450.0, p2p_post_gbs=8.0))
    path.write_text(cluster_toml(posted))
    assert load_cluster(str(path)) == posted and posted.accelerator.post_seconds(8e6) == pytest.approx(450e-6 + 1e-3)
    data = json.loads(json.dumps(cpu.to_dict()))
    ringed = dataclasses.replace(cpu, accelerator=dataclasses.replace(cpu.accelerator, ring_step_operators=20.5))
    path.write_text(cluster_toml(ringed))
    assert load_cluster(str(path)) == ringed
    grouped = dataclasses.replace(cpu, accelerator=dataclasses.replace(cpu.accelerator, expert_group_us=74.5))
    path.write_text(cluster_toml(grouped))
    assert load_cluster(str(path)) == grouped
    for key in ("optimizer_gbs", "optimizer_tensor_us", "p2p_post_us", "p2p_post_gbs", "ring_step_operators",
                "expert_group_us"):
        for bad in (-1, "fast", float("inf"), float("nan"), True):
            broken = json.loads(json.dumps(data))
            broken["accelerator"][key] = bad
            with pytest.raises(ConfigError, match=f"accelerator.{key}"):
                cluster_from_dict(broken)
    data["accelerator"]["optimiser_gbs"] = 10
    with pytest.raises(ConfigError, match="unknown accelerator key.*optimiser_gbs"):
        cluster_from_dict(data)


def test_codec_rates_in_cluster_files(tmp_path):
    """accelerator.codec_ns / codec_encode_ns (bench comm's measured codec work) round-trip through the cluster file;
    without them a codec is priced by CODEC_BYTES at the memory bandwidth; bad tables name the key."""
    from fivefold.plan.cluster import CODEC_BYTES

    h100 = load_cluster("h100-sxm")
    assert h100.accelerator.codec_seconds("int8", 1e6, 4) == pytest.approx(
        (CODEC_BYTES["int8"][0] - CODEC_BYTES["int8"][1] * 3 / 4) * 1e6 / H100_STREAMED)
    assert h100.accelerator.codec_seconds("none", 1e6, 4) == 0.0
    cpu = dataclasses.replace(h100, accelerator=dataclasses.replace(
        h100.accelerator, codec_ns={"int8": 22.5, "topk": 16.0}, codec_encode_ns={"int8": 2.0}))
    assert cpu.accelerator.codec_seconds("int8", 1e6, 4) == pytest.approx((22.5 - 2.0 * 3 / 4) * 1e-3)
    assert cpu.accelerator.codec_seconds("topk", 1e6, 2) == pytest.approx(16e-3)
    assert cpu.accelerator.codec_seconds("sign", 1e6, 2) == h100.accelerator.codec_seconds("sign", 1e6, 2) > 0
    path = tmp_path / "cpu.toml"
    path.write_text(cluster_toml(cpu))
    assert load_cluster(str(path)) == cpu
    data = json.loads(json.dumps(cpu.to_dict()))
    for key, bad in (("codec_ns", {"int9": 1.0}), ("codec_ns", {"int8": -1.0}), ("codec_ns", 3.0),
                     ("codec_encode_ns", {"topk": "fast"}), ("codec_encode_ns", {"int8": 30.0})):
        broken = json.loads(json.dumps(data))
        broken["accelerator"][key] = bad
        with pytest.raises(ConfigError, match=f"accelerator.{key}"):
            cluster_from_dict(broken)


def test_sharding_degrees_are_chosen_by_predicted_time_under_the_memory_cap():
    """AMSP's scale-aware choice (plan/search.py choose_degrees): Llama-3 8B on 8 nodes of 8 H100s with 8 micro-
    batches. With room, the optimizer states sharded within a node and nothing else (1/1/8, 69.7 GiB) is fastest:
    no gathers, where each micro-batch's first gather of a pass and its last reduce-scatters cannot hide (the
    simulator, playing the runtime's calls, orders 1/1/8, 8/8/32, 8/8/64 the same way: 3.834, 3.835, 3.846 s);
    parameters and gradients sharded within a node and optimizer states over half or all of the 64 ranks follow
    within 0.5%, about twice as fast as ZeRO-3 over 64 (whose gathers and reduce-scatters cross nodes every
    micro-batch);
    under a 35 GiB cap the gradients spread over all 64 ranks while parameter gathers stay in the node (8/64/64),
    and under 34.05 GiB the parameters must span two nodes (16/64/64)."""
    from fivefold.plan.estimate import zero_degrees
    from fivefold.plan.search import choose_degrees, degree_options

    config = _config("--train.seq_len", "4096", "--train.grad_accum_steps", "8", "--data_parallel.shard", "64",
                     "--data_parallel.zero_stage", "3", "--data_parallel.param_dtype", "bf16")
    cluster = CLUSTERS["h100-sxm"]
    options = degree_options(config, 64, cluster, every_divisor=True)
    assert len(options) == 82  # 84 chains p | g | o | 64 (exponents 0 <= x <= y <= z <= 6), less 1/1/1 and 64/64/64

    def degrees(pair):
        return (lambda d: (d.params, d.grads, d.optim))(zero_degrees(pair[0], pair[1].degrees))

    roomy = choose_degrees(config, 64, cluster)
    times = {degrees(pair): pair[1].time.total for pair in roomy}
    assert degrees(roomy[0]) == (1, 1, 8) and max(times[(8, 8, 32)], times[(8, 8, 64)]) < 1.005 * times[(1, 1, 8)]
    assert times[(64, 64, 64)] > 1.8 * times[(8, 8, 64)]
    for cap, chosen in ((35, (8, 64, 64)), (34.05, (16, 64, 64))):
        tight = choose_degrees(config, 64, dataclasses.replace(cluster, accelerator=dataclasses.replace(
            cluster.accelerator, memory_gib=cap)))
        assert tight and all(found.memory.total <= cap * 2**30 for _, found in tight)
        fitting = [d for d, pair in zip(map(degrees, roomy), roomy) if pair[1].memory.total <= cap * 2**30]
        assert degrees(tight[0]) == fitting[0] == chosen  # the fastest of those under the cap


def test_search_tries_other_sharding_degrees_for_its_best_zero_layouts():
    config = _config("--model.preset", "llama3-8b", "--train.seq_len", "4096")
    result = search(config, 64, CLUSTERS["h100-sxm"], 512, offload=False, refine=10)
    assert result.degree_options > 0
    assert any(c.data_parallel.shard_optim for c, _ in result.ranked[:10])


def test_search_places_pipeline_stages_inside_data_parallelism_where_that_is_faster():
    """Two nodes of four joined by a slow link, 4,096-token sequences of a small model: the activations between
    stages outweigh the gradients, so the best pipelined layouts run faster with one pipeline's stages on
    neighbouring ranks (pipeline_parallel.placement = inner) than outermost; the search prices each of its best
    pipelined layouts both ways and ranks the twins by their times. Inside one node both price alike: no twin."""
    from fivefold.plan.cluster import LinkSpec
    from fivefold.plan.search import placement_options

    two_nodes = dataclasses.replace(CLUSTERS["h100-sxm"], accelerators_per_node=4, inter=LinkSpec(1.0, 10.0),
                                    collectives={})
    config = load_config("configs/tiny.toml", ["--train.seq_len", "4096", "--model.max_seq_len", "4096",
                                               "--model.n_layers", "8"])
    result = search(config, 8, two_nodes, 64, refine=20)
    assert result.placements > 0
    best, found = result.ranked[0]
    assert best.pipeline_parallel.placement == "inner" and found.degrees.dp > 1
    twin = dataclasses.replace(best, pipeline_parallel=dataclasses.replace(best.pipeline_parallel, placement="outer"))
    outer = next(e for c, e in result.ranked if c == twin)
    assert outer.time.pp_comm > 10 * found.time.pp_comm and outer.time.total > 1.2 * found.time.total
    assert found.time.dp > outer.time.dp  # the gradients now cross the slow link
    assert placement_options(best, 8, CLUSTERS["h100-sxm"]) == []  # eight per node: every placement alike
    assert placement_options(_config("--pipeline_parallel.degree", "2"), 2, two_nodes) == []  # dp 1
    pipelined = ("--pipeline_parallel.degree", "2", "--tensor_parallel.degree")
    assert placement_options(_config(*pipelined, "8"), 32, CLUSTERS["h100-sxm"]) == []  # tp fills a node: dp crosses
    assert [c.pipeline_parallel.placement for c in placement_options(_config(*pipelined, "2"), 32, CLUSTERS["h100-sxm"])] \
        == ["inner"]


def test_plan_sharding_degrees_prints_the_ranking_and_writes_the_winner(tmp_path, capsys):
    out = tmp_path / "best.toml"
    args = ["plan", "--model.preset", "llama3-8b", "--train.seq_len", "4096", "--train.dtype", "bf16",
            "--train.micro_batch_size", "1", "--train.grad_accum_steps", "8", "--data_parallel.zero_stage", "3",
            "--data_parallel.shard", "64", "--data_parallel.param_dtype", "bf16", "--gpus", "64",
            "--sharding-degrees", "--top", "3", "--write-best", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    winner = tuple(int(n) for n in printed.splitlines()[1].split()[1].split("/"))
    assert winner == (1, 1, 8)  # 8/8/32 and 8/8/64 within 0.5% of it (the test above)
    best = load_config(str(out)).data_parallel
    assert (best.shard_params, best.shard_grads, best.shard_optim) == winner
    ddp = ["plan", "--model.preset", "llama3-8b", "--gpus", "64", "--sharding-degrees"]
    assert main(ddp) == 2
    assert "set data_parallel.zero_stage to 1, 2 or 3" in capsys.readouterr().err


def test_a_posts_line_is_fitted_through_its_times():
    """comm/bench.py fit_post: the least-squares line through [bytes, us] (the accelerator's p2p_post_us and
    p2p_post_gbs); times that do not rise with the bytes give their mean and no per-byte part."""
    from fivefold.comm.bench import fit_post

    line = fit_post([[1e6, 300.0], [2e6, 400.0], [4e6, 600.0]])  # 200 us + 1 us per 10 KB: 10 GB/s
    assert line["p2p_post_us"] == pytest.approx(200.0) and line["p2p_post_gbs"] == pytest.approx(10.0)
    flat = fit_post([[1e6, 500.0], [2e6, 400.0]])
    assert flat["p2p_post_us"] == pytest.approx(450.0) and flat["p2p_post_gbs"] == 0.0
    accelerator = dataclasses.replace(CLUSTERS["h100-sxm"].accelerator, p2p_post_us=line["p2p_post_us"],
                                      p2p_post_gbs=line["p2p_post_gbs"])
    assert accelerator.post_seconds(3e6) == pytest.approx(500e-6)
    assert CLUSTERS["h100-sxm"].accelerator.post_seconds(1e9) == 0.0  # NCCL's kernels post: nothing on the host


def _autocast_saved(model, forward, region: bool = True) -> tuple[int, int]:
    """(bytes autograd keeps while `forward()` runs, under one CPU bf16 autocast region unless `region` is False, of
    which bf16 casts of the model's parameters)."""
    import contextlib

    import torch

    from fivefold.train.memory import saved_bytes_and_weight_casts

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if region else contextlib.nullcontext()
    with autocast:
        return saved_bytes_and_weight_casts(forward, model.parameters())


MLA_ARGS = ["--model.attention", "mla", "--model.n_kv_heads", "0", "--model.kv_lora_rank", "16", "--model.qk_nope_head_dim",
            "8", "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8"]


@pytest.mark.parametrize("variant", [[], ["--model.head_dim", "48"], ["--model.qk_norm", "head"],
                                     ["--model.qk_norm", "projection"], [*MLA_ARGS, "--model.q_lora_rank", "24"],
                                     [*MLA_ARGS, "--model.q_lora_rank", "0", "--model.v_head_dim", "12"]],
                         ids=["plain", "head_dim", "qk_head", "qk_proj", "mla", "mla_no_q_lora"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_block_under_bf16_autocast_keeps_what_the_planner_counts(recompute, variant):
    """Under bf16 autocast over fp32 weights a block keeps its RMSNorm tensors, the log-sum-exp and the RoPE tables
    in fp32, a bf16 cast of its input per matmul (q, k, v; w1, w3) and a bf16 copy of each weight it multiplies
    by: measured (CPU autocast, each storage once) equal to 2 bytes per counted element + 2 x
    `autocast_extra_elements` + the planner's weight copies for one block and one micro-batch (none under full
    recomputation, whose forward keeps only the fp32 block input), for an explicit head width and both q/k
    norms too (tensor and sequence parallelism: tests/distributed/test_activation_memory.py)."""
    import torch

    from fivefold.config import TensorParallelConfig
    from fivefold.model import build_model, materialize
    from fivefold.parallel.mesh import Mesh
    from fivefold.parallel.parallelize import apply_model_parallel
    from fivefold.plan.activations import ActivationShape, autocast_extra_elements, block_activation_elements
    from fivefold.plan.estimate import degrees_of, model_for, weight_copy_bytes

    config = load_config(None, ["--model.preset", "tiny", "--model.n_layers", "1", "--model.vocab_size", "257",
                                "--train.dtype", "bf16", "--train.recompute", recompute, *variant])
    model_config = model_for(config)
    model = materialize(build_model(model_config), "cpu", seed=0)
    apply_model_parallel(model, Mesh.single(), TensorParallelConfig(1, False), recompute=recompute)
    batch, seq = 2, 48
    x = torch.randn(batch, seq, model_config.dim).requires_grad_()
    positions = torch.arange(seq)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    kept, copies = _autocast_saved(model, lambda: model.layers["0"](x, cos, sin))
    shape = ActivationShape(batch, seq, 1, False, recompute)
    planned_copies = weight_copy_bytes(config, model_config, degrees_of(config, 1), {False: 1}, 1, False, 0)
    assert copies == planned_copies and (copies > 0) == (recompute != "full")
    assert kept == 2 * block_activation_elements(model_config, shape) + 2 * autocast_extra_elements(model_config, shape) \
        + planned_copies


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_moe_block_under_bf16_autocast_keeps_what_the_planner_counts(recompute, kernel):
    """A MoE block under bf16 autocast over fp32 weights keeps what the planner prices for it: 2 bytes per element of
    `moe_block_activation_elements` at the planner's balanced, dropless rows (`expert_rows`, which one process
    routes exactly), 2 x `moe_autocast_extra_elements`, and the weight copies of `weight_copy_bytes`, the routed
    experts' included under the loop kernel (its Linear layers are cast; the grouped kernel's stacks are
    activations). Routing options, tensor and expert parallelism: tests/distributed/test_activation_memory.py."""
    import torch

    from fivefold.config import TensorParallelConfig
    from fivefold.model import build_model, materialize
    from fivefold.model.moe import ExpertKernel
    from fivefold.parallel.mesh import Mesh
    from fivefold.parallel.parallelize import apply_model_parallel
    from fivefold.plan.activations import ActivationShape, moe_autocast_extra_elements, moe_block_activation_elements
    from fivefold.plan.estimate import degrees_of, expert_rows, model_for, weight_copy_bytes

    config = load_config(None, ["--model.preset", "tiny", "--model.n_layers", "1", "--model.vocab_size", "257",
                                "--model.n_experts", "4", "--model.moe_top_k", "2", "--model.moe_ffn_dim", "64",
                                "--model.moe_shared_experts", "1", "--expert_parallel.kernel", kernel,
                                "--train.dtype", "bf16", "--train.recompute", recompute, "--train.micro_batch_size", "2",
                                "--train.seq_len", "48"])
    model_config = model_for(config)
    model = materialize(build_model(model_config), "cpu", seed=0)
    apply_model_parallel(model, Mesh.single(), TensorParallelConfig(1, False), recompute=recompute)
    model.layers["0"].feed_forward.kernel = ExpertKernel(kernel)  # as the trainer sets it from expert_parallel.kernel
    batch, seq = 2, 48
    x = torch.randn(batch, seq, model_config.dim, generator=torch.Generator().manual_seed(0)).requires_grad_()
    positions = torch.arange(seq)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    kept, copies = _autocast_saved(model, lambda: model.layers["0"](x, cos, sin))
    d = degrees_of(config, 1)
    rows, shape = expert_rows(config, model_config, d), ActivationShape(batch, seq, 1, False, recompute)
    assert rows.kernel == kernel
    planned_copies = weight_copy_bytes(config, model_config, d, {True: 1}, 1, False, 0)
    assert copies == planned_copies and (copies > 0) == (recompute != "full")
    assert kept == 2 * moe_block_activation_elements(model_config, shape, rows) \
        + 2 * moe_autocast_extra_elements(model_config, shape, rows) + planned_copies


def test_autocast_keeps_one_bf16_weight_copy_per_region():
    """autocast's cache lasts one autocast region: k forwards in k regions whose backward has not run keep k bf16
    copies of the blocks' and the head's weights (`weight_copy_bytes` with k in flight), k forwards inside one
    region share one copy, which is why the pipeline executor runs a step's compute in one region
    (tests/distributed/test_pipeline_executor.py measures it there); ZeRO's bf16 compute weights need none."""
    import torch

    from fivefold.model import build_model, materialize
    from fivefold.plan.estimate import degrees_of, model_for, weight_copy_bytes

    config = load_config(None, ["--model.preset", "tiny", "--model.n_layers", "2", "--model.vocab_size", "257",
                                "--train.dtype", "bf16"])
    model_config = model_for(config)
    model = materialize(build_model(model_config), "cpu", seed=0)
    tokens = torch.randint(0, 257, (2, 32))
    d = degrees_of(config, 1)

    def forwards(k: int):
        def run():
            outputs = []  # kept until all k have run, as in-flight micro-batches are: a freed graph's bf16 copy
            for _ in range(k):  # could hand its storage (and so its address) to the next forward's copy
                with torch.autocast("cpu", dtype=torch.bfloat16):  # as parallel/step.py and the pipeline executor
                    outputs.append(model(tokens))
        return run

    for k in (1, 3):
        _, copies = _autocast_saved(model, forwards(k), region=False)
        assert copies == weight_copy_bytes(config, model_config, d, {False: 2}, k, True, k)
    _, shared = _autocast_saved(model, forwards(3))  # the three inside one region
    assert shared == weight_copy_bytes(config, model_config, d, {False: 2}, 1, True, 1)
    zero_bf16 = load_config(None, ["--model.preset", "tiny", "--train.dtype", "bf16", "--data_parallel.zero_stage", "1",
                                   "--data_parallel.shard", "2", "--data_parallel.param_dtype", "bf16"])
    assert weight_copy_bytes(zero_bf16, model_config, d, {False: 2}, 3, True, 3) == 0


def test_gradients_count_in_the_peak_only_where_they_can_reach_it():
    """One micro-batch on one stage: the peak is the loss's backward, before any gradient exists (measured on an
    H200: 1B and 3B steps within 0.1 GiB of the total without them, docs/planner.md); with gradient
    accumulation the first micro-batch's gradients are there (+ their size, measured), and pipelines and ZeRO
    keep them in the total (an upper bound)."""
    base = ["--model.preset", "llama3.2-1b", "--train.seq_len", "2048", "--train.micro_batch_size", "4",
            "--train.dtype", "bf16"]
    h200 = CLUSTERS["h200"]
    one = estimate(load_config(None, base), 1, h200).memory
    assert one.gradients_after_peak and one.gradients > 0
    assert one.total == (one.parameters + one.optimizer + one.activations + one.logits + one.buffers + one.buckets
                         + one.weight_copies)
    for extra in (["--train.compile", "true"], ["--train.loss_chunk_tokens", "4096"]):
        assert estimate(load_config(None, [*base, *extra]), 1, h200).memory.gradients_after_peak, extra
    for extra in (["--train.grad_accum_steps", "2"], ["--data_parallel.zero_stage", "1", "--data_parallel.shard", "2"],
                  ["--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "2"]):
        memory = estimate(load_config(None, [*base, *extra]), 2 if "2" in extra[-1:] else 1, h200).memory
        assert not memory.gradients_after_peak, extra
        assert memory.total == memory.model_states + memory.activations + memory.logits + memory.buffers \
            + memory.buckets + memory.weight_copies
    accumulated = estimate(load_config(None, [*base, "--train.grad_accum_steps", "2"]), 1, h200).memory
    assert accumulated.total - one.total == one.gradients
    assert one.backward_climb == 0  # the 1B model's logits outweigh every gradient its backward makes


def test_a_backward_whose_gradients_outgrow_the_logits_climbs_above_the_loss_peak():
    """Under full recomputation a MoE model of few wide layers (Qwen3-30B-A3B's on 4 layers) makes more gradient
    bytes than its logits and activations free: the peak is in the blocks' backward, between the states with
    every gradient (the end of backward) and the upper bound that adds the loss's backward to them. On an H200 the
    measured peak was 46.59 GiB: 46.41 with every gradient, 47.82 planned (docs/planner.md)."""
    shape = ["--model.preset", "qwen3-30b-a3b", "--model.n_layers", "4", "--train.seq_len", "2048",
             "--train.micro_batch_size", "2", "--train.dtype", "bf16"]
    h200 = CLUSTERS["h200"]
    full = estimate(load_config(None, [*shape, "--train.recompute", "full"]), 1, h200).memory
    assert full.gradients_after_peak and 0 < full.backward_climb < full.gradients
    loss_peak = full.parameters + full.optimizer + full.activations + full.logits + full.weight_copies
    assert full.total == loss_peak + full.backward_climb
    assert full.model_states < full.total < full.model_states + full.activations + full.logits + full.weight_copies
    assert full.total / 2**30 == pytest.approx(47.82, abs=0.01)
    # without recomputation the blocks keep their activations until their backward frees them: no climb
    kept = estimate(load_config(None, shape), 1, h200).memory
    assert kept.gradients_after_peak and kept.backward_climb == 0
    # a 2-layer model's backward ends below the loss's peak; one more layer of gradients raises the climb by a
    # layer's gradients (each layer's recomputed block and kept input alike)
    two, three = (estimate(load_config(None, [*shape, "--train.recompute", "full", "--model.n_layers", str(n)]), 1,
                           h200).memory for n in (6, 7))
    layer = (three.gradients - two.gradients)
    assert three.backward_climb - two.backward_climb == pytest.approx(layer - (three.activations - two.activations)
                                                                      - (three.weight_copies - two.weight_copies), abs=2)
