"""Hugging Face model folders (config.json + safetensors) <-> fivefold weights, for nine families.

    LlamaForCausalLM    Llama 2/3/3.1/3.2 (RoPE scaling linear, llama3, yarn; attention/MLP biases; head_dim)
    Qwen2ForCausalLM    biases on q, k, v
    Qwen3ForCausalLM    per-head query/key RMSNorm; explicit head_dim
    MistralForCausalLM  sliding-window attention
    Olmo2ForCausalLM    RMSNorm over the whole q/k projections; norms after attention and MLP
    MixtralForCausalLM  mixture of experts: softmax top-k, renormalised, every layer
    Qwen2MoeForCausalLM mixture of experts with a sigmoid-gated shared expert, q/k/v biases,
                        decoder_sparse_step / leading mlp_only_layers
    Qwen3MoeForCausalLM mixture of experts with per-head q/k RMSNorm
    DeepseekV3ForCausalLM multi-latent attention; sigmoid routing with a selection bias, group-limited
                        (n_group / topk_group), routed_scaling_factor; shared experts; leading dense layers

Our RoPE uses the same half-split convention as `transformers`, so conversion is a renaming of
tensors, with no permutation of the query/key projections:
    model.embed_tokens            <-> tok_embeddings
    model.layers.i.self_attn.{q,k,v,o}_proj <-> layers.i.attention.w{q,k,v,o}   (.weight and .bias)
    model.layers.i.self_attn.{q,k}_norm     <-> layers.i.attention.{q,k}_norm
    model.layers.i.mlp.{gate,up,down}_proj  <-> layers.i.feed_forward.w{1,3,2}
    pre-norm families: model.layers.i.{input,post_attention}_layernorm <-> layers.i.{attention,ffn}_norm
    OLMo 2:            model.layers.i.{post_attention,post_feedforward}_layernorm <-> layers.i.{attention,ffn}_norm
    model.norm <-> norm;  lm_head <-> output (absent when embeddings are tied)
    Mixtral:  model.layers.i.block_sparse_moe.gate <-> layers.i.feed_forward.router,
              ....block_sparse_moe.experts.e.w{1,2,3} <-> layers.i.feed_forward.experts.e.w{1,2,3}
    Qwen-MoE: model.layers.i.mlp.gate <-> ...router, mlp.experts.e.{gate,up,down}_proj <-> experts.e.w{1,3,2},
              mlp.shared_expert.* <-> feed_forward.shared.*, mlp.shared_expert_gate <-> feed_forward.shared_gate
    DeepSeek-V3: mlp.gate.e_score_correction_bias <-> feed_forward.expert_bias (a buffer), mlp.shared_experts.*
              <-> feed_forward.shared.*, self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa,
              kv_a_layernorm, kv_b_proj, o_proj <-> attention.{wq | wq_a, q_a_norm, wq_b}, wkv_a, kv_a_norm, wkv_b, wo;
              with rope_interleave (its default) the RoPE rows of wq / wq_b and wkv_a are reordered on import
(on disk transformers keeps one tensor per expert, which is our layout too).
Only what the model can represent is accepted: another model_type, a non-SiLU activation, RoPE
scaling of another kind (dynamic, longrope; mscale outside DeepSeek-V3), partial rotary embeddings or a
mix of sliding and full attention layers is refused by name. Export picks the family that
represents the config (`hf_family`) and refuses a combination none of them has.
Exports are atomic, readable (0644) and carry a checksummed manifest (`fivefold-manifest.json`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fivefold.errors import CheckpointError
from fivefold.model.config import ModelConfig
from fivefold.model.llama import Transformer, build_model, materialize
from fivefold.reliability.manifest import EXPORT_MANIFEST, Manifest, readable_tree, write_manifest

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# config.json keys a family may leave out, with the value its transformers class then uses.
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "sliding_window": 4096},
    "olmo2": {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "qwen2_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "deepseek_v3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096},
}
_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_ATTENTION_MAP = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
_MLA_MAP = {  # DeepSeek-V3's multi-latent attention (model/mla.py)
    "self_attn.q_proj": "attention.wq",
    "self_attn.q_a_proj": "attention.wq_a",
    "self_attn.q_a_layernorm": "attention.q_a_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
    "self_attn.kv_a_layernorm": "attention.kv_a_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo",
}
_PRE_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
_POST_NORMS = {"post_attention_layernorm": "attention_norm", "post_feedforward_layernorm": "ffn_norm"}
_TOP_MAP = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}


def _layer_map(family: str) -> dict[str, str]:
    out = {**_ATTENTION_MAP, **(_POST_NORMS if family == "olmo2" else _PRE_NORMS)}
    if family == "mixtral":
        out["block_sparse_moe.gate"] = "feed_forward.router"
    elif family == "deepseek_v3":
        out = {**{k: v for k, v in out.items() if not k.startswith("self_attn.")}, **_MLA_MAP,
               "mlp.gate": "feed_forward.router"}
        out.update({f"mlp.shared_experts.{hf}": f"feed_forward.shared.{ours}" for hf, ours in _PROJECTIONS.items()})
    elif family in MOE_FAMILIES:
        out["mlp.gate"] = "feed_forward.router"
        out["mlp.shared_expert_gate"] = "feed_forward.shared_gate"
        out.update({f"mlp.shared_expert.{hf}": f"feed_forward.shared.{ours}" for hf, ours in _PROJECTIONS.items()})
    return out


def _expert_to_fivefold(inner: str, family: str) -> str | None:
    """`feed_forward.experts.5.w1` of a Hugging Face expert tensor's name inside a layer (None if it is none)."""
    prefix = "block_sparse_moe.experts." if family == "mixtral" else "mlp.experts."
    if family not in MOE_FAMILIES or not inner.startswith(prefix):
        return None
    index, _, proj = inner[len(prefix):].partition(".")
    proj = proj if family == "mixtral" else _PROJECTIONS.get(proj, "")
    if not index.isdigit() or proj not in ("w1", "w2", "w3"):
        return None
    return f"feed_forward.experts.{index}.{proj}"


