"""Write a small random Hugging Face model folder, as a stand-in for a downloaded checkpoint.

    python examples/tiny_hf_model.py runs/tiny-qwen3 --family qwen3

The folder has what a published checkpoint has: config.json, model.safetensors, and a tokenizer
(tokenizer.json, tokenizer_config.json with a chat template, special_tokens_map.json) — a
byte-level BPE trained on a few modules of the Python standard library, with Llama 3 style
special tokens (<|begin_of_text|> added in front of every text, <|end_of_text|> as the end of a
document). The model is random: built by the installed `transformers` from a small config of the
chosen family. Nothing is downloaded. Needs `pip install transformers`.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
SHAPES = {  # each family's own options, on a model of a few hundred thousand parameters
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=64)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=24, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # multi-latent attention, grouped routing
        num_key_value_heads=4, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16)),
}


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE with the special tokens, trained on a few standard-library modules."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def make_tiny_hf_model(folder: str | Path, family: str = "llama", seed: int = 0) -> Path:
    import torch
    import transformers

    folder = Path(folder)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        chat_template=CHAT_TEMPLATE)
    config_class, model_class, changes = SHAPES[family]
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = getattr(transformers, config_class)(**{**shape, **changes})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # a trained DeepSeek-V3's selection bias is not zero, as a fresh one is
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--family", default="llama", choices=list(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {make_tiny_hf_model(args.folder, args.family, args.seed)} ({SHAPES[args.family][1]}, random weights)")
