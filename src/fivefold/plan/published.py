"""Published training runs the planner and the simulator are checked against: Megatron-LM's weak-scaling
table (SC21) and its iteration times with and without sequence parallelism (Korthikanti et al. 2022).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models from 1.7B to 1T parameters on up to
3,072 A100-80GB GPUs of NVIDIA's Selene (8 GPUs per node, NVLink/NVSwitch inside, 8 HDR
InfiniBand links per node), vocabulary 51,200, sequence 2,048, mixed precision, full activation
recomputation. The same table is in NVIDIA/Megatron-LM's repository as images/cases_april2021.png
(added in commit 50a4b5fa02, April 2021), whose README says a model-parallel size above 8 is tensor
parallelism 8 times pipeline parallelism. The table does not give the micro-batch or the interleaving;
the authors' own script for it does (NVIDIA/Megatron-LM examples/sc21/run_table_1.sh: micro-batch 16
for 1.7B to 7.5B, 8 for 18B, 4 for 39B, 2 for 76B and 145B, 1 beyond; layers per virtual stage 5 for
76B and 145B, 3 for 310B, 1 for 530B, i.e. 3, 2, 2 and 3 virtual stages; none for 39B and 1T), and
the attention heads (24 to 160: head dimension 96 for 1.7B and 3.6B, 160 for 530B and 1T, else 128).
Achieved teraFLOP/s there count the paper's 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs per iteration,
the recomputed forward included.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
arXiv 2205.05198): Table 3 gives four GPT models (22B, 175B, 530B, 1T; vocabulary 51,200, sequence
2,048) with their tensor and pipeline degrees, GPUs and global batch on A100-80GB of Selene, and
Table 5 the measured seconds per iteration with full recomputation (tensor parallelism's all-reduces)
and with sequence parallelism plus selective recomputation. The tables do not give the micro-batch
or the interleaving; those are taken as Calculon's validation inputs read them (calculon-ai/calculon,
validation/*.json: micro-batch 4 for 22B, else 1; 3 virtual stages for 175B and 530B).

Our model is Llama-shaped (SwiGLU, RoPE, RMSNorm, no biases); each row is built with the GPT
row's width, depth, tied embeddings and vocabulary and a SwiGLU width of 8h/3 (rounded to a multiple of tp), which keeps
the MLP's 8 h^2 weights, so the parameter count is the published one within its rounding (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import JobConfig
from fivefold.config.loader import load_config

SC21_SOURCE = ("Narayanan et al., SC21 (arXiv 2104.04473), Table 1; NVIDIA/Megatron-LM "
               "images/cases_april2021.png (commit 50a4b5fa02); micro-batch and interleaving from "
               "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh")
SC21_VOCAB = 51200
SC21_SEQ = 2048


@dataclass(frozen=True)
class PublishedRun:
    """One row of a published weak-scaling table."""

    name: str
    hidden: int
    layers: int
    heads: int
    params_billion: float
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    tflops_per_gpu: float  # achieved, as the paper counts it
    micro_batch: int = 1  # sequences, as the authors' script ran the row
    virtual: int = 1  # virtual stages per pipeline rank (the interleaved schedule when > 1)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


# name, h, l, heads, params (B), tp, pp, GPUs, batch, achieved TFLOP/s per GPU, micro-batch, virtual stages
SC21_TABLE1 = [
    PublishedRun("1.7B", 2304, 24, 24, 1.7, 1, 1, 32, 512, 137, 16),
    PublishedRun("3.6B", 3072, 30, 32, 3.6, 2, 1, 64, 512, 138, 16),
    PublishedRun("7.5B", 4096, 36, 32, 7.5, 4, 1, 128, 512, 142, 16),
    PublishedRun("18B", 6144, 40, 48, 18.4, 8, 1, 256, 1024, 135, 8),
    PublishedRun("39B", 8192, 48, 64, 39.1, 8, 2, 512, 1536, 138, 4),
    PublishedRun("76B", 10240, 60, 80, 76.1, 8, 4, 1024, 1792, 140, 2, 3),
    PublishedRun("145B", 12288, 80, 96, 145.6, 8, 8, 1536, 2304, 148, 2, 2),
    PublishedRun("310B", 16384, 96, 128, 310.1, 8, 16, 1920, 2160, 155, 1, 2),
    PublishedRun("530B", 20480, 105, 128, 529.6, 8, 35, 2520, 2520, 163, 1, 3),
    PublishedRun("1T", 25600, 128, 160, 1008.0, 8, 64, 3072, 3072, 163, 1),
]


def paper_flops(run: PublishedRun, seq_len: int = SC21_SEQ, vocab: int = SC21_VOCAB) -> float:
    """FLOPs of one iteration as SC21 counts them (with full recomputation's extra forward)."""
    b, s, layers, h = run.batch, seq_len, run.layers, run.hidden
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def gpt_config(hidden: int, heads: int, layers: int, tp: int, pp: int, micro_batch: int, accum: int,
               recompute: str = "full", sequence_parallel: bool = False, schedule: str = "1f1b",
               virtual: int = 1) -> JobConfig:
    """A published GPT row as a fivefold job: width, depth and heads, the papers' vocabulary and sequence,
    tied embeddings, a SwiGLU width of 8h/3 (rounded to a multiple of tp: the MLP keeps its 8h^2 weights),
    bf16, the given recomputation and tp / sp / pp layout, DDP (neither paper shards optimizer states); with
    tp and pp but no sp, messages between stages scattered over tp and all-gathered (Megatron-LM's scatter/gather)."""
    ffn = round(8 * hidden / 3 / tp) * tp
    overrides = [
        f"--model.dim={hidden}", f"--model.n_layers={layers}", f"--model.n_heads={heads}", f"--model.n_kv_heads={heads}",
        f"--model.vocab_size={SC21_VOCAB}", f"--model.ffn_dim={ffn}", f"--model.max_seq_len={SC21_SEQ}",
        f"--train.seq_len={SC21_SEQ}", f"--train.micro_batch_size={micro_batch}", f"--train.grad_accum_steps={accum}",
        "--model.tie_embeddings=true", "--train.dtype=bf16", f"--train.recompute={recompute}",
        f"--tensor_parallel.degree={tp}", f"--pipeline_parallel.degree={pp}",
    ]
    if sequence_parallel:
        overrides.append("--tensor_parallel.sequence_parallel=true")
    if pp > 1:
        overrides += [f"--pipeline_parallel.schedule={schedule}", f"--pipeline_parallel.virtual={virtual}"]
    if pp > 1 and tp > 1 and not sequence_parallel:  # Megatron-LM's default (SC21, section 4.1)
        overrides.append("--pipeline_parallel.scatter_gather=true")
    return load_config(None, overrides)


def sc21_config(run: PublishedRun, schedule: str | None = None) -> JobConfig:
    """The row as a fivefold job: its degrees, micro-batch and interleaving as the authors ran it, bf16
    compute, full recomputation, DDP (2021: no ZeRO). `schedule` replaces the pipeline schedule (then
    without virtual stages)."""
    virtual = run.virtual if schedule is None else 1
    schedule = schedule or ("interleaved" if run.virtual > 1 else "1f1b")
    return gpt_config(run.hidden, run.heads, run.layers, run.tp, run.pp, run.micro_batch,
                      run.batch // (run.dp * run.micro_batch), "full", False, schedule, virtual)


KORTHIKANTI_SOURCE = ("Korthikanti et al., MLSys 2023 (arXiv 2205.05198), Tables 3 and 5; micro-batch and "
                      "interleaving as calculon-ai/calculon validation/*.json read them")
KORTHIKANTI_MODES = ("full", "selective")


@dataclass(frozen=True)
class PublishedIteration:
    """One model of Korthikanti et al.'s Table 3 with its two measured iteration times of Table 5."""

    name: str
    hidden: int
    heads: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    micro_batch: int
    virtual: int
    seconds: dict  # "full": full recomputation; "selective": sequence parallelism + selective recomputation

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


KORTHIKANTI_TABLE = [
    PublishedIteration("22B", 6144, 64, 48, 8, 1, 8, 4, 4, 1, {"full": 1.42, "selective": 1.10}),
    PublishedIteration("175B", 12288, 96, 96, 8, 8, 64, 64, 1, 3, {"full": 18.13, "selective": 13.75}),
    PublishedIteration("530B", 20480, 128, 105, 8, 35, 280, 280, 1, 3, {"full": 49.05, "selective": 37.83}),
    PublishedIteration("1T", 25600, 160, 128, 8, 64, 512, 512, 1, 1, {"full": 94.42, "selective": 71.49}),
]


def korthikanti_config(run: PublishedIteration, mode: str) -> JobConfig:
    """The row as a fivefold job: `full` is full recomputation with tensor parallelism's all-reduces,
    `selective` is sequence parallelism with selective recomputation (the paper's "present work")."""
    if mode not in KORTHIKANTI_MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(KORTHIKANTI_MODES)}")
    schedule = "interleaved" if run.virtual > 1 else "1f1b"
    return gpt_config(run.hidden, run.heads, run.layers, run.tp, run.pp, run.micro_batch,
                      run.batch // (run.dp * run.micro_batch), mode, mode == "selective", schedule, run.virtual)
