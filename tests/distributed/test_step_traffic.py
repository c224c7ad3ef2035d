"""The simulator's step workload is the traffic the runtime really sends, layout by layout.

Every rank builds the real Trainer, takes a step, then takes one more with its torch.distributed
calls recorded (sim/observe.py): each collective as (kind, the group's ranks, bytes) and each
point-to-point send as (sender, receiver, bytes). The simulator builds the same config's workload
(sim/workload.py, fidelity flow) and logs its calls the same way; per rank the two multisets must
be equal. This covers DDP's buckets (backend and hand-written all-reduce, in which case every
message of the algorithm is compared, and the int8, sign, top-k and PowerSGD codecs' exchanges), ZeRO-1/2/3 (one collective per flat group, tensor-parallel cut too), hybrid sharding and independent P/G/OS degrees (AMSP, MiCS), tensor parallelism with and
without sequence parallelism (blocks, vocab-parallel embedding, head and loss, the norms' summed
gradients, the attention's other all-reduces: q/k norms per head and per projection, replicated key/value heads'
weights and biases, multi-latent attention's down-projections), the pipeline schedules' activations and gradients (whole, or scattered over tp and all-gathered; stages outermost or
inside data parallelism), a tied
embedding's gradient summed over the first and last stages, ring, Ulysses and 2D context
parallelism, recomputation, collective matmuls (tensor_parallel.comm_overlap), ZeRO++ (quantised gathers, hpZ's in-node backward gathers, qgZ's two levels
of all-to-alls) and mixture-of-experts layers (expert and expert-tensor parallelism's all-to-alls, the
experts' own DDP buckets and ZeRO groups over their expert-data-parallel group, EPLB's replicated experts
(their extra slots, and each replica's gradient summed over its holders), the router's and
shared experts' gradient sums under sequence parallelism, the switch loss's routing statistics). A
routed all-to-all's size is the router's choice, so for those the calls are compared by count and
the sizes by their sum over the ranks (every row sent is received: it is k rows per token under any
routing). For the layouts whose every byte goes point to point (pipelines,
hand-written all-reduce) the bytes per ordered rank pair the engine counts while playing the
programs equal the runtime's. The only calls left out are those of <= 64 bytes: the trainer's
scalars (loss, token count, gradient norm, the guard's flags), which the simulator does not model.
"""

from __future__ import annotations

from collections import Counter

import pytest

from distributed.spawn import run_distributed
from parity.harness import EXPERT_LOAD, with_changes, with_expert_load

SCALARS = 64  # bytes: calls this small are the trainer's bookkeeping
MOE = {"n_experts": 4, "moe_top_k": 2}

