"""The chunked LM head + cross-entropy (train.loss_chunk_tokens) reproduces the plain head's training.

Single process with a chunk that does not divide the tokens (100 of 256 per micro-batch), with a
tied head; under vocab-parallel tensor parallelism (tp 2 with sequence parallelism; the micro
model's 257-token vocabulary is padded, and the padding must never be predicted); and on the last
stage of a 2-stage pipeline. Tolerances as for each layout's plain head (harness.py).
"""

from parity.harness import TP_PARAM_ATOL, assert_parity, train_distributed, train_single, with_changes


def test_chunked_head_matches_plain_single_process(base, reference, tmp_path):
    chunked = with_changes(base, train={"loss_chunk_tokens": 100, "output_dir": str(tmp_path / "chunked")})
    print("chunked single:", assert_parity(reference, train_single(chunked)))


def test_chunked_tied_head_matches_plain(base, tmp_path):
    tied = with_changes(base, model={"tie_embeddings": True})
    plain = train_single(with_changes(tied, train={"output_dir": str(tmp_path / "tied")}))
    chunked = with_changes(tied, train={"loss_chunk_tokens": 64, "output_dir": str(tmp_path / "tied-chunked")})
    print("chunked tied:", assert_parity(plain, train_single(chunked)))


def test_chunked_vocab_parallel_head_matches_single_process(base, reference, tmp_path):
    config = with_changes(base, train={"loss_chunk_tokens": 100, "output_dir": str(tmp_path / "tp2")},
                          tensor_parallel={"degree": 2, "sequence_parallel": True})
    print("chunked tp2 sp:", assert_parity(reference, train_distributed(config, 2), param_atol=TP_PARAM_ATOL))


def test_chunked_head_on_the_last_pipeline_stage_matches_single_process(base, reference, tmp_path):
    config = with_changes(base, train={"loss_chunk_tokens": 100, "micro_batch_size": 2, "grad_accum_steps": 4,
                                       "output_dir": str(tmp_path / "pp2")},
                          pipeline_parallel={"degree": 2, "schedule": "1f1b"})
    print("chunked pp2:", assert_parity(reference, train_distributed(config, 2)))
