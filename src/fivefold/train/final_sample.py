"""The text sample printed at the end of a run (`logging.sample_prompt`, `logging.sample_tokens`).

Which ranks generate: rank 0 alone, unless the sync gathers weights or exchanges tokens inside forward
(ZeRO-3, expert parallelism), where every rank must run each forward with it. A model split by tensor,
context or pipeline parallelism is whole on no rank: then nothing is generated here and the user is
pointed at `fivefold generate --checkpoint`, which loads the whole model in one process.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fivefold.config import JobConfig
from fivefold.model.generate import generate
from fivefold.parallel.mesh import ParallelDims
from fivefold.progress import announce


def final_sample(model: nn.Module, tokenizer, config: JobConfig, dims: ParallelDims, is_rank0: bool,
                 gathers_in_forward: bool, say: Callable[[str], None]) -> str | None:
    """The end-of-run sample on the ranks that must generate (every rank calls this); None where none is asked
    or this rank does not generate."""
    log = config.logging
    if not (log.sample_prompt and log.sample_tokens):
        return None
    if dims.tp > 1 or dims.cp > 1 or dims.pp > 1 or config.expert_parallel.degree * config.expert_parallel.tensor > 1:
        say("sample: generation runs in one process; use `fivefold generate --checkpoint` on this run")
        return None
    if not (is_rank0 or gathers_in_forward):
        return None
    generator = torch.Generator().manual_seed(config.train.seed)
    model.eval()
    with announce(f"generating a {log.sample_tokens}-token sample", say):
        ids = generate(model, tokenizer.encode(log.sample_prompt), log.sample_tokens, temperature=0.8, top_k=40,
                       eos_id=tokenizer.eos_id, generator=generator)
    model.train()
    return log.sample_prompt + tokenizer.decode(ids)
