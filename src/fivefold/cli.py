"""The `fivefold` command line: thin parsing, then calls into the library.

    fivefold train [--config FILE.toml] [--nproc-per-node N] [--max-restarts N] [--resume auto|none|DIR]
                   [--overwrite] [--init-from-hf HF_DIR] [--section.key VALUE ...]
    fivefold generate --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
    fivefold info --model PRESET [--seq-len S]
    fivefold convert --checkpoint DIR --to HF_DIR [--dtype fp32|bf16]
    fivefold convert --from-hf HF_DIR --to RUN_DIR [--config FILE.toml] [--section.key VALUE ...]
    fivefold verify PATH                  a checkpoint, every checkpoint of a run folder, or an export
    fivefold diagnose RUN_DIR             why a run ended: the failure class, the culprit and the evidence
    fivefold config [--config FILE.toml] [--section.key VALUE ...] | --reference
    fivefold plot-schedule --pp P --microbatches M --schedule gpipe|1f1b|interleaved|zb-h1 [--virtual V] [--output F.png]
    fivefold plot-schedule --trace RUN/pipeline_trace.json [--output F.png]
    fivefold plan [--config FILE.toml] [--section.key VALUE ...] --gpus N [--cluster PRESET|FILE] [--search ...|--sharding-degrees]
                  [--tokens T --days D ...]     memory and step time of a layout, the best layout, the GPU budget
    fivefold bench comm [--nproc-per-node N] [--collectives all_reduce,...] [--min-bytes 1K] [--max-bytes 16M] [--json F]
    fivefold bench compute [--config FILE.toml] [--section.key VALUE ...] --out PROFILE.json [--ranks N] [--device cuda]

Bad input ends with one line `fivefold: error: ...` naming the setting or file and the fix, and
the exit code of its family (errors.py); an unexpected error with one line too, unless --debug
asks for the traceback. This module imports no torch until a command needs it, so
`fivefold --help` is instant.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from fivefold.errors import EXIT_FAULT, EXIT_INTERNAL, ConfigError, FivefoldError

TRAIN_EPILOG = """\
Any config key can be set on the command line, after the options above:
  --section.key VALUE  or  --section.key=VALUE
  e.g. --train.steps 500 --optim.lr 1e-3 --tensor_parallel.degree 2 --checkpoint.async_save true
The command line wins over --config, which wins over the defaults. Every key, its default and its
meaning: `fivefold config --reference` (docs/configuration.md); the resolved config of a command
line: `fivefold config --config FILE [overrides]`.

