"""Forward + backward throughput: fivefold's model vs Hugging Face `transformers` (the family's own class).

Both models hold the same weights (ours exported to a Hugging Face folder and loaded by
`AutoModelForCausalLM.from_pretrained`: LlamaForCausalLM, Qwen2/Qwen3ForCausalLM,
MistralForCausalLM or Olmo2ForCausalLM as the config needs), run the same shapes and dtype in the
same process, and are timed in alternating rounds so that machine noise hits both alike. Loss is
the same fp32 token cross-entropy for both. `--family` puts a family's options on the preset's
shape (qwen2: qkv biases; qwen3: per-head q/k norm; mistral: a window of seq_len / 4; olmo2:
projection q/k norm and post norms). Prints a table and a final `RESULT` line; `--json` for machines.

    python benchmarks/model_throughput.py --preset tiny --batch 8 --seq-len 256 [--family qwen3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F


def step_time(forward, tokens: torch.Tensor, labels: torch.Tensor, device: torch.device, dtype) -> tuple[float, float]:
    """Seconds of one forward and backward, and the loss it computed (weights never change: no optimizer)."""
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        logits = forward(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=257, help="for presets that take it from the tokenizer")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0 = keep)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--family", choices=("llama", "qwen2", "qwen3", "mistral", "olmo2"), default="llama")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import transformers

    from fivefold.model import build_model, get_preset, materialize
    from fivefold.model.hf import ARCHITECTURES, hf_family, save_hf
    from fivefold.plan.flops import flops_per_token

    options = {"llama": {}, "qwen2": {"attention_bias": "qkv"}, "qwen3": {"qk_norm": "head"},
               "mistral": {"sliding_window": max(1, args.seq_len // 4)},
               "olmo2": {"qk_norm": "projection", "norm_position": "post"}}[args.family]
    config = get_preset(args.preset)
    config = dataclasses.replace(config, vocab_size=config.vocab_size or args.vocab_size,
                                 n_layers=args.layers or config.n_layers, **options)
    config.validate()
    device = torch.device(args.device)
    autocast = torch.bfloat16 if args.dtype == "bf16" else None
    ours = materialize(build_model(config), device, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        save_hf(ours, folder)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").to(device)
    class_name = ARCHITECTURES[hf_family(config)]
    ours.train()
    theirs.train()
    forwards = {"fivefold": ours, "transformers": lambda x: theirs(input_ids=x, use_cache=False).logits}

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1), generator=generator).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {name: [] for name in forwards}
    losses: dict[str, float] = {}
    for round_index in range(args.warmup + args.rounds):
        order = list(forwards) if round_index % 2 == 0 else list(reversed(forwards))
        for name in order:
            model = ours if name == "fivefold" else theirs
            model.zero_grad(set_to_none=True)
            elapsed, losses[name] = step_time(forwards[name], inputs, labels, device, autocast)
            if round_index >= args.warmup:
                times[name].append(elapsed)

    tokens_per_step = args.batch * args.seq_len
    flops = flops_per_token(config, args.seq_len)
    rows = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        rows[name] = {"median_s": median, "tokens_per_s": tokens_per_step / median,
                      "tflops": flops * tokens_per_step / median / 1e12}
    ratio = rows["fivefold"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"]
    if args.json:
        print(json.dumps({"config": vars(args), "results": rows, "ratio": ratio}, indent=2))
    print(f"{config.name} as {class_name}: h={config.dim} L={config.n_layers} V={config.vocab_size}, batch {args.batch} x seq {args.seq_len}, "
          f"{args.dtype} on {device.type}, median of {args.rounds} alternating rounds")
    print(f"{'implementation':<14} {'step (ms)':>10} {'tokens/s':>12} {'TFLOP/s':>9}")
    for name, row in rows.items():
        print(f"{name:<14} {row['median_s'] * 1e3:>10.1f} {row['tokens_per_s']:>12,.0f} {row['tflops']:>9.3f}")
    agreement = abs(losses["fivefold"] - losses["transformers"]) / abs(losses["transformers"])
    print(f"ratio fivefold / transformers tokens/s: {ratio:.3f}; losses differ by {agreement:.1e} (relative)")
    print(f"RESULT name=model_throughput preset={args.preset} family={args.family} dtype={args.dtype} device={device.type} "
          f"fivefold_tok_s={rows['fivefold']['tokens_per_s']:.0f} transformers_tok_s={rows['transformers']['tokens_per_s']:.0f} "
          f"ratio={ratio:.3f} loss_rel_diff={agreement:.3e}")


if __name__ == "__main__":
    main()
