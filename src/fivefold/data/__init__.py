"""Corpus discovery, tokenizers, pre-tokenised token files and the resumable sampler."""
