"""Corpus, tokenizers, token files and the sampler."""

import json

import numpy as np
import pytest

from fivefold.config import DataConfig
from fivefold.data.corpus import is_validation, list_source_files, split_documents, stdlib_root
from fivefold.data.dataset import (
    HEADER_BYTES,
    eval_batches,
    prepare_data,
    read_token_file,
    sample_batch,
    token_dtype,
    unigram_cross_entropy,
    write_token_file,
)
from fivefold.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer_from
from fivefold.errors import DataError


def test_stdlib_corpus_is_found_and_split_by_file():
    files = list_source_files("stdlib")
    assert len(files) > 500
    assert all(f.path.suffix == ".py" and f.path.is_relative_to(stdlib_root()) for f in files)
    assert not any("site-packages" in f.key for f in files)
    val = [f.key for f in files if is_validation(f.key, 0.05)]
    assert 0.02 < len(val) / len(files) < 0.08
    assert val == [f.key for f in list_source_files("stdlib") if is_validation(f.key, 0.05)]  # deterministic


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def héllo():\n    return 'ü'\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.decode([*tok.encode("a"), tok.eos_id]) == "a"


def test_bpe_trains_saves_and_loads(tmp_path, corpus_dir):
    files = list_source_files(str(corpus_dir))
    train, _ = split_documents(files, 0.2)
    tok = BPETokenizer.train(train, vocab_size=400)
    assert tok.vocab_size <= 400
    text = "def model(12) = token_3\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges happened
    assert tok.decode(ids) == text
    tok.save(tmp_path)
    again = load_tokenizer_from(tmp_path)
    assert again.encode(text) == ids and again.eos_id == tok.eos_id


def test_token_file_round_trip_and_dtype(tmp_path):
    tokens = np.arange(1000) % 300
    write_token_file(tmp_path / "t.bin", tokens, vocab_size=300)
    loaded = read_token_file(tmp_path / "t.bin", expected_vocab=300)
    assert loaded.dtype == np.uint16 and np.array_equal(loaded, tokens)
    assert token_dtype(70000) == np.uint32


def test_truncated_token_file_is_an_error(tmp_path):
    write_token_file(tmp_path / "t.bin", np.arange(100), vocab_size=257)
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-10])
    with pytest.raises(DataError, match="truncated"):
        read_token_file(tmp_path / "t.bin")
    (tmp_path / "t.bin").write_bytes(data[: HEADER_BYTES - 1])
    with pytest.raises(DataError, match="truncated"):
        read_token_file(tmp_path / "t.bin")


def test_corrupted_or_mismatched_token_file_is_an_error(tmp_path):
    write_token_file(tmp_path / "t.bin", np.arange(100), vocab_size=257)
    with pytest.raises(DataError, match="vocabulary size 257 but the tokenizer has 4096"):
        read_token_file(tmp_path / "t.bin", expected_vocab=4096)
    data = bytearray((tmp_path / "t.bin").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "t.bin").write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum"):
        read_token_file(tmp_path / "t.bin")
    with pytest.raises(DataError, match="does not fit"):
        write_token_file(tmp_path / "u.bin", np.array([5, 300]), vocab_size=257)


def test_prepare_data_caches_and_rebuilds_after_damage(tmp_path, corpus_dir):
    config = DataConfig(source=str(corpus_dir), cache_dir=str(tmp_path), val_fraction=0.2)
    first = prepare_data(config)
    assert first.train_tokens[-1] == first.tokenizer.eos_id
    n_docs = int((np.asarray(first.train_tokens) == 256).sum() + (np.asarray(first.val_tokens) == 256).sum())
    assert n_docs == 40
    again = prepare_data(config)
    assert np.array_equal(first.train_tokens, again.train_tokens)
    first.train_path.write_bytes(first.train_path.read_bytes()[:-4])
    with pytest.raises(DataError, match="delete"):
        prepare_data(config)


def test_user_jsonl_and_txt_sources(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": f"record {i} " * 20}) for i in range(50)))
    (tmp_path / "b.txt").write_text("plain text file " * 50)
    data = prepare_data(DataConfig(source=f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.txt'}", cache_dir=str(tmp_path / "c"), val_fraction=0.2))
    expected = sum(len(f"record {i} " * 20) + 1 for i in range(50)) + len("plain text file " * 50) + 1
    assert len(data.train_tokens) + len(data.val_tokens) == expected  # every record and file, each + end-of-text
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match="no 'text' field"):
        prepare_data(DataConfig(source=str(tmp_path / "bad.jsonl"), cache_dir=str(tmp_path / "c")))
    with pytest.raises(DataError, match="does not exist"):
        list_source_files(str(tmp_path / "missing"))


def test_bpe_tokenizer_through_prepare_data(tmp_path, corpus_dir):
    config = DataConfig(source=str(corpus_dir), cache_dir=str(tmp_path), tokenizer="bpe", bpe_vocab_size=300, val_fraction=0.2)
    data = prepare_data(config)
    assert data.tokenizer.kind == "bpe" and data.tokenizer.vocab_size == 300
    assert len(list(tmp_path.glob("bpe-*.json"))) == 1
    path_config = DataConfig(source=str(corpus_dir), cache_dir=str(tmp_path), tokenizer=str(next(tmp_path.glob("bpe-*.json"))), val_fraction=0.2)
    assert np.array_equal(prepare_data(path_config).train_tokens, data.train_tokens)


def test_sampler_is_pure_and_splits_the_global_batch():
    tokens = np.arange(10_000) % 257
    x1, y1 = sample_batch(tokens, 16, 4, seed=1, step=7)
    x2, _ = sample_batch(tokens, 16, 4, seed=1, step=7)
    assert np.array_equal(x1, x2) and np.array_equal(x1[:, 1:], y1[:, :-1])
    assert not np.array_equal(x1, sample_batch(tokens, 16, 4, seed=1, step=8)[0])
    whole = sample_batch(tokens, 16, 8, seed=1, step=7)[0]
    halves = [sample_batch(tokens, 16, 4, seed=1, step=7, micro_step=i, grad_accum_steps=2)[0] for i in range(2)]
    assert np.array_equal(whole, np.concatenate(halves))
    ranks = [sample_batch(tokens, 16, 2, 1, 7, micro_step=m, grad_accum_steps=2, dp_rank=r, dp_size=2)[0] for m in range(2) for r in range(2)]
    assert np.array_equal(whole, np.concatenate(ranks))


def test_eval_batches_fixed_and_unigram_baseline():
    tokens = np.arange(5000) % 257
    a, b = eval_batches(tokens, 16, 2, 3), eval_batches(tokens, 16, 2, 3)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(a, b))
    uniform = unigram_cross_entropy(tokens, tokens, 257)
    assert uniform == pytest.approx(np.log(257), rel=1e-3)
    assert unigram_cross_entropy(np.zeros(1000), np.zeros(10), 257) < 0.3
