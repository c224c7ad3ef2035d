"""DDP buckets: size from gradient_comm.bucket_mb, reverse registration order, every parameter exactly once."""

import torch
from torch import nn

from fivefold.parallel.data_parallel import make_buckets
from fivefold.train.trainer import Trainer

from distributed.spawn import run_distributed
from parity.harness import with_changes


def test_make_buckets_cap_and_order():
    params = [nn.Parameter(torch.zeros(256)) for _ in range(8)]  # 1 KiB each in fp32
    one = make_buckets(params, bucket_cap_mb=1.0, dtype=None)
    assert len(one) == 1 and one[0].params[0] is params[-1]  # reverse order: last layer first
    small = make_buckets(params, bucket_cap_mb=2048 / 2**20, dtype=None)  # 2 KiB
    assert [len(b.params) for b in small] == [2, 2, 2, 2]
    assert [p for b in small for p in b.params] == params[::-1]
    bf16 = make_buckets(params, bucket_cap_mb=2048 / 2**20, dtype=torch.bfloat16)
    assert [len(b.params) for b in bf16] == [4, 4] and bf16[0].buffer.dtype == torch.bfloat16


def _bucket_counts(rank, world_size, configs):
    return [len(Trainer(c).sync.ddp.buckets) for c in configs]


def test_bucket_mb_reaches_the_trainer(job, tmp_path):
    configs = [with_changes(job, gradient_comm={"bucket_mb": mb}, train={"output_dir": str(tmp_path / str(mb))}) for mb in (25.0, 0.01)]
    counts = run_distributed(_bucket_counts, 2, configs)[0]
    assert counts[0] == 1 and counts[1] > 5
