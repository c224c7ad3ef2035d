"""A Hugging Face folder converted once (`fivefold convert --from-hf`) resumes in every layout like in one process.

The step-0 checkpoint (the folder's weights, a fresh AdamW) is resumed for 4 steps in one process
and at tp 2 + SP, pp 2 and ZeRO-3 dp 2; losses and final weights agree within the harness's
tolerances. The Llama folder has tied embeddings and Llama 3.1 RoPE scaling; the OLMo 2 folder
post norms and projection q/k norms (examples/tiny_hf_model.py).
"""

import dataclasses
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from fivefold.config import load_config  # noqa: E402
from fivefold.train.import_hf import import_hf, resumable_config  # noqa: E402

from parity.harness import TP_PARAM_ATOL, assert_parity, train_distributed, train_single, with_changes  # noqa: E402

EXAMPLE = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "tiny_hf_model.py"))
LAYOUTS = {
    "tp2-sp": dict(tensor_parallel={"degree": 2, "sequence_parallel": True}),
    "pp2": dict(train={"micro_batch_size": 4, "grad_accum_steps": 2}, pipeline_parallel={"degree": 2}),
    "zero3-dp2": dict(train={"micro_batch_size": 4}, data_parallel={"shard": 2, "zero_stage": 3}),
}


def _init_from_hf_overrides(folder, corpus_dir, tmp_path) -> list[str]:
    """3 steps of micro-batch 8 on the test corpus, from `folder` with `--init-from-hf`, quietly."""
    return ["--model.init_from_hf", str(folder), "--data.source", str(corpus_dir), "--data.cache_dir",
            str(tmp_path / "cache"), "--data.val_fraction", "0.2", "--train.seq_len", "32", "--train.micro_batch_size",
            "8", "--train.steps", "3", "--train.eval_every", "0", "--checkpoint.every", "0", "--optim.lr", "1e-2",
            "--logging.progress", "false", "--logging.tensorboard", "false", "--logging.plot", "false",
            "--logging.sample_prompt", "", "--train.output_dir", str(tmp_path / "single")]


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_converted_folder_resumes_in_every_layout_like_one_process(tmp_path, corpus_dir, family):
    folder = EXAMPLE["make_tiny_hf_model"](tmp_path / "hf", family)
    overrides = ["--data.source", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"), "--data.val_fraction", "0.2",
                 "--train.seq_len", "32", "--train.micro_batch_size", "8", "--train.steps", "4", "--train.eval_every", "0",
                 "--checkpoint.every", "0", "--optim.lr", "1e-2"]
    step0 = import_hf(folder, tmp_path / "imported", None, overrides)
    config = resumable_config(tmp_path / "imported")
    config.logging = dataclasses.replace(config.logging, progress=False, tensorboard=False, plot=False, sample_prompt="")
    config.checkpoint = dataclasses.replace(config.checkpoint, resume=str(step0))
    single = with_changes(config, train={"output_dir": str(tmp_path / "single")})
    reference = train_single(single)
    for name, sections in LAYOUTS.items():
        sections = {key: dict(value) for key, value in sections.items()}
        sections.setdefault("train", {})["output_dir"] = str(tmp_path / name)
        diffs = assert_parity(reference, train_distributed(with_changes(single, **sections), 2), param_atol=TP_PARAM_ATOL)
        print(f"{family} from step 0 at {name}: {diffs}")


def test_init_from_hf_in_each_layout_like_one_process(tmp_path, corpus_dir):
    """`--init-from-hf` without converting: every rank reads the tensors of its own stages (the tied
    Llama embedding on the first and the last pipeline stage) before tensor parallelism cuts them."""
    folder = EXAMPLE["make_tiny_hf_model"](tmp_path / "hf", "llama")
    overrides = _init_from_hf_overrides(folder, corpus_dir, tmp_path)
    single = load_config(None, overrides)
    reference = train_single(single)
    for name in ("tp2-sp", "pp2"):
        sections = {key: dict(value) for key, value in LAYOUTS[name].items()}
        sections.setdefault("train", {})["output_dir"] = str(tmp_path / name)
        diffs = assert_parity(reference, train_distributed(with_changes(single, **sections), 2), param_atol=TP_PARAM_ATOL)
        print(f"init-from-hf llama at {name}: {diffs}")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_folder_trains_at_ep2_like_one_process(tmp_path, corpus_dir, family):
    """A Mixtral / Qwen2-MoE / DeepSeek-V3 folder with `--init-from-hf`: each expert-parallel rank reads only its
    own experts' tensors; 3 steps at EP 2 equal one process (the balancing loss from router_aux_loss_coef;
    DeepSeek-V3's selection bias and group-limited routing from the folder)."""
    folder = EXAMPLE["make_tiny_hf_model"](tmp_path / "hf", family)
    overrides = _init_from_hf_overrides(folder, corpus_dir, tmp_path)
    single = load_config(None, overrides)
    assert single.model.n_experts == 4
    reference = train_single(single)
    config = with_changes(single, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "ep2")},
                          expert_parallel={"degree": 2})
    diffs = assert_parity(reference, train_distributed(config, 2), param_atol=TP_PARAM_ATOL)
    print(f"{family} init_from_hf at ep2: {diffs}")
