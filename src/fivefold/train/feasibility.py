"""Refuse a run that cannot fit before any memory is allocated, naming the settings that make it too big.

The floor (plan/memory.py `training_floor`) counts only what training must hold: fp32 model states
of the rank's part of the model, its blocks' saved activations (plan/activations.py) and the fp32
logits with their gradient. If even that exceeds the memory a rank has (the accelerator's, or the
machine's RAM shared by its local ranks), the run would die in an allocation minutes later or
take the machine down with it; this says so at once. Evaluation windows are checked against the
validation split they are cut from.
"""

from __future__ import annotations

import math
import os

import torch

from fivefold.config import JobConfig
from fivefold.errors import ConfigError
from fivefold.model import ModelConfig
from fivefold.plan.activations import ActivationShape, block_activation_elements
from fivefold.plan.flops import count_parameters
from fivefold.plan.memory import training_floor


def memory_per_rank(device: torch.device, local_ranks: int) -> int:
    """Bytes one rank may use: the accelerator's memory, or the machine's RAM over its local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**62
    return total // max(local_ranks, 1)


def check_fits(config: JobConfig, model: ModelConfig, device: torch.device, local_ranks: int) -> None:
    t, tp, cp, pp = config.train, config.tensor_parallel, config.context_parallel.degree, config.pipeline_parallel.degree
    seq = t.seq_len // cp
    shape = ActivationShape(t.micro_batch_size, seq, tp.degree, tp.sequence_parallel, t.recompute)
    split = tp.degree * pp * (config.data_parallel.shard * cp if config.data_parallel.zero_stage == 3 else 1)
    floor = training_floor(count_parameters(model).total, math.ceil(model.n_layers / pp),
                           block_activation_elements(model, shape), t.micro_batch_size, seq, model.vocab_size, split,
                           t.loss_chunk_tokens)
    available = memory_per_rank(device, local_ranks)
    if floor.total <= available:
        return
    gib = 2**30
    parts = sorted([(floor.model_states, "model states (model.dim, model.n_layers, model.ffn_dim)"),
                    (floor.activations, "activations (train.micro_batch_size, train.seq_len; train.recompute helps)"),
                    (floor.logits, "logits (train.micro_batch_size x train.seq_len x vocabulary; train.loss_chunk_tokens helps)")], reverse=True)
    raise ConfigError(
        f"this run needs at least {floor.total / gib:,.1f} GiB per rank but a rank has {available / gib:,.1f} GiB "
        f"({'accelerator' if device.type == 'cuda' else 'RAM / local ranks'}): "
        + ", ".join(f"{name} {size / gib:,.1f} GiB" for size, name in parts)
        + "; lower the largest, or split the model (tensor_parallel.degree, pipeline_parallel.degree, ZeRO-3)")


def check_eval_windows(config: JobConfig, val_tokens: int) -> None:
    t = config.train
    windows = max(val_tokens - t.seq_len, 0)
    if t.eval_every and t.eval_batches * t.micro_batch_size > windows:
        raise ConfigError(
            f"train.eval_batches x train.micro_batch_size = {t.eval_batches * t.micro_batch_size:,} evaluation windows, "
            f"but the validation split ({val_tokens:,} tokens) has {windows:,} windows of train.seq_len = {t.seq_len}: "
            "lower train.eval_batches (or raise data.val_fraction)")