def _expert_to_hf(inner: str, family: str) -> str | None:
    if family not in MOE_FAMILIES or not inner.startswith("feed_forward.experts."):
        return None
    index, _, proj = inner[len("feed_forward.experts."):].partition(".")
    if family == "mixtral":
        return f"block_sparse_moe.experts.{index}.{proj}"
    return f"mlp.experts.{index}.{ {v: k for k, v in _PROJECTIONS.items()}[proj] }"


def hf_to_fivefold_name(name: str, family: str = "llama") -> str:
    stem, _, leaf = name.rpartition(".")
    if stem in _TOP_MAP:
        return f"{_TOP_MAP[stem]}.{leaf}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) >= 4:
        inner = ".".join(parts[3:])
        if family == "deepseek_v3" and inner == "mlp.gate" and leaf == "e_score_correction_bias":
            return f"layers.{parts[2]}.feed_forward.expert_bias"  # the selection bias (a buffer here)
        layer_map = _layer_map(family)
        if inner in layer_map:
            return f"layers.{parts[2]}.{layer_map[inner]}.{leaf}"
        expert = _expert_to_fivefold(inner, family)
        if expert:
            return f"layers.{parts[2]}.{expert}.{leaf}"
    raise CheckpointError(f"Hugging Face tensor {name!r} has no fivefold counterpart in a {ARCHITECTURES[family]}")


def fivefold_to_hf_name(name: str, family: str = "llama") -> str:
    stem, _, leaf = name.rpartition(".")
    for hf, ours in _TOP_MAP.items():
        if stem == ours:
            return f"{hf}.{leaf}"
    parts = stem.split(".")
    inner = ".".join(parts[2:])
    if family == "deepseek_v3" and inner == "feed_forward" and leaf == "expert_bias":
        return f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"
    for hf, ours in _layer_map(family).items():
        if ours == inner:
            return f"model.layers.{parts[1]}.{hf}.{leaf}"
    expert = _expert_to_hf(inner, family)
    if expert:
        return f"model.layers.{parts[1]}.{expert}.{leaf}"
    raise CheckpointError(f"fivefold tensor {name!r} has no counterpart in a {ARCHITECTURES[family]}")


