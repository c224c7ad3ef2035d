"""`python -m fivefold.train ARGS` == `fivefold train ARGS`: the entry point torchrun starts in each rank.

`@record` writes an uncaught exception to torchrun's per-rank error file, so the launcher can
report which rank failed and how.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from fivefold.cli import main


@record
def entry() -> int:
    return main(["train", *sys.argv[1:]])


raise SystemExit(entry())
