"""The planner's parameters and model-state bytes per rank equal the runtime's, layout by layout.

For each layout, every rank builds the real Trainer and takes one step; the planner (plan/estimate.py,
from the same JobConfig and nothing else) must give, for that rank's pipeline position, exactly the Ψ
the runtime's modules hold (`Parallelized.parameters`) and exactly the model-state bytes of the
runtime's own ZeRO formula on that Ψ, and as many tensors as the runtime's AdamW updates (parameter
tensors; ZeRO's flat groups) for the optimizer's cost per tensor; the measured bytes equal them up to ZeRO's padding (< N
elements of <= 16 bytes per flat group). Layouts cover tensor (GQA split and replicated, biases,
q/k projection norms, sequence parallel), pipeline (1F1B, interleaved, tied head, 4 stages),
context, ZeRO 1/2/3 (mixed precision), expert parallelism with ZeRO over EDP and with EPLB's replicated experts
(a spare slot per rank), DDP with the priority schedule (whose gradients wait in its buckets between steps), and MLA. DDP's flat
gradient buckets (the layouts without ZeRO), with what a compression codec keeps between steps (sign, top-k and
PowerSGD error feedback, PowerSGD's Q), are planned equal to the bytes the runtime allocates.
The peak of the bytes autograd keeps for backward over a whole step (train/memory.py PeakSavedBytes;
ZeRO-3's gathered weights, which matmuls save as views, are its buffers and are left out) equals the
planner's activations to the byte on ranks without the head (the blocks of every stage times the
micro-batches in flight, their shared RoPE tables once per stage, the first stage's token ids, Ulysses' head-layout
copies, and under full recomputation the one block recomputed at a time, fp32 and bf16 autocast, with the bf16
weight copies autocast keeps), within 1% on MoE layouts (the
test's routing is not the balanced one the planner prices), and on the head's rank lies between them
and them plus the logits term, on every layout: ZeRO-3, MLA and MoE included.
"""

import pytest

from fivefold.train.trainer import Trainer

from distributed.spawn import run_distributed
from parity.harness import EXPERT_LOAD, with_changes, with_expert_load