def _rope_settings(hf: dict, family: str) -> dict:
    """ModelConfig's rope_* fields from config.json (transformers 5 `rope_parameters`, or the older
    top-level `rope_theta` with `rope_scaling`)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    merged = {**legacy, **params}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    out = {"rope_theta": theta}
    if float(merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise CheckpointError("config.json sets partial_rotary_factor; fivefold rotates the whole head")
    if kind == "default":
        return out
    if kind not in ("linear", "llama3", "yarn"):
        raise CheckpointError(f"RoPE scaling {kind!r} in config.json is not supported; fivefold implements "
                              "none, linear, llama3 and yarn")
    factor = merged.get("factor")
    original = merged.get("original_max_position_embeddings")
    if kind == "yarn":
        if family != "deepseek_v3":
            for key in ("mscale", "mscale_all_dim"):
                if merged.get(key):
                    raise CheckpointError(f"yarn RoPE scaling with {key} (DeepSeek's variant) is not supported for "
                                          f"{ARCHITECTURES[family]}")
        if merged.get("truncate", True) is False:
            raise CheckpointError("yarn RoPE scaling with truncate = false is not supported")
        if factor is None and original:
            factor = hf.get("max_position_embeddings", 0) / original
    if factor is None:
        raise CheckpointError(f"RoPE scaling {kind!r} in config.json has no factor")
    out.update(rope_scaling=kind, rope_factor=float(factor))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(merged["low_freq_factor"]),
                   rope_high_freq_factor=float(merged["high_freq_factor"]))
    if kind in ("llama3", "yarn"):
        if not original:
            raise CheckpointError(f"RoPE scaling {kind!r} in config.json has no original_max_position_embeddings")
        out["rope_original_max_seq_len"] = int(original)
    if kind == "yarn":
        attention_factor = float(merged.get("attention_factor") or 0.0)
        mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
        if not attention_factor and mscale and mscale_all_dim:  # transformers' rule for DeepSeek's yarn

            def get_mscale(m: float) -> float:
                return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

            attention_factor = get_mscale(float(mscale)) / get_mscale(float(mscale_all_dim))
        out.update(rope_beta_fast=float(merged.get("beta_fast") or 32.0), rope_beta_slow=float(merged.get("beta_slow") or 1.0),
                   rope_attention_factor=attention_factor, rope_mscale_all_dim=float(mscale_all_dim or 0.0))
    return out


def _sliding_window(hf: dict, family: str) -> int:
    """One window for every layer, or 0; a mix of sliding and full layers is refused."""
    if family == "mistral":
        if "layer_types" in hf:
            raise CheckpointError("config.json lists layer_types for a Mistral model (Ministral's alternating attention); "
                                  "fivefold applies one sliding window to every layer")
        return int(hf.get("sliding_window", _DEFAULTS["mistral"]["sliding_window"]) or 0)
    if family == "mixtral":
        return int(hf.get("sliding_window") or 0)
    if family not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        return 0
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)
    ]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return 0
    if kinds == {"sliding_attention"} and window:
        return int(window)
    raise CheckpointError(f"config.json mixes sliding and full attention layers ({types.count('sliding_attention')} of "
                          f"{layers} sliding; use_sliding_window / max_window_layers / layer_types); fivefold applies "
                          "one model.sliding_window to every layer")


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dictionary of one of the supported families."""
    family = hf.get("model_type", "llama")
    if family not in ARCHITECTURES:
        raise CheckpointError(f"config.json has model_type {family!r}; supported: {', '.join(ARCHITECTURES)} "
                              f"({', '.join(ARCHITECTURES.values())})")
    defaults = _DEFAULTS[family]
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act = {hf['hidden_act']!r}; fivefold's MLP is SwiGLU (silu)")
    if hf.get("mlp_bias") and family != "llama":
        raise CheckpointError(f"config.json sets mlp_bias for {family}, whose transformers class has none")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or defaults.get("head_dim") or dim // heads
    if family == "deepseek_v3":
        head_dim = dim // heads  # its head_dim is the RoPE width; multi-latent attention has its own widths
    attention_bias = {"qwen2": "qkv"}.get(family, "all" if hf.get("attention_bias") else "none")
    if family == "qwen2_moe":
        attention_bias = "qkv" if hf.get("qkv_bias", True) else "none"
    config = ModelConfig(
        name=hf.get("_name_or_path") or f"hf-{family}",
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=heads if family == "deepseek_v3" else hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        ffn_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
        max_seq_len=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02),
        head_dim=0 if head_dim * heads == dim else head_dim,
        attention_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmo2": "projection"}.get(family, "none"),
        norm_position="post" if family == "olmo2" else "pre",
        sliding_window=_sliding_window(hf, family),
        **_rope_settings(hf, family),
        **_moe_settings(hf, family),
        **_mla_settings(hf, family),
    )
    config.validate()
    return config


