"""Training throughput and MFU on one GPU: fivefold's training step in four settings beside Hugging Face transformers.

    bf16 eager         train.dtype = bf16 (SDPA attention, fused AdamW: the defaults on CUDA)
    + compile-blocks   train.compile with the loss put back to eager: only the blocks compiled (an ablation)
    + compile          train.compile: every block compiled (fused Triton kernels for norms, RoPE, SwiGLU)
                       and the loss (the fp32 upcast and log-softmax fused, no fp32 logits kept)
    + chunked loss     train.loss_chunk_tokens: the head and cross-entropy never hold the full logits
    + fp8              train.fp8 (with compile): the blocks' linear layers through torch._scaled_mm (e4m3 / e5m2)
    + fp8 + chunked    all of the above
    transformers       LlamaForCausalLM (attn_implementation="sdpa") of the same shape, bf16 autocast,
                       fused AdamW, its own loss: the peer, in the same process

Each fivefold setting is the real `Trainer.train_step` (data, forward, backward, clip, AdamW) on the
embedded corpus; the peer runs forward, loss, backward, clip and fused AdamW on one batch of random
tokens of the same shape, again and again (so its loss, which it memorises, is not comparable). Steps are timed on the host clock after a CUDA synchronize, after warm-up steps (which
include compilation). MFU = model FLOPs per token (6 N_matmul + 12 L H Q T, plan/flops.py) x
tokens/s / the GPU's dense bf16 peak (fp8 is quoted against the same bf16 peak, as torchtitan does).
Peak memory is torch.cuda.max_memory_allocated over the timed steps (the warm-up's, which holds
compilation's workspaces, beside it) and the planner's estimate for the same config.
Then the three fused kernels (ops/fused.py) against eager, forward + backward, timed with CUDA events.

    python benchmarks/gpu_train.py --preset llama3.2-1b --seq-len 2048 --batch 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time

import torch


def _sync() -> None:
    torch.cuda.synchronize()


def fivefold_setting(base, name: str, warmup: int, steps: int, eager_loss: bool = False, **train) -> dict:
    from fivefold.plan.cluster import PRESETS
    from fivefold.plan.estimate import estimate
    from fivefold.train.trainer import Trainer

    config = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=warmup + steps, **train))
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(config)
    if eager_loss:  # the ablation: blocks compiled, the loss as without train.compile
        step = trainer.step_fn
        step.loss_sum = dataclasses.replace(step.loss_sum, logits_loss=trainer.parallel.folds.loss_sum)
    times, losses, warm_peak = [], [], 0
    for index in range(warmup + steps):
        if index == warmup:  # compilation's workspaces are not the step's memory
            warm_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        _sync()
        start = time.perf_counter()
        losses.append(trainer.train_step()["loss"])
        _sync()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()  # of the timed steps
    planned = estimate(config, 1, PRESETS["h100-sxm"], vocab_size=trainer.model_config.vocab_size)
    row = {"name": name, "step_s": statistics.median(times), "loss": losses[-1], "peak_bytes": peak,
           "warmup_peak_bytes": warm_peak,
           "planned_bytes": planned.memory.total, "planned_logits": planned.memory.logits,
           "tokens": trainer.tokens_per_step, "flops_per_token": trainer.flops_per_token}
    print(f"{name}: {row['step_s'] * 1e3:.1f} ms, peak {peak / 2**30:.1f} GiB, loss {row['loss']:.3f}",
          file=sys.stderr, flush=True)
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def transformers_setting(model_config, batch: int, seq_len: int, warmup: int, steps: int) -> dict:
    import transformers

    from fivefold.model.hf import config_to_hf
    from fivefold.plan.flops import flops_per_token

    hf = config_to_hf(model_config, torch.float32)
    hf_config = transformers.AutoConfig.for_model(**hf)
    hf_config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, model_config.vocab_size, (batch, seq_len + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times, loss, warm_peak = [], None, 0
    for index in range(warmup + steps):
        if index == warmup:
            warm_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        _sync()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    row = {"name": "transformers", "step_s": statistics.median(times), "loss": float(loss.detach()),
           "peak_bytes": torch.cuda.max_memory_allocated(), "warmup_peak_bytes": warm_peak, "planned_bytes": 0, "planned_logits": 0,
           "tokens": batch * seq_len, "flops_per_token": flops_per_token(model_config, seq_len)}
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def kernel_rows(tokens: int, dim: int, heads: int, head_dim: int, hidden: int) -> list[dict]:
    """Each fused op vs eager: median ms of forward + backward (bf16), and the largest difference."""
    from triton.testing import do_bench

    from fivefold.ops.fused import OPS, fused

    device = "cuda"
    cos = torch.randn(tokens, head_dim, device=device)
    sin = torch.randn(tokens, head_dim, device=device)
    inputs = {
        "rms_norm": lambda: (torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True),
                             torch.randn(dim, device=device, requires_grad=True), 1e-5),
        "swiglu": lambda: (torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True),
                           torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)),
        "rope": lambda: (torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True),
                         cos, sin),
    }
    rows = []
    for name, fn in OPS.items():
        args = inputs[name]()
        fast = fused(fn, device)
        grad = torch.randn_like(fn(*args))

        def run(f):
            return lambda: torch.autograd.grad(f(*args), [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad], grad)

        eager_ms = do_bench(run(fn), return_mode="median")
        fused_ms = do_bench(run(fast), return_mode="median")
        with torch.no_grad():
            diff = (fast(*args).float() - fn(*args).float()).abs().max().item()
        rows.append({"op": name, "eager_ms": eager_ms, "fused_ms": fused_ms, "max_abs_diff": diff})
    return rows


def base_config(args):
    from fivefold.config import JobConfig
    from fivefold.model import get_preset

    base = JobConfig()
    base.model = dataclasses.replace(get_preset(args.preset), max_seq_len=max(args.seq_len, 4096))
    base.data = dataclasses.replace(base.data, source="stdlib", tokenizer="byte")
    base.train = dataclasses.replace(base.train, seq_len=args.seq_len, micro_batch_size=args.batch, dtype="bf16",
                                     device="cuda", eval_every=0, log_every=10**6, output_dir="/tmp/fivefold-gpu-bench")
    base.checkpoint = dataclasses.replace(base.checkpoint, enabled=False, overwrite=True)
    base.logging = dataclasses.replace(base.logging, progress=False, tensorboard=False, plot=False, sample_prompt="")
    base.validate()
    return base


def settings(chunk: int) -> dict[str, dict]:
    """Each fivefold setting's train.* overrides (the peer, "transformers", is measured separately)."""
    return {
        "eager": {},
        "compile-blocks": {"compile": True},
        "compile": {"compile": True},
        "chunked": {"compile": True, "loss_chunk_tokens": chunk},
        "fp8": {"compile": True, "fp8": True},
        "fp8+chunked": {"compile": True, "loss_chunk_tokens": chunk, "fp8": True},
    }