MOE = {"n_experts": 4, "moe_top_k": 2, "moe_ffn_dim": 32, "moe_shared_experts": 1}
MLA = {"attention": "mla", "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
LAYOUTS = {  # name -> sections changed from the micro job (4 ranks)
    "tp2-dp2-zero1": dict(tensor_parallel={"degree": 2}, data_parallel={"zero_stage": 1, "shard": 2}),
    "tp4-kv-replicated": dict(tensor_parallel={"degree": 4}),
    "tp2-bias": dict(tensor_parallel={"degree": 2}, model={"attention_bias": "all", "mlp_bias": True}),
    "tp2sp-dp2-zero3-bf16": dict(tensor_parallel={"degree": 2, "sequence_parallel": True},
                                 data_parallel={"zero_stage": 3, "shard": 2, "param_dtype": "bf16"}),
    "tp2-qk-projection-norm": dict(tensor_parallel={"degree": 2}, model={"qk_norm": "projection"}),
    "pp2-tp2-tied": dict(pipeline_parallel={"degree": 2}, tensor_parallel={"degree": 2}, model={"tie_embeddings": True},
                         train={"grad_accum_steps": 2}),
    "pp2-dp2-interleaved": dict(pipeline_parallel={"degree": 2, "schedule": "interleaved", "virtual": 2},
                                model={"n_layers": 4}, train={"grad_accum_steps": 2}),
    "pp4-uneven": dict(pipeline_parallel={"degree": 4, "layers_per_stage": [2, 1, 1, 1]}, model={"n_layers": 5},
                       train={"grad_accum_steps": 4}),
    "cp2-dp2-zero2": dict(context_parallel={"degree": 2}, data_parallel={"zero_stage": 2, "shard": 2}),
    "ep2-zero3-edp2": dict(model=MOE, expert_parallel={"degree": 2}, data_parallel={"zero_stage": 3, "shard": 4}),
    "mla-tp2-dp2": dict(model=MLA, tensor_parallel={"degree": 2}),
    "mla-pp2-dp2": dict(model={**MLA, "q_lora_rank": 0}, pipeline_parallel={"degree": 2}, train={"grad_accum_steps": 2}),
    "ddp4": dict(),
    "ddp4-bf16-reduce": dict(gradient_comm={"reduce_dtype": "bf16", "bucket_mb": 0.01}),
    "ddp4-priority": dict(gradient_comm={"schedule": "priority", "bucket_mb": 0.02, "slice_mb": 0.005},
                          train={"max_grad_norm": 0.0}),
    "ddp4-sign": dict(gradient_comm={"compression": "sign"}),
    "ddp4-topk": dict(gradient_comm={"compression": "topk"}),
    "tp2-dp2-powersgd": dict(tensor_parallel={"degree": 2}, gradient_comm={"compression": "powersgd", "powersgd_rank": 2}),
    "ep2-dp-powersgd": dict(model=MOE, expert_parallel={"degree": 2}, gradient_comm={"compression": "powersgd"}),
    "dp4-zero1": dict(data_parallel={"zero_stage": 1, "shard": 4}),
    "dp4-zero1-bf16": dict(data_parallel={"zero_stage": 1, "shard": 4, "param_dtype": "bf16"}),
    "dp4-zero2": dict(data_parallel={"zero_stage": 2, "shard": 4}),
    "dp4-zero3": dict(data_parallel={"zero_stage": 3, "shard": 4}),
    "dp4-zero3-offload": dict(data_parallel={"zero_stage": 3, "shard": 4, "param_dtype": "bf16", "offload": True}),
    "hsdp-2x2-zero3": dict(data_parallel={"zero_stage": 3, "shard": 2, "replicate": 2}),
    "pp2-gpipe-dp2-zero1": dict(pipeline_parallel={"degree": 2, "schedule": "gpipe"}, train={"grad_accum_steps": 2},
                                data_parallel={"zero_stage": 1, "shard": 2}),
    "pp2-zbh1-tp2": dict(pipeline_parallel={"degree": 2, "schedule": "zb-h1"}, tensor_parallel={"degree": 2},
                         train={"grad_accum_steps": 2}),
    "pp4-tied": dict(pipeline_parallel={"degree": 4}, model={"n_layers": 4, "tie_embeddings": True},
                     train={"grad_accum_steps": 4}),
    "cp2-tp2": dict(context_parallel={"degree": 2}, tensor_parallel={"degree": 2}),
    "cp4-ulysses": dict(context_parallel={"degree": 4, "method": "ulysses"}, model={"n_heads": 4, "n_kv_heads": 4}),
    "cp4-2d": dict(context_parallel={"degree": 4, "method": "2d", "heads": 2}),
    "cp2-dp2-zero3": dict(context_parallel={"degree": 2}, data_parallel={"zero_stage": 3, "shard": 2}),
    "ep4-ddp": dict(model=MOE, expert_parallel={"degree": 4}),
    "ep2-eplb-ddp": dict(model=MOE, expert_parallel={"degree": 2, "replicas": 1, "load_from": EXPERT_LOAD}),
    "ep2-etp2-ddp": dict(model=MOE, expert_parallel={"degree": 2, "tensor": 2}),
    "ep2-tp2sp": dict(model=MOE, expert_parallel={"degree": 2}, tensor_parallel={"degree": 2, "sequence_parallel": True}),
    "ep2-pp2": dict(model={**MOE, "n_layers": 4}, expert_parallel={"degree": 2}, pipeline_parallel={"degree": 2},
                    train={"grad_accum_steps": 2}),
    "moe-first-dense-ep2": dict(model={**MOE, "n_layers": 3, "moe_first_dense": 1}, expert_parallel={"degree": 2}),
    "pp4-full": dict(pipeline_parallel={"degree": 4}, model={"n_layers": 5}, train={"grad_accum_steps": 4, "recompute": "full"}),
    "pp2-tp2sp-full": dict(pipeline_parallel={"degree": 2}, tensor_parallel={"degree": 2, "sequence_parallel": True},
                           train={"grad_accum_steps": 2, "recompute": "full"}),
    "cp2-pp2-full": dict(context_parallel={"degree": 2}, pipeline_parallel={"degree": 2},
                         train={"grad_accum_steps": 2, "recompute": "full"}),
    "cp2-pp2-ring-bf16": dict(context_parallel={"degree": 2}, pipeline_parallel={"degree": 2},
                              train={"grad_accum_steps": 2, "dtype": "bf16"}),
    "cp2-pp2-ulysses-mqa": dict(context_parallel={"degree": 2, "method": "ulysses"}, pipeline_parallel={"degree": 2},
                                model={"n_kv_heads": 1}, train={"grad_accum_steps": 2}),
    "cp2-pp2-ulysses-full-bf16": dict(context_parallel={"degree": 2, "method": "ulysses"}, pipeline_parallel={"degree": 2},
                                      train={"grad_accum_steps": 2, "recompute": "full", "dtype": "bf16"}),
    "pp2-full-bf16": dict(pipeline_parallel={"degree": 2}, train={"grad_accum_steps": 2, "recompute": "full", "dtype": "bf16"}),
}


def _measure(rank, world_size, configs):
    from fivefold.plan.cluster import PRESETS
    from fivefold.plan.estimate import estimate
    from fivefold.plan.parameters import rank_tensors
    from fivefold.train.memory import PeakSavedBytes

    out = []
    for config in configs:
        trainer = Trainer(config)
        trainer.train_step()
        zero = [z for z in getattr(trainer.sync, "zeros", [getattr(trainer.sync, "zero", None)]) if z is not None]
        groups = sum(len(z.groups) for z in zero)
        planned = estimate(config, world_size, PRESETS["h100-sxm"], vocab_size=trainer.model_config.vocab_size)
        mine = planned.per_pp_rank[trainer.mesh.local_rank("pp")]
        def gathered(tensor) -> bool:  # ZeRO-3's buffers, not activations
            return any(z.holds_gathered(tensor) for z in zero)

        with PeakSavedBytes(trainer.model.parameters(), gathered) as saved:  # a second step: the activations at their peak
            trainer.train_step()
        ddps = [getattr(trainer.sync, name, None) for name in ("ddp", "expert_ddp")]
        buckets = sum(ddp.gradient_bytes() + ddp.codec_bytes() for ddp in ddps if ddp is not None)
        pp, position = config.pipeline_parallel.degree, trainer.mesh.local_rank("pp")
        split = trainer.parallel.stage_split or [tuple(range(trainer.model_config.n_layers))]
        layers = [layer for s in range(position, len(split), pp) for layer in split[s]]
        tensors = (rank_tensors(trainer.model_config, layers, position == 0, (len(split) - 1) % pp == position,
                                config.expert_parallel.degree, pipelined=pp > 1, flat=bool(zero),
                                replicas=config.expert_parallel.replicas),
                   sum(len(group["params"]) for group in trainer.optimizer.param_groups))
        out.append((trainer.parallel.parameters, mine.parameter_count,
                    tuple(trainer.report.expected_model_states().__dict__.values()),
                    (mine.parameters, mine.gradients, mine.optimizer + mine.host),
                    tuple(trainer.report.model_state_bytes.__dict__.values()), groups, (mine.buckets, buckets),
                    (saved.peak, mine.activations + mine.weight_copies, mine.logits), tensors))
        trainer.close()  # its gloo groups' threads and sockets: 45 layouts' worth would pile up otherwise
    return out


@pytest.mark.slow
def test_planner_model_states_equal_the_runtime(job, tmp_path):
    configs = [with_expert_load(with_changes(job, checkpoint={"enabled": False},
                                             train={"eval_every": 0, "micro_batch_size": 2, "output_dir": str(tmp_path / name),
                                                    **changes.get("train", {})},
                                             **{k: v for k, v in changes.items() if k != "train"}), tmp_path / name / "load")
               for name, changes in LAYOUTS.items()]
    results = run_distributed(_measure, 4, configs, timeout=600)
    for rank, rank_results in enumerate(results):
        for name, (psi, planned_psi, formula, planned, measured, groups, buckets, saved, tensors) in zip(LAYOUTS,
                                                                                                         rank_results):
            assert planned_psi == psi, f"{name} rank {rank}: planner Ψ {planned_psi:,}, runtime {psi:,}"
            assert tensors[0] == tensors[1], f"{name} rank {rank}: planner's optimizer tensors {tensors[0]}, runtime's {tensors[1]}"
            peak, activations, logits = saved
            if logits:  # the head's rank: the blocks' activations, plus at most the logits the planner adds
                assert activations <= peak <= activations + logits, f"{name} rank {rank}: saved {peak:,}, planner {saved[1:]}"
            elif name.startswith(("ep", "moe")):  # within the routing's departure from the balance the planner prices
                assert abs(peak - activations) <= 0.01 * activations, f"{name} rank {rank}: saved {peak:,}, planner {activations:,}"
            else:  # to the byte
                assert peak == activations, f"{name} rank {rank}: saved {peak:,}, planner {activations:,}"
            assert buckets[0] == buckets[1], f"{name} rank {rank}: DDP buckets planned {buckets[0]:,}, runtime {buckets[1]:,}"
            assert planned == formula, f"{name} rank {rank}: planner {planned}, runtime's formula {formula}"
            slack = groups * 3 * 16
            for label, m, e in zip(("parameters", "gradients", "optimizer"), measured, planned):
                assert e <= m <= e + slack, f"{name} rank {rank} {label}: measured {m}, planner {e}"