def _mla_settings(hf: dict, family: str) -> dict:
    """DeepSeek-V3's multi-latent attention widths."""
    if family != "deepseek_v3":
        return {}
    if hf.get("attention_bias"):
        raise CheckpointError("config.json sets attention_bias for DeepSeek-V3; fivefold's multi-latent attention has none")
    return dict(attention="mla", q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=hf["kv_lora_rank"],
                qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                v_head_dim=hf["v_head_dim"])


def _deepseek_moe_settings(hf: dict) -> dict:
    """DeepseekV3ForCausalLM's routing: sigmoid scores, a fixed selection bias, group-limited top-k; every layer
    from first_k_dense_replace on is MoE. Balancing and capacity are training choices, left off."""
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise CheckpointError(f"config.json scoring_func = {scoring!r}: DeepseekV3ForCausalLM routes by sigmoid scores")
    return dict(n_experts=hf["n_routed_experts"], moe_top_k=hf["num_experts_per_tok"],
                moe_ffn_dim=hf["moe_intermediate_size"], moe_shared_experts=int(hf.get("n_shared_experts") or 0),
                moe_score="sigmoid", moe_norm_topk=bool(hf.get("norm_topk_prob", True)),
                moe_route_scale=float(hf.get("routed_scaling_factor", 1.0)), moe_groups=int(hf.get("n_group") or 1),
                moe_topk_groups=int(hf.get("topk_group") or 1), moe_first_dense=int(hf.get("first_k_dense_replace", 0)),
                moe_layer_freq=1)


def _moe_settings(hf: dict, family: str) -> dict:
    """ModelConfig's mixture-of-experts fields from config.json (the routing rules of each family's class)."""
    if family not in MOE_FAMILIES:
        return {}
    if family == "deepseek_v3":
        return _deepseek_moe_settings(hf)
    coeff = float(hf.get("router_aux_loss_coef", 0.001))
    if family == "mixtral":
        return dict(n_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
                    moe_ffn_dim=hf["intermediate_size"], moe_aux_loss="switch", moe_aux_coeff=coeff)
    dense_layers = list(hf.get("mlp_only_layers") or [])
    if dense_layers != list(range(len(dense_layers))):
        raise CheckpointError(f"config.json mlp_only_layers = {dense_layers}: fivefold keeps dense MLPs only in the "
                              "first layers (model.moe_first_dense)")
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]  # transformers 5 renamed it
    out = dict(n_experts=experts, moe_top_k=hf["num_experts_per_tok"],
               moe_ffn_dim=hf["moe_intermediate_size"], moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
               moe_layer_freq=int(hf.get("decoder_sparse_step", 1)), moe_first_dense=len(dense_layers),
               moe_aux_loss="switch", moe_aux_coeff=coeff)
    if family == "qwen2_moe":
        shared = int(hf.get("shared_expert_intermediate_size", 0) or 0)
        if not shared:
            raise CheckpointError("config.json shared_expert_intermediate_size is 0; Qwen2MoeForCausalLM always has a "
                                  "shared expert")
        out.update(moe_shared_ffn_dim=shared, moe_shared_gate=True)
    return out


