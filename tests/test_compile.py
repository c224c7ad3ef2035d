"""train.compile: each transformer block compiled, same losses as eager, and no recompiles after warm-up.

The first training step compiles the block graph (blocks of one shape share it), the first
evaluation its no_grad twin; from then on dynamo's counters must not move, step after step and
evaluation after evaluation. Losses of the compiled run stay within 1e-5 (relative) of eager fp32
(inductor reorders sums). CPU inductor takes a few seconds per graph here; on CUDA the same blocks
become Triton kernels (tests/test_cuda.py).
"""

import dataclasses

import pytest
import torch

from fivefold.parallel.compile import compiled_graphs
from fivefold.train.trainer import Trainer


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_never_recompile(job, tmp_path):
    torch._dynamo.reset()
    eager = dataclasses.replace(job, train=dataclasses.replace(job.train, output_dir=str(tmp_path / "eager")))
    compiled = dataclasses.replace(job, train=dataclasses.replace(job.train, compile=True,
                                                                  output_dir=str(tmp_path / "compiled")))
    reference = Trainer(eager)
    expected = [reference.train_step()["loss"] for _ in range(4)]
    trainer = Trainer(compiled)
    losses = [trainer.train_step()["loss"]]
    trainer.evaluate()
    warm = compiled_graphs()
    assert warm >= 2, "the block graph was not compiled for training and for evaluation"
    losses += [trainer.train_step()["loss"] for _ in range(3)]
    trainer.evaluate()
    assert compiled_graphs() == warm, "dynamo recompiled after the first step and evaluation"
    assert losses == pytest.approx(expected, rel=1e-5)
