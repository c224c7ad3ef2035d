"""The command-line way in and out for published checkpoints: `train --init-from-hf`, `convert --from-hf`,
`convert --checkpoint` back, with the folder's tokenizer (and its chat template) kept unchanged.

The "published" folders are written by examples/tiny_hf_model.py: a random transformers model of
one family and a BPE tokenizer with Llama 3 style special tokens and a chat template.
"""

import json
import runpy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fivefold.cli import main  # noqa: E402
from fivefold.config import load_config  # noqa: E402
from fivefold.data.tokenizer import BPETokenizer  # noqa: E402
from fivefold.errors import ConfigError, DataError  # noqa: E402
from fivefold.model.hf import load_hf  # noqa: E402
from fivefold.train.checkpoint import read_weights  # noqa: E402
from fivefold.train.import_hf import import_hf, resumable_config  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402

EXAMPLE = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "tiny_hf_model.py"))
make_tiny_hf_model = EXAMPLE["make_tiny_hf_model"]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "qwen3", "qwen3")


def _overrides(tmp_path, corpus_dir, **extra) -> list[str]:
    values = {"data.source": corpus_dir, "data.cache_dir": tmp_path / "cache", "data.val_fraction": 0.2, "train.seq_len": 32,
              "train.micro_batch_size": 4, "train.steps": 2, "train.eval_every": 0, "train.output_dir": tmp_path / "run",
              "logging.progress": "false", "logging.tensorboard": "false", "logging.plot": "false",
              "logging.sample_prompt": "", **extra}
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def test_init_from_hf_takes_weights_model_and_tokenizer(tmp_path, corpus_dir, qwen3_folder):
    config = load_config(None, _overrides(tmp_path, corpus_dir, **{"model.init_from_hf": qwen3_folder,
                                                                   "model.max_seq_len": 64}))
    assert config.data.tokenizer == str(qwen3_folder)
    assert (config.model.qk_norm, config.model.head_dim, config.model.max_seq_len) == ("head", 24, 64)
    trainer = Trainer(config)
    reference = load_hf(qwen3_folder)
    for name, value in reference.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name].cpu(), value), name
    # the data were tokenised with the folder's tokenizer: documents start with its BOS and end with its EOS
    tokenizer = trainer.data.tokenizer
    config_json = json.loads((qwen3_folder / "tokenizer_config.json").read_text())
    assert tokenizer.eos_id == tokenizer._tok.token_to_id(config_json["eos_token"])
    tokens = trainer.data.train_tokens
    assert int(tokens[0]) == tokenizer.bos_id
    assert (tokens == tokenizer.eos_id).sum() > 0
    result = trainer.fit()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # unchanged, byte for byte
        assert (result.checkpoint / name).read_bytes() == (qwen3_folder / name).read_bytes(), name


def test_model_settings_given_with_init_from_hf_must_agree(tmp_path, corpus_dir, qwen3_folder):
    agreeing = _overrides(tmp_path, corpus_dir, **{"model.init_from_hf": qwen3_folder, "model.head_dim": 24})
    assert load_config(None, agreeing).model.head_dim == 24
    with pytest.raises(ConfigError, match=r"model.dim = 48 conflicts with .*config.json, which gives 64"):
        load_config(None, _overrides(tmp_path, corpus_dir, **{"model.init_from_hf": qwen3_folder, "model.dim": 48}))
    with pytest.raises(ConfigError, match="model.preset and model.init_from_hf"):
        load_config(None, _overrides(tmp_path, corpus_dir, **{"model.init_from_hf": qwen3_folder, "model.preset": "tiny"}))
    with pytest.raises(ConfigError, match="no such folder"):
        load_config(None, _overrides(tmp_path, corpus_dir, **{"model.init_from_hf": tmp_path / "absent"}))


def test_convert_from_hf_train_and_export_back(tmp_path, corpus_dir, qwen3_folder, capsys):
    run_dir = tmp_path / "imported"
    assert main(["convert", "--from-hf", str(qwen3_folder), "--to", str(run_dir), *_overrides(tmp_path, corpus_dir)]) == 0
    assert "fivefold train --config" in capsys.readouterr().out
    weights = read_weights(run_dir / "step-000000")
    for name, value in load_hf(qwen3_folder).state_dict().items():
        assert torch.equal(weights[name], value), name
    config = resumable_config(run_dir)
    assert config.model.init_from_hf == "" and config.checkpoint.resume == "auto"
    result = Trainer(config).fit()
    assert result.steps == 2 and result.checkpoint.name == "step-000002"
    # export: the family's transformers class, the tokenizer files and chat template unchanged
    assert main(["convert", "--checkpoint", str(run_dir), "--to", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (qwen3_folder / name).read_bytes(), name
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    original = transformers.AutoTokenizer.from_pretrained(qwen3_folder)
    chat = [{"role": "user", "content": "def add(a, b):"}]
    assert theirs.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load_hf(out).eval()
    tokens = torch.tensor([theirs("def add(a, b):")["input_ids"]])
    with torch.no_grad():
        assert (model(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5


def test_convert_from_hf_never_overwrites(tmp_path, qwen3_folder):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        import_hf(qwen3_folder, tmp_path / "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "keep me"


def test_missing_and_malformed_tokenizers_are_named(tmp_path, corpus_dir, qwen3_folder):
    folder = tmp_path / "copy"
    folder.mkdir()
    for item in qwen3_folder.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataError, match="tokenizer_config.json is not a readable JSON"):
        BPETokenizer.load(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|no_such_token|>"}))
    with pytest.raises(DataError, match="no end-of-document token"):
        BPETokenizer.load(folder)
    (folder / "tokenizer.json").write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match="not a tokenizer.json"):
        BPETokenizer.load(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="holds no tokenizer.json"):
        load_config(None, _overrides(tmp_path, corpus_dir, **{"model.init_from_hf": folder}))
    with pytest.raises(DataError, match="does not exist"):
        BPETokenizer.load(folder)


def test_deepseek_v3_selection_bias_survives_convert_train_and_export(tmp_path, corpus_dir):
    """DeepSeek-V3's e_score_correction_bias is a buffer, not a weight: it travels in trainer.json from the
    converted checkpoint through training and back into the exported folder, and the export routes like ours."""
    folder = make_tiny_hf_model(tmp_path / "hf", "deepseek_v3")
    run_dir = tmp_path / "imported"
    assert main(["convert", "--from-hf", str(folder), "--to", str(run_dir), *_overrides(tmp_path, corpus_dir)]) == 0
    original = {n: b.clone() for n, b in load_hf(folder).named_buffers() if n.endswith("expert_bias")}
    assert original and all(b.abs().sum() > 0 for b in original.values())
    assert json.loads((run_dir / "step-000000" / "trainer.json").read_text())["expert_bias"]
    result = Trainer(resumable_config(run_dir)).fit()
    assert result.steps == 2
    assert main(["convert", "--checkpoint", str(run_dir), "--to", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    ours = load_hf(out).eval()
    for name, bias in ours.named_buffers():
        if name in original:  # no balancing was asked for: the bias is the folder's, unchanged
            assert torch.equal(bias, original[name]), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5
