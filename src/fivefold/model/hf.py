"""Hugging Face Llama folders (config.json + safetensors) <-> fivefold weights.

Our RoPE uses the same half-split convention as `transformers`' Llama, so conversion is a
renaming of tensors, with no permutation of the query/key projections:
    model.embed_tokens            <-> tok_embeddings
    model.layers.i.self_attn.{q,k,v,o}_proj <-> layers.i.attention.w{q,k,v,o}
    model.layers.i.mlp.{gate,up,down}_proj  <-> layers.i.feed_forward.w{1,3,2}
    model.layers.i.{input,post_attention}_layernorm <-> layers.i.{attention,ffn}_norm
    model.norm <-> norm;  lm_head <-> output (absent when embeddings are tied)
Only what the model can represent is accepted: a config with biases, a non-SiLU activation,
an explicit head_dim that differs from hidden/heads, or RoPE scaling is refused by name.
Exports are atomic, readable (0644) and carry a checksummed manifest (`fivefold-manifest.json`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fivefold.errors import CheckpointError
from fivefold.model.config import ModelConfig
from fivefold.model.llama import Transformer, build_model, materialize
from fivefold.reliability.manifest import EXPORT_MANIFEST, Manifest, readable_tree, write_manifest

_LAYER_MAP = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_MAP = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}


def hf_to_fivefold_name(name: str) -> str:
    stem, _, leaf = name.rpartition(".")
    if stem in _TOP_MAP:
        return f"{_TOP_MAP[stem]}.{leaf}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) >= 4:
        inner = ".".join(parts[3:])
        if inner in _LAYER_MAP:
            return f"layers.{parts[2]}.{_LAYER_MAP[inner]}.{leaf}"
    raise CheckpointError(f"Hugging Face tensor {name!r} has no fivefold counterpart (unsupported architecture?)")


def fivefold_to_hf_name(name: str) -> str:
    stem, _, leaf = name.rpartition(".")
    for hf, ours in _TOP_MAP.items():
        if stem == ours:
            return f"{hf}.{leaf}"
    parts = stem.split(".")
    inner = ".".join(parts[2:])
    for hf, ours in _LAYER_MAP.items():
        if ours == inner:
            return f"model.layers.{parts[1]}.{hf}.{leaf}"
    raise CheckpointError(f"fivefold tensor {name!r} has no Hugging Face counterpart: this model cannot be exported to the HF Llama format")


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type != "default":
        raise CheckpointError(f"RoPE scaling {rope_type!r} in config.json is not supported; fivefold implements plain RoPE")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face Llama config.json dictionary."""
    if hf.get("model_type", "llama") != "llama":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; only 'llama' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise CheckpointError(f"config.json sets {key}; fivefold's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act = {hf['hidden_act']!r}; fivefold's MLP is SwiGLU (silu)")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads):
        raise CheckpointError(f"config.json head_dim = {hf['head_dim']} differs from hidden_size / num_attention_heads")
    config = ModelConfig(
        name=hf.get("_name_or_path") or "hf-llama",
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        ffn_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(hf),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02),
    )
    config.validate()
    return config


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors weights (pickle checkpoints are not loaded, by design)")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return weights


def load_hf(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """A fivefold Transformer holding the weights of a local Hugging Face Llama folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (no config.json)")
    if (folder / EXPORT_MANIFEST).is_file():  # written by save_hf: check every file first
        Manifest.load(folder, EXPORT_MANIFEST, f"export {folder}").verify_all()
    config = config_from_hf(json.loads(config_path.read_text()))
    weights = {hf_to_fivefold_name(k): v for k, v in _read_safetensors(folder).items()}
    if config.tie_embeddings:
        weights.pop("output.weight", None)
    model = materialize(build_model(config), device, seed=None).to(dtype)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{folder} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=True)
    return model


def save_hf(model: Transformer, folder: str | Path, dtype: torch.dtype | None = None, tokenizer=None) -> Path:
    """Write config.json and model.safetensors that `transformers.LlamaForCausalLM.from_pretrained` reads.

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
    tensors = {fivefold_to_hf_name(k): v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype), indent=2))
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
