"""Multi-latent attention: equal to a plain step-by-step implementation, its cache, its counts, bad settings."""

import dataclasses
import math

import pytest
import torch

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.model.generate import generate
from fivefold.model.llama import KVCache, build_model, materialize
from fivefold.model.mla import cache_values_per_token
from fivefold.model.presets import get_preset
from fivefold.plan.flops import count_parameters


def mla_config(**changes) -> ModelConfig:
    base = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, attention="mla", q_lora_rank=16,
                       kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    config = dataclasses.replace(base, **changes)
    config.validate()
    return config


def reference_mla(attn, x, cos, sin):
    """Token by token, head by head: the definition in DeepSeek-V2 section 2.1."""
    def rms(v, norm):
        return norm.weight * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)

    def rotate(v, c, s):  # half-split RoPE of one vector
        a, b = v.chunk(2)
        return v * c + torch.cat([-b, a]) * s

    seq = x.shape[1]
    out = torch.zeros(seq, attn.wo.out_features)
    n, r, dv = attn.nope, attn.rope, attn.v_dim
    qs, ks, vs = [], [], []
    for t in range(seq):
        xt = x[0, t]
        q = attn.wq(xt) if attn.wq is not None else attn.wq_b(rms(attn.wq_a(xt), attn.q_a_norm))
        kv_a = attn.wkv_a(xt)
        c, k_rope = rms(kv_a[: attn.kv_rank], attn.kv_a_norm), rotate(kv_a[attn.kv_rank :], cos[t], sin[t])
        kv = attn.wkv_b(c)
        heads_q, heads_k, heads_v = [], [], []
        for h in range(attn.n_heads):
            qh = q[h * (n + r) : (h + 1) * (n + r)]
            heads_q.append(torch.cat([qh[:n], rotate(qh[n:], cos[t], sin[t])]))
            kvh = kv[h * (n + dv) : (h + 1) * (n + dv)]
            heads_k.append(torch.cat([kvh[:n], k_rope]))
            heads_v.append(kvh[n:])
        qs.append(heads_q), ks.append(heads_k), vs.append(heads_v)
    for t in range(seq):
        per_head = []
        for h in range(attn.n_heads):
            scores = torch.stack([qs[t][h] @ ks[j][h] for j in range(t + 1)]) / math.sqrt(n + r)
            weights = scores.softmax(0)
            per_head.append(sum(w * vs[j][h] for j, w in enumerate(weights)))
        out[t] = attn.wo(torch.cat(per_head))
    return out


@pytest.mark.parametrize("q_lora_rank", [16, 0], ids=["compressed-q", "direct-q"])
def test_mla_equals_the_step_by_step_definition(q_lora_rank):
    config = mla_config(q_lora_rank=q_lora_rank)
    model = materialize(build_model(config), seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)  # norms matter
    attn = model.layers["0"].attention
    x = torch.randn(1, 7, 32)
    cos, sin = model.rope(torch.arange(7))
    torch.testing.assert_close(attn(x, cos, sin)[0], reference_mla(attn, x, cos, sin), rtol=1e-5, atol=1e-5)


def test_mla_cache_holds_the_latent_and_generation_matches_no_cache():
    config = mla_config()
    model = materialize(build_model(config), seed=1).eval()
    prompt = [5, 9, 2, 33, 7]
    assert generate(model, prompt, 12, use_cache=True) == generate(model, prompt, 12, use_cache=False)
    cache = KVCache(config, 1, 32, "cpu", torch.float32)
    assert cache_values_per_token(config) == 12 + 4
    assert cache.nbytes == 2 * 32 * (12 + 4) * 4  # layers x positions x (latent + RoPE key) x fp32
    mha = dataclasses.replace(config, attention="mha")
    assert KVCache(mha, 1, 32, "cpu", torch.float32).nbytes == 2 * 32 * 2 * 4 * 8 * 4  # k and v of 4 heads of 8


def test_mla_parameter_count_equals_the_instantiated_model():
    for q_lora_rank in (16, 0):
        config = mla_config(q_lora_rank=q_lora_rank)
        model = build_model(config)
        assert count_parameters(config).total == sum(p.numel() for p in model.parameters())


def test_deepseek_v3_sizes():
    """DeepSeek-V3: 671B total, 37B activated per token (the report's whole-billion figures, without the
    multi-token-prediction module): exactly 671,026,404,352 and 37,552,282,624 here (embedding and head
    included in both)."""
    count = count_parameters(get_preset("deepseek-v3"))
    assert 671e9 <= count.total < 671.1e9
    assert 37e9 <= count.active < 38e9


@pytest.mark.parametrize("changes,match", [
    (dict(qk_rope_head_dim=3), "qk_rope_head_dim"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(attention_bias="qkv"), "attention_bias"),
    (dict(sliding_window=4), "sliding_window"),
])
def test_bad_mla_settings(changes, match):
    with pytest.raises(ConfigError, match=match):
        mla_config(**changes)
