"""`python -m fivefold.train ARGS` == `fivefold train ARGS`: the entry point torchrun starts in each rank.

The lifeline is armed first, before torch is imported (seconds), so a launcher killed at any time
takes this worker with it. `@record` writes an uncaught exception to torchrun's per-rank error
file, so the launcher can report which rank failed and how.
"""

import sys

from fivefold.reliability import lifeline

lifeline.arm()

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from fivefold.cli import main  # noqa: E402


@record
def entry() -> int:
    return main(["train", *sys.argv[1:]])


raise SystemExit(entry())