def hf_family(config: ModelConfig) -> str:
    """The transformers family that represents this config; CheckpointError naming what none can."""
    def refuse(setting: str, family: str) -> CheckpointError:
        return CheckpointError(f"model.{setting} = {getattr(config, setting)!r} cannot be exported as a "
                               f"{ARCHITECTURES[family]} (the family its other settings need)")

    if config.attention == "mla" and not config.n_experts:
        raise CheckpointError("model.attention = mla without experts cannot be exported: the one family with multi-latent "
                              "attention, DeepseekV3ForCausalLM, is a mixture of experts")
    if config.attention != "mha" and config.attention != "mla":
        raise CheckpointError(f"model.attention = {config.attention!r} cannot be exported")
    if config.n_experts:
        return _moe_family(config)
    if config.norm_position == "post" or config.qk_norm == "projection":
        family = "olmo2"
        for setting, ok in (("norm_position", "post"), ("qk_norm", "projection")):
            if getattr(config, setting) != ok:
                raise refuse(setting, family)
        bad = [s for s, v in (("mlp_bias", config.mlp_bias), ("sliding_window", config.sliding_window),
                              ("attention_bias", config.attention_bias == "qkv")) if v]
    elif config.qk_norm == "head":
        family = "qwen3"
        bad = [s for s, v in (("mlp_bias", config.mlp_bias), ("attention_bias", config.attention_bias == "qkv")) if v]
    elif config.attention_bias == "qkv":
        family = "qwen2"
        bad = [s for s, v in (("mlp_bias", config.mlp_bias),) if v]
    elif config.sliding_window:
        family = "mistral"
        bad = [s for s, v in (("mlp_bias", config.mlp_bias), ("attention_bias", config.attention_bias != "none")) if v]
    else:
        family, bad = "llama", []
    if bad:
        raise refuse(bad[0], family)
    return family


def _moe_family(config: ModelConfig) -> str:
    """Mixtral (no shared expert, renormalised, every layer MoE), Qwen2-MoE (gated shared expert, q/k/v biases)
    or Qwen3-MoE (per-head q/k norm); the routing options those classes lack are refused by name."""
    if config.attention == "mla":
        family = "deepseek_v3"
    elif config.shared_hidden_dim:
        family = "qwen2_moe"
    elif config.qk_norm == "head":
        family = "qwen3_moe"
    else:
        family = "mixtral"
    wants = {"moe_shared_gate": True} if family == "qwen2_moe" else {}
    wants |= {"moe_score": "softmax", "moe_route_scale": 1.0, "moe_bias_update_rate": 0.0, "mlp_bias": False,
             "norm_position": "pre", "qk_norm": "head" if family == "qwen3_moe" else "none",
             "attention_bias": "qkv" if family == "qwen2_moe" else "none", "moe_groups": 1, "moe_topk_groups": 1}
    if family == "deepseek_v3":  # sigmoid scores, any scale, a selection bias (exported), shared experts ungated
        wants = {"moe_score": "sigmoid", "moe_shared_gate": False, "moe_shared_ffn_dim": 0, "moe_layer_freq": 1,
                 "mlp_bias": False, "norm_position": "pre", "qk_norm": "none", "attention_bias": "none",
                 "sliding_window": 0}
    if family == "qwen2_moe":
        wants.update(moe_shared_experts=0)  # Qwen2-MoE gives one shared width: moe_shared_ffn_dim
    if family == "mixtral":
        wants.update(moe_norm_topk=True, moe_layer_freq=1, moe_first_dense=0)
    for setting, value in wants.items():
        if getattr(config, setting) != value:
            raise CheckpointError(f"model.{setting} = {getattr(config, setting)!r} cannot be exported as a "
                                  f"{ARCHITECTURES[family]} (it needs {value!r})")
    return family


def _rope_parameters(config: ModelConfig) -> dict:
    params: dict = {"rope_type": "default" if config.rope_scaling == "none" else config.rope_scaling,
                    "rope_theta": config.rope_theta}
    if config.rope_scaling != "none":
        params["factor"] = config.rope_factor
    if config.rope_scaling == "llama3":
        params.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor)
    if config.rope_scaling in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = config.rope_original_max_seq_len
    if config.rope_scaling == "yarn":
        params.update(beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow)
        if config.rope_attention_factor:
            params["attention_factor"] = config.rope_attention_factor
        if config.rope_mscale_all_dim:
            params["mscale_all_dim"] = config.rope_mscale_all_dim
    return params


