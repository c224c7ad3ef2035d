"""Mixture-of-experts: local experts vs transformers' Mixtral block, and expert parallelism's step time.

Part 1 (one process): one MoE block of the preset's shape (routed experts only), ours with the
grouped-GEMM kernel and with one matmul per expert, against `transformers`' MixtralSparseMoeBlock
holding the very same weights; forward + backward of the same tokens, alternating rounds, median.

Part 2 (gloo ranks, --world-sizes): forward + backward + gradient sync of the whole preset model at
each world size W with the experts replicated (ep 1: DDP over all W ranks) and split (ep W), the
dispatch through torch's all_to_all_single (gloo's own) and through our pairwise exchange, and
split W/2 ways with each expert halved over 2 expert-tensor-parallel ranks (ep W/2 x etp 2). Every
variant computes the same loss on the same weights and batch (checked: loss_rel_diff).

    python benchmarks/moe.py --preset tiny-moe --batch 4 --seq-len 256 --world-sizes 2,4
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch

from ranks import benchmark_arguments, loss_rel_diff, spawn, timed_rounds


def local_experts(args) -> dict:
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from fivefold.model import get_preset
    from fivefold.model.moe import MoE

    config = dataclasses.replace(get_preset(args.preset), moe_shared_experts=0, moe_shared_ffn_dim=0,
                                 moe_shared_gate=False, moe_norm_topk=True, moe_score="softmax")
    torch.manual_seed(0)
    ours = MoE(config, 0)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hf_config = transformers.MixtralConfig(hidden_size=config.dim, intermediate_size=config.expert_hidden_dim,
                                           num_local_experts=config.n_experts, num_experts_per_tok=config.moe_top_k)
    theirs = MixtralSparseMoeBlock(hf_config)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        for e in range(config.n_experts):
            expert = ours.experts[str(e)]
            theirs.experts.gate_up_proj[e].copy_(torch.cat([expert.w1.weight, expert.w3.weight]))
            theirs.experts.down_proj[e].copy_(expert.w2.weight)
    x = torch.randn(args.batch, args.seq_len, config.dim, generator=torch.Generator().manual_seed(1))

    def run(module) -> tuple[float, float]:
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = module(x).float().pow(2).mean()
        loss.backward()
        return time.perf_counter() - start, float(loss)

    def ours_with(kind: str):
        def step():
            ours.kernel.kind = kind
            return run(ours)
        return step

    variants = {"ours-grouped": ours_with("grouped"), "ours-loop": ours_with("loop"), "transformers": lambda: run(theirs)}
    times = {name: [] for name in variants}
    losses = {}
    for index in range(args.warmup + args.rounds):
        names = list(variants)
        for name in names[index % 3:] + names[: index % 3]:
            seconds, losses[name] = variants[name]()
            if index >= args.warmup:
                times[name].append(seconds)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"grouped_ms": ms["ours-grouped"], "loop_ms": ms["ours-loop"], "transformers_ms": ms["transformers"],
            "grouped_vs_transformers": ms["ours-grouped"] / ms["transformers"],
            "loop_vs_transformers": ms["ours-loop"] / ms["transformers"],
            "loss_rel_diff_local": max(abs(losses[n] - losses["transformers"]) / abs(losses["transformers"])
                                       for n in ("ours-grouped", "ours-loop"))}


def _expert_parallel(rank: int, world_size: int, args) -> dict:
    import torch.nn.functional as F

    from fivefold.config import JobConfig
    from fivefold.model import build_model, get_preset
    from fivefold.parallel.mesh import ParallelDims, build_mesh
    from fivefold.parallel.parallelize import parallelize

    model_config = get_preset(args.preset)
    model_config.vocab_size = model_config.vocab_size or 257
    if args.layers:
        model_config.n_layers = args.layers
    mesh = build_mesh(ParallelDims(dp_replicate=world_size, world_size=world_size), "cpu")
    steps = {}
    half = world_size // 2
    for name, ep, etp, backend in (("ep1", 1, 1, "torch"), (f"ep{world_size}-torch", world_size, 1, "torch"),
                                   (f"ep{world_size}-pairwise", world_size, 1, "pairwise"),
                                   (f"ep{half}-etp2", half, 2, "torch")):
        job = JobConfig()
        job.model = model_config
        job.train = dataclasses.replace(job.train, micro_batch_size=args.batch, seq_len=args.seq_len)
        job.expert_parallel = dataclasses.replace(job.expert_parallel, degree=ep, tensor=etp, alltoall=backend)
        parallel = parallelize(build_model(model_config), mesh, job, torch.device("cpu"),
                               lambda: torch.autocast("cpu", enabled=False))

        def step(inputs, labels, parallel=parallel):
            parallel.model.zero_grad(set_to_none=True)
            logits = parallel.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            (loss / labels.numel()).backward()
            parallel.sync.finish()
            return None, (float(loss.detach()), labels.numel())
        steps[name] = step
    generator = torch.Generator().manual_seed(100 + rank)

    def make_batch() -> torch.Tensor:
        return torch.randint(0, model_config.vocab_size, (args.batch, args.seq_len + 1), generator=generator)

    wrapped = {name: (lambda tokens, s=s: s(tokens[:, :-1], tokens[:, 1:])) for name, s in steps.items()}
    ms, _, losses = timed_rounds(wrapped, make_batch, args.warmup, args.rounds)
    names = list(steps)
    return {**{f"{n}_x{world_size}_ms" if n == "ep1" else f"{n}_ms": v for n, v in ms.items()},
            "loss_rel_diff": loss_rel_diff(losses, [(names[1], names[0]), (names[2], names[0]), (names[3], names[0])]),
            f"ep{world_size}_vs_ep1": ms[names[1]] / ms[names[0]],
            f"pairwise_vs_torch_x{world_size}": ms[names[2]] / ms[names[1]],
            f"etp2_vs_ep{world_size}": ms[names[3]] / ms[names[1]]}


def main() -> None:
    parser = benchmark_arguments(__doc__)  # ranks.py's options, with the MoE demo shape
    parser.set_defaults(preset="tiny-moe")
    parser.add_argument("--world-sizes", default="2")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = local_experts(args)
    print(f"local experts, {args.batch}x{args.seq_len} tokens: grouped {result['grouped_ms']:.1f} ms, loop "
          f"{result['loop_ms']:.1f} ms, transformers Mixtral block {result['transformers_ms']:.1f} ms "
          f"(grouped/transformers {result['grouped_vs_transformers']:.2f}x)")
    loss_diffs = [result.pop("loss_rel_diff_local")]
    for world in (int(w) for w in args.world_sizes.split(",") if w):
        part = spawn(_expert_parallel, world, args, args.timeout)
        loss_diffs.append(part.pop("loss_rel_diff"))
        print(f"{world} ranks: " + ", ".join(f"{k} {v:.2f}" for k, v in part.items()))
        result.update(part)
    result["loss_rel_diff"] = max(loss_diffs)
    if args.json:
        print(json.dumps(result))
    print("RESULT name=moe " + " ".join(f"{k}={v:.4g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
