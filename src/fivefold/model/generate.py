"""Autoregressive sampling with a KV cache: greedy, temperature and top-k.

The prompt is run once (prefill) to fill the cache; each new token then costs one
single-position forward that attends to the cached keys and values.
"""

from __future__ import annotations

import torch

from fivefold.model.llama import KVCache, Transformer
from fivefold.errors import ConfigError


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> list[int]:
    """New token ids after `prompt`. temperature 0 is greedy; top_k 0 keeps the whole vocabulary.

    Stops at `eos_id` (not returned) or when the sequence reaches the model's max_seq_len.
    """
    if not prompt:
        raise ConfigError("generate needs a non-empty prompt: pass --prompt TEXT")
    device = next(model.parameters()).device
    limit = min(len(prompt) + max_new_tokens, model.config.max_seq_len)
    tokens = torch.tensor([prompt[-model.config.max_seq_len :]], device=device)
    cache = KVCache(model.config, 1, limit, device, next(model.parameters()).dtype) if use_cache else None
    new: list[int] = []
    step_input = tokens
    while tokens.shape[1] < limit:
        logits = model(step_input if use_cache else tokens, cache=cache)[:, -1, :].float()
        next_id = sample_next(logits, temperature, top_k, generator)
        if eos_id is not None and next_id == eos_id:
            break
        new.append(next_id)
        step_input = torch.tensor([[next_id]], device=device)
        tokens = torch.cat([tokens, step_input], dim=1)
    return new


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax(dim=-1).item())
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
