"""`fivefold train --nproc-per-node N`: run the trainer under torchrun (`torch.distributed.run`).

Single node, rendezvous on loopback (torchrun's `--standalone`). For several nodes call torchrun
(or srun) directly, see docs/launch.md. torchrun's agent watches the workers: when one fails it
stops the others and reports the failed rank's traceback (recorded by
`torch.distributed.elastic.multiprocessing.errors.record` in `fivefold.train.__main__`), so a
crash ends the job instead of leaving the other ranks blocked in a collective.
"""

from __future__ import annotations

import sys


def launch(nproc_per_node: int, train_args: list[str], module: str = "fivefold.train", monitor_interval: float = 0.1) -> int:
    """Run `python -m module train_args...` in nproc_per_node local ranks; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--monitor-interval={monitor_interval}",
        "--max-restarts=0",
        "--module",
        module,
        *train_args,
    ])
    try:
        run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0
