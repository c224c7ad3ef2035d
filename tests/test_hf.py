"""Hugging Face interop: a random transformers Llama and its fivefold import give the same logits.

Tolerance: max |logit difference| <= 1e-5 in fp32 (the two implementations order a few
floating-point operations differently); the export -> import round trip is bit-exact.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fivefold.errors import CheckpointError  # noqa: E402
from fivefold.model import build_model, materialize  # noqa: E402
from fivefold.model.hf import load_hf, save_hf  # noqa: E402

from conftest import micro_model  # noqa: E402


def hf_model(tmp_path, tied=False, kv_heads=2):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=128, rope_theta=50000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-inits nothing interesting; perturb norms so they matter too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "hf")
    return model


@pytest.mark.parametrize("tied,kv_heads", [(False, 2), (True, 4), (False, 1)], ids=["GQA", "tied-MHA", "MQA"])
def test_imported_model_gives_same_logits(tmp_path, tied, kv_heads):
    reference = hf_model(tmp_path, tied, kv_heads)
    ours = load_hf(tmp_path / "hf").eval()
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = ours(tokens)
    diff = (expected - got).abs().max().item()
    assert diff <= 1e-5, f"max logit difference {diff}"


def test_round_trip_is_bit_exact(tmp_path):
    hf_model(tmp_path)
    first = load_hf(tmp_path / "hf")
    save_hf(first, tmp_path / "exported")
    second = load_hf(tmp_path / "exported")
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def test_export_loads_in_transformers(tmp_path):
    ours = materialize(build_model(micro_model(vocab_size=80, tie_embeddings=True)), "cpu", seed=5).eval()
    save_hf(ours, tmp_path / "out")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 80, (1, 30))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5


def test_unsupported_configs_are_refused_by_name(tmp_path):
    hf_model(tmp_path)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="RoPE scaling 'llama3'"):
        load_hf(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)
