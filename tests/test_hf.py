"""Hugging Face interop for five dense and four mixture-of-experts families (DeepSeek-V3 with multi-latent attention): a random transformers model and its fivefold import give
the same logits; export -> import is bit-exact; our export loads in transformers with the same logits
and the same greedy continuation.

Each model is built locally from a small random config by the installed transformers (nothing is
downloaded), with its norms and biases perturbed so that they matter. Tolerance: max |logit
difference| <= 1e-5 in fp32 (the two implementations order a few floating-point operations
differently); the round trip is bit-exact.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fivefold.errors import CheckpointError  # noqa: E402
from fivefold.model import build_model, materialize  # noqa: E402
from fivefold.model.generate import generate  # noqa: E402
from fivefold.model.hf import config_from_hf, fivefold_to_hf_name, hf_family, load_hf, save_hf  # noqa: E402

from conftest import micro_model  # noqa: E402

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, rms_norm_eps=1e-6)
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (transformers class names, config changes); each exercises one family's options.
FAMILIES = {
    "llama-GQA": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "llama-tied-MHA": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-MQA": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "llama3.1-rope": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters=LLAMA31_ROPE)),
    "llama3.2-tied-head_dim": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, head_dim=24, tie_word_embeddings=True,
        rope_parameters={**LLAMA31_ROPE, "factor": 32.0})),
    "llama-biases-linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-llama3-factors": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters={
        **LLAMA31_ROPE, "low_freq_factor": 0.5, "high_freq_factor": 8.0})),
    "llama-yarn-explicit": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048,
        "beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.3})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, use_sliding_window=True,
                                                               sliding_window=8, max_window_layers=0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=24)),
    "qwen3-yarn-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                                                                 rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                                                  "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=4)),
    "olmo2-GQA": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, intermediate_size=48,
                                                            num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=24, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True)),
    # compressed queries, interleaved RoPE rows, 8 experts in 4 groups (2 chosen), a shared expert, the
    # selection bias, routed weights x 2.5, the first layer dense
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12)),
    # queries projected directly, DeepSeek's yarn (mscale and mscale_all_dim), RoPE rows in halves, no grouping
    "deepseek_v3-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_group=1,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 0.707, "mscale_all_dim": 0.9})),
}


def hf_model(folder, name="llama-GQA"):
    config_class, model_class, changes = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**SMALL, **changes})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; perturb them so that they matter
        for param_name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in param_name or param_name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_imported_model_gives_same_logits_and_round_trips(tmp_path, name):
    reference = hf_model(tmp_path / "hf", name)
    ours = load_hf(tmp_path / "hf").eval()
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = ours(tokens)
    diff = (expected - got).abs().max().item()
    assert diff <= 1e-5, f"max logit difference {diff}"
    # export -> import is bit-exact, and the export is the same family
    save_hf(ours, tmp_path / "exported")
    again = load_hf(tmp_path / "exported")
    for (key, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), key
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported["architectures"] == [FAMILIES[name][1]]
    assert again.config == ours.config


@pytest.mark.parametrize("name", ["llama3.1-rope", "qwen2-sliding", "qwen3", "mistral", "olmo2", "mixtral",
                                  "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v3-yarn"])
def test_export_loads_in_transformers_with_same_logits_and_greedy_text(tmp_path, name):
    hf_model(tmp_path / "hf", name)
    ours = load_hf(tmp_path / "hf").eval()
    with torch.no_grad():  # train-like change so that the export is not the file we read
        ours.tok_embeddings.weight.mul_(1.5)
    save_hf(ours, tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == FAMILIES[name][1]
    tokens = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5
        prompt = tokens[:, :12]
        hf_text = theirs.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert hf_text[0, 12:].tolist() == generate(ours, prompt[0].tolist(), 16)


def test_export_of_a_fivefold_model_loads_in_transformers(tmp_path):
    ours = materialize(build_model(micro_model(vocab_size=80, tie_embeddings=True)), "cpu", seed=5).eval()
    save_hf(ours, tmp_path / "out")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 80, (1, 30))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5


def _edit_config(tmp_path, **changes):
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "RoPE scaling 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}}, "RoPE scaling 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
                          "mscale": 1.0, "mscale_all_dim": 1.0}}, "mscale"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gemma2"}, "model_type 'gemma2'"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
      "layer_types": ["full_attention", "sliding_attention"]}, "mixes sliding and full"),
])
def test_unrepresentable_configs_are_refused_by_name(tmp_path, changes, message):
    hf_model(tmp_path / "hf", "qwen2")
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_hf(tmp_path / "hf")


def test_missing_or_extra_tensors_and_folders_are_named(tmp_path):
    hf_model(tmp_path / "hf", "qwen2")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)
    _edit_config(tmp_path, model_type="llama")  # a Qwen2 checkpoint described as a bias-free Llama
    with pytest.raises(CheckpointError, match="bias"):
        load_hf(tmp_path / "hf")


@pytest.mark.parametrize("changes,setting", [
    (dict(norm_position="post"), "qk_norm"),
    (dict(qk_norm="head", attention_bias="qkv"), "attention_bias"),
    (dict(attention_bias="qkv", mlp_bias=True), "mlp_bias"),
    (dict(sliding_window=8, attention_bias="all"), "attention_bias"),
    (dict(n_experts=4, moe_score="sigmoid"), "moe_score"),  # DeepSeek-style routing: no such class here
    (dict(n_experts=4, moe_shared_experts=1), "moe_shared_gate"),  # tiny-moe's ungated shared expert
    (dict(n_experts=4, moe_norm_topk=False), "moe_norm_topk"),
    (dict(n_experts=4, moe_bias_update_rate=0.01), "moe_bias_update_rate"),
])
def test_export_refuses_combinations_no_family_has(changes, setting):
    with pytest.raises(CheckpointError, match=f"model.{setting}"):
        hf_family(micro_model(vocab_size=50, **changes))


def test_moe_layers_other_than_leading_dense_ones_are_refused():
    hf = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
          "intermediate_size": 128, "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "mlp_only_layers": [1, 3]}
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        config_from_hf(hf)
    config = config_from_hf({**hf, "mlp_only_layers": [0], "decoder_sparse_step": 1})
    assert config.moe_layers == [1, 2, 3]


def test_config_from_hf_reads_llama31_scaling():
    config = config_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
                             "intermediate_size": 128, "vocab_size": 10,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             "rope_theta": 500000.0})
    assert (config.rope_scaling, config.rope_factor, config.rope_original_max_seq_len) == ("llama3", 8.0, 8192)
    assert config.rope_theta == 500000.0


def test_sharded_bf16_folder_imports_exactly(tmp_path):
    """Published checkpoints are bf16 and sharded (model.safetensors.index.json): each tensor is read
    from its shard and widened to fp32 exactly."""
    reference = hf_model(tmp_path / "fp32", "qwen3").to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    ours = load_hf(tmp_path / "hf")
    theirs = reference.state_dict()
    for name, value in ours.state_dict().items():
        expected = theirs[fivefold_to_hf_name(name, "qwen3")]
        assert value.dtype == torch.float32 and torch.equal(value, expected.float()), name


def test_deepseek_v3_preset_is_transformers_default_deepseek_v3_shape():
    """transformers' DeepseekV3Config() defaults are DeepSeek-V3's shape (without its YaRN context extension):
    read through config_from_hf they give the deepseek-v3 preset's architecture, routing groups included."""
    from fivefold.model import get_preset

    ours = get_preset("deepseek-v3")
    read = config_from_hf(transformers.DeepseekV3Config().to_dict())
    training = ("name", "max_seq_len", "init_std", "moe_aux_loss", "moe_aux_coeff", "moe_bias_update_rate", "n_kv_heads")
    assert ours.kv_heads == read.kv_heads == 128  # 0 means "as many as query heads"
    rope = [f for f in vars(ours) if f.startswith("rope_") and f != "rope_theta"]
    different = {f: (getattr(ours, f), getattr(read, f)) for f in vars(ours)
                 if f not in (*training, *rope) and getattr(ours, f) != getattr(read, f)}
    assert not different
    assert hf_family(ours) == "deepseek_v3"
