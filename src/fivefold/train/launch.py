"""`fivefold train --nproc-per-node N [--max-restarts R]`: run the trainer under torchrun (`torch.distributed.run`).

Single node, rendezvous on loopback (torchrun's `--standalone`). For several nodes call torchrun
(or srun) directly, see docs/launch.md. torchrun's agent watches the workers: when one fails it
stops the others and, with `--max-restarts R`, starts them again (each new attempt resumes from
the newest verified checkpoint, train/resume.py), up to R times.

Before starting any rank the launcher checks what it can alone: the config, the parallel degrees
against N, the data source, and whether train.output_dir may be used; an error there is one line.
When the job fails it prints a short account instead of torchrun's report (which --debug keeps):
each failed rank's exit code or signal, and the verdict of whoever detected the fault
(`failure.json`: the watchdog naming a hung rank, the guard, or the rank's own error). It also
keeps its own record, `launcher.jsonl`, for `fivefold diagnose`.

Each worker gets FIVEFOLD_LAUNCHER_PID, so it can tell whether this process is still alive (the
lifeline, reliability/lifeline.py: a launcher killed with SIGKILL takes its workers with it), and
OMP_NUM_THREADS = cores / N unless set, so N ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from fivefold.config import JobConfig
from fivefold.errors import EXIT_FAULT, EXIT_INTERNAL, ConfigError
from fivefold.reliability.lifeline import LAUNCHER_ENV

OUR_EXIT_CODES = (2, 3, 4)  # errors.py: bad input, a detected fault, a dead launcher


def check_before_launch(config: JobConfig, nproc_per_node: int) -> None:
    """What can fail before any rank starts: config and degrees, data source, the output folder."""
    from fivefold.data.corpus import list_source_files
    from fivefold.parallel.expert_parallel import check_expert_parallel, token_fiber_size
    from fivefold.parallel.mesh import dims_for
    from fivefold.parallel.nvme_offload import check_nvme_path
    from fivefold.parallel.validate import check_config
    from fivefold.train.resume import plan_start

    check_config(config)
    if config.data_parallel.nvme_path:
        check_nvme_path(config.data_parallel.nvme_path)
    dims = dims_for(config, nproc_per_node)
    if config.data_parallel.mode != "ps":
        ep, tp = config.expert_parallel, config.tensor_parallel
        tokens = token_fiber_size(dims, tp.sequence_parallel and tp.degree > 1)
        check_expert_parallel(config.model, ep.degree, ep.alltoall, tokens, ep.tensor, config.data_parallel.zero_stage)
    if config.data.source != "stdlib":
        list_source_files(config.data.source)
    if config.checkpoint.resume == "none":
        plan = plan_start(config, Path(config.train.output_dir))
        if plan.error:
            raise ConfigError(plan.error)


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _record(output_dir: Path | None, event: str, **fields) -> None:
    if output_dir is None:
        return
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(output_dir / "launcher.jsonl", "a") as handle:
            handle.write(json.dumps({"time": time.time(), "event": event, "pid": os.getpid(), **fields}) + "\n")
    except OSError:
        pass


def launch(nproc_per_node: int, train_args: list[str], module: str = "fivefold.train", max_restarts: int = 0,
           output_dir: str | Path | None = None, debug: bool = False, monitor_interval: float = 0.1) -> int:
    """Run `python -m module train_args...` in nproc_per_node local ranks; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from fivefold.train.setup import available_cores

    out = Path(output_dir) if output_dir is not None else None
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, available_cores() // nproc_per_node)))
    if not debug:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args([
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--monitor-interval={monitor_interval}",
        f"--max-restarts={max_restarts}",
        "--module",
        module,
        *train_args,
    ])
    _record(out, "start", nproc_per_node=nproc_per_node, max_restarts=max_restarts)
    try:
        run(args)
    except ChildFailedError as exc:
        # the cause first: torchrun's SIGTERM of the ranks it stopped afterwards goes last (timestamps are in seconds)
        ordered = sorted(exc.failures.items(),
                         key=lambda item: (item[1].exitcode == -signal.SIGTERM, item[1].timestamp, item[0]))
        failures = {rank: failure.exitcode for rank, failure in ordered}
        _record(out, "failed", failures=failures)
        print(f"fivefold: the job failed{f' after {max_restarts} restart(s)' if max_restarts else ''}: "
              + "; ".join(f"rank {rank} {describe_exit(code)}" for rank, code in failures.items()), file=sys.stderr)
        verdict = _verdict(out)
        first = ordered[0][1]
        if verdict:
            print("\n".join(verdict), file=sys.stderr)
        elif isinstance(first.message, str) and first.message and not first.message.startswith("Signal"):
            print(f"rank {ordered[0][0]}: {first.message.strip().splitlines()[-1][:500]}", file=sys.stderr)
        if debug:
            print(exc.format_msg(), file=sys.stderr)
        elif out is not None:
            print(f"fivefold: `fivefold diagnose {out}` explains the failure; --debug shows torchrun's report",
                  file=sys.stderr)
        code = first.exitcode
        return code if code in OUR_EXIT_CODES else EXIT_FAULT if code < 0 else EXIT_INTERNAL
    _record(out, "finished")
    return 0


def _verdict(output_dir: Path | None) -> list[str]:
    """The lines of the run's failure.json (the detector's account), if one was written."""
    from fivefold.reliability.events import read_failure

    failure = read_failure(output_dir) if output_dir is not None else None
    return list(failure.get("lines", [])) if failure else []