def measure(args, name: str) -> dict:
    """One setting, in this process."""
    base = base_config(args)
    if name == "transformers":
        return transformers_setting(base.model, args.batch, args.seq_len, args.warmup, args.steps)
    return fivefold_setting(base, name, args.warmup, args.steps, name == "compile-blocks", **settings(args.chunk)[name])


def measure_alone(args, name: str) -> dict:
    """One setting in a process of its own: a setting measured after another in the same process read a higher
    peak (44.4 GiB instead of 30.5 for `compile` on an H200), so no setting shares a process with another."""
    command = [sys.executable, __file__, "--row", name, "--preset", args.preset, "--seq-len", str(args.seq_len),
               "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--chunk", str(args.chunk)]
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=4096, help="train.loss_chunk_tokens of the chunked settings")
    parser.add_argument("--settings", default="eager,compile-blocks,compile,chunked,fp8,fp8+chunked,transformers")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure one setting, print its row as JSON
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_train.py measures a CUDA GPU and none is visible here; docs/gpu.md has the figures "
                         "of the last run on one")
    known = [*settings(args.chunk), "transformers"]
    wanted = args.settings.split(",")
    if unknown := [name for name in wanted + ([args.row] if args.row else []) if name not in known]:
        raise SystemExit(f"unknown setting(s) {unknown}: choose from {','.join(known)}")
    if args.row:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's start-up lines; stdout is the row alone
            row = measure(args, args.row)
        print(json.dumps(row))
        return

    from fivefold.train.metrics import lookup_gpu_peak_tflops

    base = base_config(args)
    rows = [measure_alone(args, name) for name in known if name in wanted]
    device = torch.cuda.get_device_name()
    peak = lookup_gpu_peak_tflops(device) * 1e12
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["step_s"]
        row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak
    kernels = kernel_rows(args.batch * args.seq_len, base.model.dim, base.model.n_heads, base.model.head_size,
                          base.model.ffn_hidden_dim)
    if args.json:
        print(json.dumps({"device": device, "torch": torch.__version__, "args": vars(args), "rows": rows,
                          "kernels": kernels}, indent=2))
    gib = 2**30
    print(f"{args.preset}: batch {args.batch} x seq {args.seq_len}, bf16, {device}, torch {torch.__version__}; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'setting':<14} {'step ms':>8} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'planner GiB':>11} "
          f"{'warm-up GiB':>11} {'loss':>7}")
    for row in rows:
        planned = f"{row['planned_bytes'] / gib:>11.1f}" if row["planned_bytes"] else f"{'-':>11}"
        print(f"{row['name']:<14} {row['step_s'] * 1e3:>8.1f} {row['tokens_per_s']:>9,.0f} {row['mfu']:>6.1%} "
              f"{row['peak_bytes'] / gib:>9.1f} {planned} {row['warmup_peak_bytes'] / gib:>11.1f} {row['loss']:>7.3f}")
    print(f"{'kernel':<10} {'eager ms':>9} {'fused ms':>9} {'speed-up':>9} {'max |diff|':>11}")
    for k in kernels:
        print(f"{k['op']:<10} {k['eager_ms']:>9.3f} {k['fused_ms']:>9.3f} {k['eager_ms'] / k['fused_ms']:>8.2f}x "
              f"{k['max_abs_diff']:>11.2e}")
    by = {row["name"]: row for row in rows}
    peer = by.get("transformers")
    best = max((r for r in rows if r["name"] != "transformers"), key=lambda r: r["tokens_per_s"])
    ratio = best["tokens_per_s"] / peer["tokens_per_s"] if peer else float("nan")
    print(f"RESULT name=gpu_train best={best['name']} best_tok_s={best['tokens_per_s']:.0f} best_mfu={best['mfu']:.3f} "
          + " ".join(f"{r['name']}_mfu={r['mfu']:.3f}" for r in rows) + f" ratio_vs_transformers={ratio:.3f}")


if __name__ == "__main__":
    main()