LAYOUTS = {
    2: {
        "dp2": {},
        "dp2-ring-small-buckets": dict(gradient_comm={"allreduce_algorithm": "ring", "bucket_mb": 0.05}),
        "dp2-halving-doubling-accum2": dict(gradient_comm={"allreduce_algorithm": "halving_doubling"},
                                            train={"grad_accum_steps": 2}),
        "tp2-sp": dict(tensor_parallel={"degree": 2, "sequence_parallel": True}),
        "tp2-sp-overlap-full-recompute": dict(tensor_parallel={"degree": 2, "sequence_parallel": True,
                                                               "comm_overlap": True}, train={"recompute": "full"}),
        "tp2-full-recompute": dict(tensor_parallel={"degree": 2}, train={"recompute": "full"}),
        "pp2-1f1b": dict(pipeline_parallel={"degree": 2}, train={"grad_accum_steps": 2}),
        "pp2-zb-h1": dict(pipeline_parallel={"degree": 2, "schedule": "zb-h1"}, train={"grad_accum_steps": 2}),
        "pp2-tied-embedding": dict(model={"tie_embeddings": True}, pipeline_parallel={"degree": 2},
                                   train={"grad_accum_steps": 2}),
        "dp2-int8-small-buckets": dict(gradient_comm={"compression": "int8", "bucket_mb": 0.5}),
        "dp2-sign-block-64": dict(gradient_comm={"compression": "sign", "compression_block": 64}),
        "dp2-topk": dict(gradient_comm={"compression": "topk", "topk_ratio": 0.05}),
        "dp2-powersgd-ring-small-buckets": dict(gradient_comm={"compression": "powersgd", "powersgd_rank": 2,
                                                               "allreduce_algorithm": "ring", "bucket_mb": 0.5}),
        "moe-dp2-powersgd": dict(model=MOE, gradient_comm={"compression": "powersgd"}),
        "dp2-zero1": dict(data_parallel={"zero_stage": 1, "shard": 2}),
        "dp2-zero2-accum2": dict(data_parallel={"zero_stage": 1, "shard": 2}, train={"grad_accum_steps": 2}),
        "dp2-zero3": dict(data_parallel={"zero_stage": 3, "shard": 2}),
        "cp2-ring": dict(context_parallel={"degree": 2}),
        "tp2-qk-head": dict(model={"qk_norm": "head", "head_dim": 24}, tensor_parallel={"degree": 2}),
        "tp2-sp-qk-projection-full-recompute": dict(model={"qk_norm": "projection"}, train={"recompute": "full"},
                                                    tensor_parallel={"degree": 2, "sequence_parallel": True}),
        "tp2-mla": dict(model={"attention": "mla", "n_kv_heads": 0, "kv_lora_rank": 16, "q_lora_rank": 24,
                               "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
                        tensor_parallel={"degree": 2}),
        "cp2-tp1-qk-projection-selective": dict(model={"qk_norm": "projection"}, context_parallel={"degree": 2},
                                                train={"recompute": "selective"}),
        "cp2-ulysses": dict(context_parallel={"degree": 2, "method": "ulysses"}),
        "moe-ep2": dict(model=MOE, expert_parallel={"degree": 2}),
        "moe-ep2-no-positions": dict(model=MOE, expert_parallel={"degree": 2}, logging={"moe_load_by_rank": False}),
        "moe-ep2-eplb": dict(model=MOE, expert_parallel={"degree": 2, "replicas": 1, "load_from": EXPERT_LOAD}),
        "moe-dp2-zero2-accum2": dict(model=MOE, data_parallel={"zero_stage": 1, "shard": 2}, train={"grad_accum_steps": 2}),
    },
    4: {
        "dp2-tp2": dict(tensor_parallel={"degree": 2}),
        "dp2-tp2-powersgd": dict(tensor_parallel={"degree": 2}, gradient_comm={"compression": "powersgd"}),
        "pp2-dp2-int8": dict(pipeline_parallel={"degree": 2}, gradient_comm={"compression": "int8"},
                             train={"grad_accum_steps": 2}),
        "pp2-dp2-interleaved": dict(pipeline_parallel={"degree": 2, "schedule": "interleaved", "virtual": 2},
                                    model={"n_layers": 4}, train={"grad_accum_steps": 2}),
        "hsdp-2x2-zero3": dict(data_parallel={"zero_stage": 3, "shard": 2, "replicate": 2}),
        "dp2-tp2-zero3-biases": dict(model={"attention_bias": "all", "mlp_bias": True},
                                     tensor_parallel={"degree": 2}, data_parallel={"zero_stage": 3, "shard": 2}),
        "amsp-1-2-4-accum2": dict(data_parallel={"zero_stage": 1, "shard": 4, "shard_grads": 2},
                                  train={"grad_accum_steps": 2}),
        "amsp-2-4-4": dict(data_parallel={"zero_stage": 2, "shard": 4, "shard_params": 2}),
        "mics-2-2-2": dict(data_parallel={"zero_stage": 3, "shard": 4, "shard_optim": 2}),
        "tp4-sp-overlap": dict(tensor_parallel={"degree": 4, "sequence_parallel": True, "comm_overlap": True},
                               model={"n_kv_heads": 4}),
        "tp2-pp2-sp-overlap-zb-h1": dict(tensor_parallel={"degree": 2, "sequence_parallel": True, "comm_overlap": True},
                                         pipeline_parallel={"degree": 2, "schedule": "zb-h1"}, train={"grad_accum_steps": 2}),
        "tp2-pp2-tied-embedding": dict(model={"tie_embeddings": True}, tensor_parallel={"degree": 2},
                                       pipeline_parallel={"degree": 2}, train={"grad_accum_steps": 2}),
        "pp2-dp2-tied-embedding": dict(model={"tie_embeddings": True}, pipeline_parallel={"degree": 2},
                                       gradient_comm={"bucket_mb": 0.05}, train={"grad_accum_steps": 2}),
        "pp2-dp2-zero1-tied-embedding": dict(model={"tie_embeddings": True}, pipeline_parallel={"degree": 2},
                                             data_parallel={"zero_stage": 1, "shard": 2}, train={"grad_accum_steps": 2}),
        "pp2-dp2-zero1-tied-embedding-inner": dict(model={"tie_embeddings": True},
                                                   pipeline_parallel={"degree": 2, "placement": "inner"},
                                                   data_parallel={"zero_stage": 1, "shard": 2}, train={"grad_accum_steps": 2}),
        "tp2-pp2-sp": dict(tensor_parallel={"degree": 2, "sequence_parallel": True}, pipeline_parallel={"degree": 2},
                           train={"grad_accum_steps": 2}),
        "tp2-pp2-scatter-gather-interleaved": dict(tensor_parallel={"degree": 2},
                                                   pipeline_parallel={"degree": 2, "schedule": "interleaved", "virtual": 2,
                                                                      "scatter_gather": True},
                                                   model={"n_layers": 4}, train={"grad_accum_steps": 2}),
        "cp2-tp2": dict(context_parallel={"degree": 2}, tensor_parallel={"degree": 2}),
        "tp4-qk-projection-replicated-kv-biases": dict(model={"qk_norm": "projection", "head_dim": 24, "attention_bias": "qkv"},
                                                       tensor_parallel={"degree": 4}),
        "cp2-tp2-qk-projection-selective": dict(model={"qk_norm": "projection"}, context_parallel={"degree": 2},
                                                tensor_parallel={"degree": 2}, train={"recompute": "selective"}),
        "cp4-ulysses-selective": dict(context_parallel={"degree": 4, "method": "ulysses"},
                                      model={"n_heads": 4, "n_kv_heads": 4}, train={"recompute": "selective"}),
        "cp4-2d": dict(context_parallel={"degree": 4, "method": "2d", "heads": 2}),
        "cp4-double-ring-2x2": dict(context_parallel={"degree": 4, "inner_ring": 2}),
        "cp4-2d-context-first-outer": dict(context_parallel={"degree": 4, "method": "2d", "heads": 2,
                                                             "placement": "context-first", "inner_ring": 1}),
        "pp4-gpipe": dict(pipeline_parallel={"degree": 4, "schedule": "gpipe"}, model={"n_layers": 4},
                          train={"grad_accum_steps": 4}),
        "dp2-cp2-zero1-selective": dict(context_parallel={"degree": 2}, data_parallel={"zero_stage": 1, "shard": 2},
                                        train={"recompute": "selective"}),
        "zero3-pp-2-nodes-accum2": dict(data_parallel={"zero_stage": 3, "shard": 4, "quantized_weights": True,
                                                       "hpz_partition": 2, "quantized_gradients": "int4"},
                                        gradient_comm={"node_size": 2}, train={"grad_accum_steps": 2}),
        "moe-ep2-etp2-full-recompute": dict(model=MOE, expert_parallel={"degree": 2, "tensor": 2},
                                            train={"recompute": "full"}),
        "moe-tp2-sp-ep2-shared-switch": dict(model={**MOE, "moe_shared_experts": 1, "moe_aux_loss": "switch"},
                                             tensor_parallel={"degree": 2, "sequence_parallel": True},
                                             expert_parallel={"degree": 2}),
        "moe-ep2-zero3": dict(model=MOE, expert_parallel={"degree": 2}, data_parallel={"zero_stage": 3, "shard": 4}),
        "moe-dp2-ep2-eplb": dict(model=MOE, expert_parallel={"degree": 2, "replicas": 1, "load_from": EXPERT_LOAD}),
        "moe-pp2-ep2-zb-h1": dict(model={**MOE, "n_layers": 4}, expert_parallel={"degree": 2},
                                  pipeline_parallel={"degree": 2, "schedule": "zb-h1"}, train={"grad_accum_steps": 2}),
    },
}


def _routed(calls: Counter, total: int) -> tuple[Counter, int]:
    """The calls with each all-to-all's size set aside (MoE layouts have no other all-to-alls), and the running
    sum of those sizes: under uneven routing a rank's rows differ from the balanced ones the simulator assumes,
    but all ranks' rows of a step add up to k rows per token either way."""
    out = Counter()
    for (kind, members, nbytes), n in calls.items():
        if kind == "all_to_all":
            out[(kind, members, "rows")] += n
            total += nbytes * n
        else:
            out[(kind, members, nbytes)] += n
    return out, total


def _record(rank, world_size, configs):
    from fivefold.sim.observe import recording_traffic
    from fivefold.train.trainer import Trainer

    out = []
    for config in configs:
        trainer = Trainer(config)
        trainer.train_step()  # the first step builds what later steps reuse
        calls: list = []
        with recording_traffic(calls):
            trainer.train_step()
        trainer.close()
        out.append(calls)
    return out


def _configs(job, tmp_path, layouts):
    return [with_expert_load(with_changes(job, checkpoint={"enabled": False}, model=changes.get("model", {}),
                                          train={"eval_every": 0, "micro_batch_size": 2, "output_dir": str(tmp_path / name),
                                                 **changes.get("train", {})},
                                          **{k: v for k, v in changes.items() if k not in ("train", "model")}),
                             tmp_path / name / "load")
            for name, changes in layouts.items()]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_simulated_step_sends_what_the_runtime_sends(job, tmp_path, world_size):
    from fivefold.plan.cluster import PRESETS
    from fivefold.sim.step import simulate_step
    from fivefold.sim.workload import build_workload

    checked_pairs = []
    layouts = LAYOUTS[world_size]
    configs = _configs(job, tmp_path, layouts)
    recorded = run_distributed(_record, world_size, configs, timeout=600)
    for index, name in enumerate(layouts):
        workload = build_workload(configs[index], world_size, PRESETS["h100-sxm"], fidelity="flow")
        routed = {"runtime": 0, "simulated": 0}
        for rank in range(world_size):
            runtime = Counter(call for call in recorded[rank][index] if call[2] > SCALARS)
            simulated = Counter(call for call in workload.calls(rank) if call[2] > SCALARS)
            assert runtime, f"{name}: rank {rank} recorded nothing"
            if name.startswith("moe"):  # rows routed to experts: as many calls, their sizes the router's choice
                runtime, routed["runtime"] = _routed(runtime, routed["runtime"])
                simulated, routed["simulated"] = _routed(simulated, routed["simulated"])
            assert simulated == runtime, (f"{name} rank {rank}: only the runtime {dict(runtime - simulated)}, "
                                          f"only the simulator {dict(simulated - runtime)}")
        assert routed["runtime"] == routed["simulated"], name  # every row sent is received: the sums are routing's own
        if all(kind == "send" for rank_calls in recorded for kind, _, nbytes in rank_calls[index] if nbytes > SCALARS):
            # every byte went point to point (no backend collective): the engine's per-pair bytes, from playing
            # the programs over the network, must be the runtime's
            run = simulate_step(configs[index], world_size, PRESETS["h100-sxm"], fidelity="flow", record_spans=False)
            runtime_pairs = Counter()
            for rank_calls in recorded:
                for kind, pair, nbytes in rank_calls[index]:
                    if nbytes > SCALARS:
                        runtime_pairs[pair] += nbytes
            assert run.result.pair_bytes == dict(runtime_pairs), name
            checked_pairs.append(name)
    assert checked_pairs, "no layout sent only point to point"


UNEVEN = {
    2: {"moe-ep2-pairwise": dict(model=MOE, expert_parallel={"degree": 2, "alltoall": "pairwise"}),
        "moe-ep2-eplb-pairwise": dict(model=MOE, expert_parallel={"degree": 2, "alltoall": "pairwise", "replicas": 1,
                                                                  "load_from": EXPERT_LOAD})},
    4: {"moe-ep4-pairwise-switch": dict(model={**MOE, "moe_aux_loss": "switch"},
                                        expert_parallel={"degree": 4, "alltoall": "pairwise"}),
        "moe-ep4-eplb-pairwise": dict(model=MOE, expert_parallel={"degree": 4, "alltoall": "pairwise", "replicas": 1,
                                                                  "load_from": EXPERT_LOAD})},
}


def _record_routing(rank, world_size, configs):
    """_record, and the recorded step's metrics (a logged step: its moe_load_by_ep_rank)."""
    from fivefold.sim.observe import recording_traffic
    from fivefold.train.trainer import Trainer

    out = []
    for config in configs:
        trainer = Trainer(config)
        trainer.train_step()
        calls: list = []
        with recording_traffic(calls):
            metrics = trainer.train_step()
        trainer.close()
        out.append((calls, metrics))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_routing_a_step_recorded_replays_as_the_messages_it_sent(job, tmp_path, world_size):
    """Per-rank routing (`--expert-load`, plan/expert_load.py) checked against a running MoE job byte for byte: the
    expert dispatch goes point to point (expert_parallel.alltoall = pairwise, one expert-parallel group), the step
    is logged, and the simulator, given that step's moe_load_by_ep_rank (each position's assignments per expert),
    sends every message the runtime sent, each pair's rows out and home, with every other call as before.
    Balanced routing (the simulator's default) misses those messages, and so does the step's mean load
    (moe_load) where the ranks routed differently."""
    from fivefold.plan.cluster import PRESETS
    from fivefold.sim.workload import build_workload

    layouts = UNEVEN[world_size]
    configs = [with_changes(c, train={"log_every": 1, "grad_accum_steps": 1})
               for c in _configs(job, tmp_path, layouts)]
    recorded = run_distributed(_record_routing, world_size, configs, timeout=600)
    for index, name in enumerate(layouts):
        metrics = recorded[0][index][1]
        positions = metrics["moe_load_by_ep_rank"]
        for layer, table in positions.items():  # the positions' loads add up to the step's load
            assert len(table) == world_size and [sum(c) for c in zip(*table)] == metrics["moe_load"][layer], name
        assert any(table[0] != table[1] for table in positions.values()), f"{name}: the ranks routed alike"
        replayed = build_workload(configs[index], world_size, PRESETS["h100-sxm"], fidelity="flow",
                                  expert_load=positions)
        balanced = build_workload(configs[index], world_size, PRESETS["h100-sxm"], fidelity="flow")
        mean = build_workload(configs[index], world_size, PRESETS["h100-sxm"], fidelity="flow",
                              expert_load=metrics["moe_load"])
        misses = Counter()
        for rank in range(world_size):
            runtime = Counter(call for call in recorded[rank][index][0] if call[2] > SCALARS)
            simulated = Counter(call for call in replayed.calls(rank) if call[2] > SCALARS)
            assert any(kind == "send" for kind, _, _ in runtime), f"{name}: no point-to-point dispatch recorded"
            assert simulated == runtime, (f"{name} rank {rank}: only the runtime {dict(runtime - simulated)}, "
                                          f"only the simulator {dict(simulated - runtime)}")
            for other, work in (("balanced", balanced), ("mean", mean)):
                misses[other] += Counter(call for call in work.calls(rank) if call[2] > SCALARS) != runtime
        assert misses["balanced"] and misses["mean"], f"{name}: {dict(misses)} (the check could not fail)"
