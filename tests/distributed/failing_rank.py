"""A torchrun target for tests: rank 1 raises while rank 0 waits in a collective that never completes."""

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(0.5)
        raise RuntimeError("injected failure on rank 1")
    dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins
    os._exit(0)


main()