def config_to_hf(config: ModelConfig, dtype: torch.dtype, tokenizer=None) -> dict:
    family = hf_family(config)
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": _rope_parameters(config),
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family in ("llama", "qwen3", "olmo2"):
        out["attention_bias"] = config.attention_bias == "all"
    if family == "llama":
        out["mlp_bias"] = config.mlp_bias
    if family == "mistral":
        out["sliding_window"] = config.sliding_window
    if family == "mixtral":
        out.update(num_local_experts=config.n_experts, num_experts_per_tok=config.moe_top_k,
                   intermediate_size=config.expert_hidden_dim, sliding_window=config.sliding_window or None,
                   router_aux_loss_coef=config.moe_aux_coeff)
    if family in ("qwen2_moe", "qwen3_moe"):
        out.update(num_experts=config.n_experts, num_experts_per_tok=config.moe_top_k,
                   moe_intermediate_size=config.expert_hidden_dim, norm_topk_prob=config.moe_norm_topk,
                   decoder_sparse_step=config.moe_layer_freq, mlp_only_layers=list(range(config.moe_first_dense)),
                   router_aux_loss_coef=config.moe_aux_coeff)
        if family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=config.shared_hidden_dim, qkv_bias=True)
        else:
            out["attention_bias"] = False
    if family == "deepseek_v3":
        out.update(num_key_value_heads=config.n_heads, head_dim=config.qk_rope_head_dim,
                   q_lora_rank=config.q_lora_rank or None, kv_lora_rank=config.kv_lora_rank,
                   qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                   v_head_dim=config.v_head_dim, n_routed_experts=config.n_experts,
                   num_experts_per_tok=config.moe_top_k, moe_intermediate_size=config.expert_hidden_dim,
                   n_shared_experts=config.moe_shared_experts, n_group=config.moe_groups,
                   topk_group=config.moe_topk_groups, norm_topk_prob=config.moe_norm_topk,
                   routed_scaling_factor=config.moe_route_scale, first_k_dense_replace=config.moe_first_dense,
                   rope_interleave=False, attention_bias=False, num_nextn_predict_layers=0)
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        out.update(use_sliding_window=bool(config.sliding_window), sliding_window=config.sliding_window or None,
                   max_window_layers=0,
                   layer_types=["sliding_attention" if config.sliding_window else "full_attention"] * config.n_layers)
    if tokenizer is not None and getattr(tokenizer, "eos_id", None) is not None:
        out["eos_token_id"] = tokenizer.eos_id
        if getattr(tokenizer, "bos_id", None) is not None:
            out["bos_token_id"] = tokenizer.bos_id
    return out


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (weight_map): {exc}") from exc
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors weights (pickle checkpoints are not loaded, by design)")
    return [folder / name for name in files]


def read_hf_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a local Hugging Face model folder (its config.json), after checking the manifest of our exports."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (no config.json)")
    if (folder / EXPORT_MANIFEST).is_file():  # written by save_hf: check every file first
        Manifest.load(folder, EXPORT_MANIFEST, f"export {folder}").verify_all()
    try:
        hf = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not JSON: {exc}") from exc
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path} is not a JSON object")
    try:
        return config_from_hf(hf)
    except KeyError as exc:
        raise CheckpointError(f"{config_path} lacks {exc}") from exc