Reliability (docs/reliability.md): checkpoints are verified on load; --resume auto takes the newest
that verifies; non-finite steps are skipped and rolled back ([guard]); a hung rank is named within
two heartbeats ([watchdog]); --max-restarts N restarts failed workers from the newest checkpoint;
`fivefold diagnose RUN_DIR` explains how a run ended.
"""


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    import os

    from fivefold.config import load_config

    if args.resume is not None:
        overrides = [*overrides, "--checkpoint.resume", args.resume]
    if args.overwrite:
        overrides = [*overrides, "--checkpoint.overwrite", "true"]
    if args.init_from_hf:
        overrides = [*overrides, "--model.init_from_hf", args.init_from_hf]
    config = load_config(args.config, overrides)
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node = {args.nproc_per_node}: must be a positive number of ranks")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts = {args.max_restarts}: must be >= 0")
    if (args.nproc_per_node > 1 or args.max_restarts > 0) and "WORLD_SIZE" not in os.environ:
        from fivefold.train.launch import check_before_launch, launch

        check_before_launch(config, args.nproc_per_node)  # fail here, before starting any rank
        forwarded = ([f"--config={args.config}"] if args.config else []) + overrides + (["--debug"] if args.debug else [])
        return launch(args.nproc_per_node, forwarded, max_restarts=args.max_restarts,
                      output_dir=config.train.output_dir, debug=args.debug)
    from fivefold.train.roles import run

    run(config)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from fivefold.config import config_from_dict
    from fivefold.model import build_model, materialize
    from fivefold.model.generate import generate
    from fivefold.train.checkpoint import (
        checkpoint_folder,
        load_checkpoint_tokenizer,
        load_config_dict,
        load_model_weights,
        open_checkpoint,
    )
    from fivefold.train.setup import resolve_device

    folder = checkpoint_folder(args.checkpoint)  # a run folder: its newest checkpoint
    manifest = open_checkpoint(folder)
    config = config_from_dict(load_config_dict(manifest))
    device = resolve_device(args.device)
    model = materialize(build_model(config.model), device, seed=None)
    load_model_weights(folder, model)
    model.eval()
    tokenizer = load_checkpoint_tokenizer(manifest)
    print(f"fivefold: generating from {folder} (step {manifest.body.get('step')}, verified)", file=sys.stderr)
    if not args.no_cache:
        from fivefold.model.mla import cache_values_per_token

        c = config.model
        positions = min(len(tokenizer.encode(args.prompt)) + args.max_new_tokens, c.max_seq_len)
        per_token = cache_values_per_token(c)
        size = c.n_layers * positions * per_token * next(model.parameters()).element_size()
        kind = "MLA latent + RoPE key" if c.attention == "mla" else "keys + values"
        print(f"fivefold: KV cache {size / 2**20:.2f} MiB ({positions} positions x {c.n_layers} layers x "
              f"{per_token} values per token ({kind}))", file=sys.stderr)
    generator = torch.Generator().manual_seed(args.seed)
    ids = generate(model, tokenizer.encode(args.prompt), args.max_new_tokens, args.temperature, args.top_k,
                   eos_id=tokenizer.eos_id, use_cache=not args.no_cache, generator=generator)
    print(args.prompt + tokenizer.decode(ids))
    return 0


def _info(args: argparse.Namespace) -> int:
    from fivefold.model.presets import get_preset
    from fivefold.plan.flops import attention_flops_per_token, count_parameters, flops_per_token
    from fivefold.plan.memory import adam_fp32, adam_mixed_precision

    model = get_preset(args.model)
    if model.vocab_size == 0:
        model.vocab_size = args.vocab_size
    seq = args.seq_len or model.max_seq_len
    counts = count_parameters(model)
    n = counts.total
    kv = model.kv_heads
    attn_kind = "MHA" if kv == model.n_heads else ("MQA" if kv == 1 else f"GQA ({kv} kv heads)")
    if model.attention == "mla":
        attn_kind = "MLA"
    gib = 2**30
    rows = [
        ("model", model.name),
        ("shape", f"h={model.dim} L={model.n_layers} heads={model.n_heads} {attn_kind} ffn={model.ffn_hidden_dim} "
                  f"V={model.vocab_size}{' tied' if model.tie_embeddings else ''}"),
        ("options", _model_options(model)),
        ("parameters", f"{n:,}" + (f" ({counts.active:,} per token)" if model.n_experts else "")),
        ("  embedding", f"{counts.embedding:,}"),
        ("  attention", f"{counts.attention:,}"),
        ("  mlp", f"{counts.mlp:,}" + (f" (all experts; {counts.mlp_used:,} per token)" if model.n_experts else "")),
        ("  norms", f"{counts.norms:,}"),
        ("  biases", f"{counts.biases:,}"),
        ("  output head", f"{counts.head:,}" + (" (tied to embedding)" if model.tie_embeddings else "")),
        ("training FLOPs/token", f"{flops_per_token(model, seq):.4e} at seq_len {seq} "
                                 f"(6N = {6 * counts.matmul:.4e}, attention = {attention_flops_per_token(model, seq):.4e})"),
    ]
    for label, states in (("fp32 Adam", adam_fp32(n)), ("mixed-precision Adam", adam_mixed_precision(n))):
        rows.append((f"model states, {label}", f"{states.total / gib:,.1f} GiB (params {states.parameters / gib:,.1f} + "
                                               f"grads {states.gradients / gib:,.1f} + optimizer {states.optimizer / gib:,.1f})"))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def _model_options(model) -> str:
    """The settings beyond plain Llama, as a short list."""
    options = [f"head_dim {model.head_dim}"] if model.head_dim else []
    options += [f"{name.replace('_', ' ')} {getattr(model, name)}" for name, plain in (
        ("attention_bias", "none"), ("qk_norm", "none"), ("norm_position", "pre")) if getattr(model, name) != plain]
    options += ["mlp bias"] if model.mlp_bias else []
    if model.rope_scaling != "none":
        options.append(f"RoPE {model.rope_scaling} x{model.rope_factor:g}")
    options += [f"sliding window {model.sliding_window}"] if model.sliding_window else []
    if model.attention == "mla":
        options.append(f"MLA q rank {model.q_lora_rank or 'none'}, kv rank {model.kv_lora_rank}, head "
                       f"{model.qk_nope_head_dim}+{model.qk_rope_head_dim} rope, v {model.v_head_dim}")
    if model.n_experts:
        shared = f" + shared {model.shared_hidden_dim}" if model.shared_hidden_dim else ""
        options.append(f"MoE {model.n_experts} experts x {model.expert_hidden_dim} top-{model.moe_top_k}{shared} in "
                       f"{len(model.moe_layers)} of {model.n_layers} layers, {model.moe_score} router"
                       + (f", top-{model.moe_topk_groups} of {model.moe_groups} groups" if model.moe_groups > 1 else ""))
    return ", ".join(options) or "plain Llama"


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    if bool(args.checkpoint) == bool(args.from_hf):
        raise ConfigError("convert needs one of --checkpoint DIR (to a Hugging Face folder) or --from-hf HF_DIR "
                          "(to a fivefold run folder)")
    if args.from_hf:
        from fivefold.train.import_hf import CONFIG_FILE, import_hf

        checkpoint = import_hf(args.from_hf, args.to, args.config, overrides)
        print(f"wrote {checkpoint} from {args.from_hf}; continue training in any layout with:\n"
              f"  fivefold train --config {checkpoint.parent / CONFIG_FILE} [--nproc-per-node N --tensor_parallel.degree T ...]")
        return 0
    if overrides or args.config:
        raise ConfigError("--config and --section.key overrides apply to convert --from-hf only")
    import torch

    from fivefold.config import config_from_dict
    from fivefold.model import build_model, materialize
    from fivefold.model.hf import ARCHITECTURES, hf_family, save_hf
    from fivefold.train.checkpoint import checkpoint_folder, load_checkpoint_tokenizer, load_config_dict, load_model_weights

    folder = checkpoint_folder(args.checkpoint)
    config = config_from_dict(load_config_dict(folder))
    model = materialize(build_model(config.model), "cpu", seed=None)
    load_model_weights(folder, model)  # consolidated weights: any training world size, any ZeRO stage
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    out = save_hf(model, args.to, dtype, tokenizer=load_checkpoint_tokenizer(folder))
    print(f"wrote a Hugging Face {ARCHITECTURES[hf_family(model.config)]} folder to {out} ({args.dtype}) from {folder}, "
          "with a checksummed manifest")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from fivefold.reliability.verify import format_reports, verify_path

    reports = verify_path(args.path)
    print(format_reports(reports))
    return 0 if reports and all(r.ok for r in reports) else 2


def _diagnose(args: argparse.Namespace) -> int:
    from fivefold.reliability.diagnose import diagnose, format_diagnosis

    print(format_diagnosis(diagnose(args.run_dir)))
    return 0


def _config(args: argparse.Namespace, overrides: list[str]) -> int:
    from fivefold.config import describe_config, load_config

    if args.reference:
        print(describe_config(), end="")
    else:
        from fivefold.parallel.validate import check_config

        print(check_config(load_config(args.config, overrides)).to_json())
    return 0


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from fivefold.config import load_config
    from fivefold.plan.cluster import load_cluster
    from fivefold.plan.report import run

    return run(args, load_config(args.config, overrides), load_cluster(args.cluster))


def _plot_schedule(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fivefold.parallel.pipeline.plot import plot_schedule, plot_trace
    from fivefold.parallel.pipeline.schedules import PipelineShape, check_schedule

    if args.trace:
        if not Path(args.trace).is_file():
            raise ConfigError(f"--trace {args.trace}: no such file; a pipeline run writes <train.output_dir>/"
                              "pipeline_trace.json when logging.pipeline_trace = true")
        output = args.output or str(args.trace).removesuffix(".json") + ".png"
        print(f"wrote {plot_trace(args.trace, output)}")
        return 0
    if args.pp is None or args.microbatches is None or args.schedule is None:
        raise ConfigError("plot-schedule needs --pp, --microbatches and --schedule (or --trace FILE)")
    virtual = args.virtual or (2 if args.schedule == "interleaved" else 1)
    try:
        shape = PipelineShape(args.pp, args.microbatches, virtual)
        check_schedule(args.schedule, shape)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    output = args.output or f"schedule-{args.schedule}-pp{args.pp}-m{args.microbatches}.png"
    print(f"wrote {plot_schedule(args.schedule, shape, output)}")
    return 0


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    """Start `python -m fivefold.comm.bench` in N ranks under torchrun, or run it here when already a rank."""
    import os

    from fivefold.comm import bench

    forwarded = argv[argv.index("comm") + 1:]
    if "WORLD_SIZE" in os.environ or any(flag in forwarded for flag in ("-h", "--help")):
        return bench.main(forwarded)
    bench.parse(forwarded)  # a bad option fails here, not in every rank
    from fivefold.train.launch import launch

    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node = {args.nproc_per_node}: must be a positive number of ranks")
    return launch(args.nproc_per_node, forwarded, module="fivefold.comm.bench", debug=args.debug)


def _bench_compute(args: argparse.Namespace, overrides: list[str]) -> int:
    """Measure the config's model's forward passes on one accelerator and write the profile (plan/profile.py)."""
    from pathlib import Path

    import torch

    from fivefold.config import load_config
    from fivefold.plan.profile_measure import measure_on_ranks, measure_profile
    from fivefold.train.setup import available_cores

    if args.repeats < 1 or args.ranks < 1 or args.threads < 0:
        raise ConfigError("bench compute: --repeats and --ranks must be >= 1 and --threads >= 0")
    if args.vocab_size < 0:
        raise ConfigError(f"bench compute: --vocab-size {args.vocab_size}: must be >= 0 (0: the tokenizer's)")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ConfigError(f"bench compute: --device {args.device!r}: use cpu, cuda or cuda:N")
    config = load_config(args.config, overrides)
    if args.device.startswith("cpu"):  # as many measuring processes as ranks, sharing the cores
        threads = args.threads or config.train.threads or max(1, available_cores() // args.ranks)
        profile = measure_on_ranks(config, args.ranks, threads, args.vocab_size, args.repeats)
    elif not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA is not available here")
    else:
        profile = measure_profile(config, args.vocab_size, args.repeats, args.device)
    Path(args.out).write_text(profile.to_json(), encoding="utf-8")
    print(f"wrote {args.out}: forward of one micro-batch ({profile.micro_batch_size} x {profile.seq_len}, "
          f"{profile.dtype}) on {profile.device}: dense block {profile.block * 1e3:.2f} ms"
          + (f", MoE block {profile.moe_block * 1e3:.2f} ms" if profile.moe_block else "")
          + f", attention core {profile.core * 1e3:.2f} ms, head and loss {profile.head * 1e3:.2f} ms")
    return 0


def _simulate(args: argparse.Namespace, overrides: list[str]) -> int:
    from fivefold.sim.report import run

    return run(args, overrides)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)  # --debug after the command too (kept when given before it)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an unexpected error")
    parser = argparse.ArgumentParser(prog="fivefold", description="Distributed LLM training on torch.distributed")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", parents=[common], epilog=TRAIN_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           help="train a model; any config key can be overridden as --section.key VALUE")
    train.add_argument("--config", help="TOML config file (defaults apply to anything it leaves out)")
    train.add_argument("--resume", help="shorthand for --checkpoint.resume: auto, none or a checkpoint folder")
    train.add_argument("--overwrite", action="store_true",
                       help="shorthand for --checkpoint.overwrite true: replace another run in train.output_dir")
    train.add_argument("--init-from-hf", metavar="HF_DIR",
                       help="shorthand for --model.init_from_hf: start from a local Hugging Face model folder's "
                            "weights, model settings and tokenizer (docs/model.md)")
    train.add_argument("--nproc-per-node", type=int, default=1,
                       help="ranks on this machine; > 1 runs torchrun underneath (gloo on CPU, NCCL on GPU)")
    train.add_argument("--max-restarts", type=int, default=0,
                       help="restart the workers up to N times after a failure, each time from the newest verified "
                            "checkpoint (torchrun's elastic agent)")

    convert = sub.add_parser("convert", parents=[common],
                             help="a checkpoint to a Hugging Face folder (safetensors), or a Hugging Face folder to a run (--from-hf)")
    convert.add_argument("--checkpoint", help="to Hugging Face: a step-* checkpoint folder, or a run folder (newest is used)")
    convert.add_argument("--from-hf", help="from Hugging Face: a local model folder (config.json, *.safetensors, tokenizer.json)")
    convert.add_argument("--to", required=True, help="output folder: a Hugging Face folder, or with --from-hf a new run folder")
    convert.add_argument("--config", help="with --from-hf: TOML config whose non-model settings the run folder keeps")
    convert.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))

    verify = sub.add_parser("verify", parents=[common],
                            help="check a checkpoint (or every checkpoint of a run folder, or an export) file by file")
    verify.add_argument("path", help="a step-* folder, a run folder, or a folder written by `fivefold convert`")

    diagnose = sub.add_parser("diagnose", parents=[common],
                              help="why a run ended: failure class, culprit rank and the evidence lines")
    diagnose.add_argument("run_dir", help="the run's train.output_dir")

    config = sub.add_parser("config", parents=[common], help="print the resolved config as JSON, or --reference for every key")
    config.add_argument("--config", help="TOML config file")
    config.add_argument("--reference", action="store_true", help="markdown table of every key, its default and meaning")

    gen = sub.add_parser("generate", parents=[common], help="sample text from a checkpoint (KV-cached)")
    gen.add_argument("--checkpoint", required=True, help="a step-* checkpoint folder, or a run folder (newest is used)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = whole vocabulary")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each token (for checking)")

    info = sub.add_parser("info", parents=[common], help="parameters, FLOPs per token and model-state memory of a preset")
    info.add_argument("--model", required=True, help="preset name, e.g. llama3-8b")
    info.add_argument("--seq-len", type=int, default=0, help="context for the attention FLOPs (default: preset max)")
    info.add_argument("--vocab-size", type=int, default=257, help="for presets whose vocabulary comes from the tokenizer")

    plan = sub.add_parser("plan", parents=[common], epilog="Config keys as for train: --section.key VALUE (docs/planner.md).",
                          help="predicted memory per rank and step time of a layout on a cluster; --search ranks every "
                               "layout; --tokens gives training time or GPU count")
    from fivefold.plan.report import add_arguments as plan_arguments

    plan_arguments(plan)

    simulate = sub.add_parser("simulate", parents=[common],
                              epilog="Config keys as for train: --section.key VALUE (docs/simulator.md).",
                              help="simulate a training step of a layout (--gpus), or one collective (--ranks), with "
                                   "the runtime's own schedules and algorithms over a cluster's fabric")
    from fivefold.sim.report import add_arguments as simulate_arguments

    simulate_arguments(simulate)

    plot = sub.add_parser("plot-schedule", parents=[common],
                          help="draw a pipeline schedule's timeline (PNG), with its bubble")
    plot.add_argument("--pp", type=int, help="pipeline ranks")
    plot.add_argument("--microbatches", type=int)
    plot.add_argument("--schedule", help="gpipe, 1f1b, interleaved or zb-h1")
    plot.add_argument("--trace", help="draw a measured step instead: a run's <output_dir>/pipeline_trace.json")
    plot.add_argument("--virtual", type=int, default=0, help="virtual stages per rank (interleaved; default 2)")
    plot.add_argument("--output", help="PNG path (default: next to --trace, else schedule-<name>-pp<P>-m<M>.png)")

    bench = sub.add_parser("bench", parents=[common], help="benchmarks of the runtime")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    comm = bench_sub.add_parser("comm", parents=[common], add_help=False,
                                help="nccl-tests-style table of every collective algorithm and the backend's own, "
                                     "measured beside the cost model's prediction (--help lists its options)")
    comm.add_argument("--nproc-per-node", type=int, default=4, help="ranks to start (under torchrun)")
    compute = bench_sub.add_parser("compute", parents=[common], epilog="Config keys as for train: --section.key VALUE.",
                                   help="time this model's forward passes on one accelerator (a dense and a MoE "
                                        "block, the attention core, the head and loss) and write the profile "
                                        "`plan --profile` and `simulate --profile` price compute by")
    compute.add_argument("--config", help="TOML config file (the job's model and micro-batch shape)")
    compute.add_argument("--out", required=True, help="the profile (JSON) to write")
    compute.add_argument("--repeats", type=int, default=10, help="timed passes of each part (the median counts)")
    compute.add_argument("--threads", type=int, default=0,
                         help="intra-op threads (CPU; default: as one rank of --ranks would have, train.threads or "
                              "the cores / ranks)")
    compute.add_argument("--ranks", type=int, default=1,
                         help="ranks of the job on this host (CPU): as many processes measure at once, sharing the cores")
    compute.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    compute.add_argument("--vocab-size", type=int, default=0, help="the vocabulary when the config leaves it to the tokenizer")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _train(args, rest)
        if args.command == "config":
            return _config(args, rest)
        if args.command == "plan":
            return _plan(args, rest)
        if args.command == "simulate":
            return _simulate(args, rest)
        if args.command == "convert":
            return _convert(args, rest)
        if args.command == "bench" and args.bench == "compute":
            return _bench_compute(args, rest)
        if args.command == "bench":
            return _bench(args, list(sys.argv[1:] if argv is None else argv))
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        commands = {"generate": _generate, "verify": _verify, "diagnose": _diagnose,
                    "plot-schedule": _plot_schedule, "info": _info}
        return commands[args.command](args)
    except FivefoldError as exc:
        print(f"fivefold: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fivefold: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`fivefold ... | head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, unless --debug asks for the traceback
        if args.debug:
            raise
        if any(text in str(exc) for text in ("Connection closed by peer", "Connection reset by peer")):
            print("fivefold: error: this rank lost a peer in a collective: another rank failed first (its error, or "
                  "the watchdog's verdict, names the cause)", file=sys.stderr)
            return EXIT_FAULT
        if type(exc).__name__ in ("MemoryError", "OutOfMemoryError"):
            print(f"fivefold: error: out of memory ({exc}): lower train.micro_batch_size or train.seq_len, use "
                  "train.recompute, or shard the model (ZeRO-3, tensor or pipeline parallelism)", file=sys.stderr)
            return EXIT_FAULT
        print(f"fivefold: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback, and "
              "please report it)", file=sys.stderr)
        return EXIT_INTERNAL
