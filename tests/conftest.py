"""Shared fixtures: a small generated corpus and a micro model, so each test runs in seconds."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from fivefold.config import JobConfig
from fivefold.model import ModelConfig

WORDS = "def class return import self value data train model token layer batch step loss grad".split()


def micro_model(**changes) -> ModelConfig:
    base = ModelConfig(name="micro", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64)
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """40 small text documents of Python-like lines, deterministic."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(40):
        lines = []
        for _ in range(rng.randint(20, 40)):
            lines.append(f"{rng.choice(WORDS)} {rng.choice(WORDS)}_{rng.randint(0, 9)} = {rng.choice(WORDS)}({rng.randint(0, 99)})")
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def job(tmp_path, corpus_dir) -> JobConfig:
    """A JobConfig that trains the micro model on the generated corpus for a few steps, quietly."""
    cfg = JobConfig()
    cfg.model = micro_model()
    cfg.data = dataclasses.replace(cfg.data, source=str(corpus_dir), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    cfg.train = dataclasses.replace(
        cfg.train, steps=6, seq_len=32, micro_batch_size=4, eval_every=3, eval_batches=2, log_every=2,
        output_dir=str(tmp_path / "run"), peak_tflops=1.0,
    )
    cfg.optim = dataclasses.replace(cfg.optim, warmup_steps=2, lr=1e-2)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=3, keep_last=2)
    cfg.logging = dataclasses.replace(cfg.logging, progress=False, tensorboard=False, plot=False, sample_prompt="")
    return cfg.validate()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