@torch.no_grad()
def load_hf_weights(model: Transformer, folder: str | Path) -> None:
    """Copy a Hugging Face folder's tensors into `model` (materialised; possibly one pipeline stage's
    part): only the tensors the model holds are read, each checked for its shape; a missing one is an error."""
    folder = Path(folder)
    family = hf_family(model.config)
    expected = model.state_dict()
    whole = set(build_model(model.config).state_dict())  # on the meta device: names only
    if family == "deepseek_v3":
        expected.update(_expert_biases(model))
        whole |= set(_expert_biases(build_model(model.config)))
        interleaved = _reads_interleaved_rope(folder)
    found: set[str] = set()
    for path in _safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for hf_name in handle.keys():
                    if hf_name.endswith("rotary_emb.inv_freq"):  # a buffer older transformers saved; recomputed
                        continue
                    if family == "deepseek_v3" and _layer_of(hf_name) >= model.config.n_layers:
                        continue  # DeepSeek-V3's multi-token-prediction module, which transformers also skips
                    name = hf_to_fivefold_name(hf_name, family)
                    if name not in expected:
                        if name in whole or (name == "output.weight" and model.config.tie_embeddings):
                            continue  # another pipeline stage's tensor, or a tied head's copy
                        raise CheckpointError(f"{folder}: tensor {hf_name} is not part of the model config.json "
                                              "describes (a bias or norm the config does not declare?)")
                    tensor = handle.get_tensor(hf_name)
                    if tensor.shape != expected[name].shape:
                        raise CheckpointError(f"{folder}: {hf_name} has shape {tuple(tensor.shape)}, config.json implies "
                                              f"{tuple(expected[name].shape)}")
                    if family == "deepseek_v3" and interleaved:
                        tensor = _deinterleave_rope(name, tensor, model.config)
                    expected[name].copy_(tensor)
                    found.add(name)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors for damaged files
            raise CheckpointError(f"{path} is not a readable safetensors file ({str(exc)[:200]})") from exc
    missing = sorted(set(expected) - found)
    if missing:
        raise CheckpointError(f"{folder} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _layer_of(hf_name: str) -> int:
    parts = hf_name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() else -1


def _expert_biases(model: Transformer) -> dict[str, torch.Tensor]:
    """The MoE layers' selection biases by state-dict-style name (they are buffers, not saved with the weights)."""
    return {name: buffer for name, buffer in model.named_buffers() if name.endswith("feed_forward.expert_bias")}


def _reads_interleaved_rope(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "config.json").read_text()).get("rope_interleave", True))
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{folder}/config.json is not readable JSON: {exc}") from exc


def _deinterleave_rope(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """DeepSeek's rope_interleave rotates pairs (x0, x1), (x2, x3), ...; fivefold rotates halves. Reordering the
    RoPE rows of the query and key projections as [x0, x2, ..., x1, x3, ...] makes the two the same attention
    (transformers' interleaved rotation returns exactly that order)."""
    rope = config.qk_rope_head_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
        per_head = tensor.view(config.n_heads, -1, tensor.shape[-1])
        nope = per_head.shape[1] - rope
        return torch.cat([per_head[:, :nope], per_head[:, nope:][:, order]], dim=1).reshape(tensor.shape)
    if name.endswith("attention.wkv_a.weight"):
        return torch.cat([tensor[: config.kv_lora_rank], tensor[config.kv_lora_rank :][order]])
    return tensor


def load_hf(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """A fivefold Transformer holding the weights of a local Hugging Face folder of a supported family."""
    config = read_hf_config(folder)
    model = materialize(build_model(config), device, seed=None).to(dtype)
    load_hf_weights(model, folder)
    return model


def save_hf(model: Transformer, folder: str | Path, dtype: torch.dtype | None = None, tokenizer=None) -> Path:
    """Write config.json and model.safetensors that the family's transformers class (`hf_family`) reads.

    Atomically (assembled in a temporary folder, then renamed), readable by everyone (0644), with a
    checksummed manifest (EXPORT_MANIFEST, reliability/manifest.py) that `load_hf` and `fivefold verify`
    check. A folder that exists and is not an earlier fivefold export is never overwritten.
    """
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not (folder / EXPORT_MANIFEST).is_file():
        raise CheckpointError(f"{folder} exists and is not a fivefold export: choose a new or empty folder")
    tmp = folder.with_name(f".tmp-{folder.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state = model.state_dict()
    dtype = dtype or next(iter(state.values())).dtype
    family = hf_family(model.config)
    if family == "deepseek_v3":
        state.update(_expert_biases(model))
    tensors = {fivefold_to_hf_name(k, family): v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype, tokenizer), indent=2))
    if tokenizer is not None:
        tokenizer.save(tmp)
    write_manifest(tmp, {"format": "hf-export-1", "written_at": time.time()}, name=EXPORT_MANIFEST)
    readable_tree(tmp)
    old = folder.with_name(f".old-{folder.name}")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder
