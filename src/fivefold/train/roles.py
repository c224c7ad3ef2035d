"""Roles of the ranks of a run, each with its own entry point.

    trainer   runs the training loop (train/trainer.py): every rank, except
    server    with parameter servers (data_parallel.mode = ps) the last ps_servers ranks, which hold
              parameter shards and their optimizer and answer pushes and pulls until the workers'
              last step (parallel/parameter_server.py); they build the model only to take their
              shards of its initial weights; each reports the most bytes it held (after an update:
              weights, gradients, AdamW states, receive buffers), which the planner's server memory
              is checked against

`run(config)` is what `fivefold train` and `python -m fivefold.train` call in every rank: it caps
the rank's CPU threads, builds the mesh (the groups of both roles, in the same order on every
rank), starts the rank's fault handling (reliability/supervisor.py: heartbeat, watchdog, launcher
lifeline) and then its role. An exception that ends the rank is recorded in the run's event log
and failure.json before it propagates, so `fivefold diagnose` and the launcher can name it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.config import JobConfig
from fivefold.parallel.mesh import Mesh, collective_timeout, mesh_for
from fivefold.parallel.parameter_server import ParameterServer, ServerLayout
from fivefold.parallel.validate import check_config
from fivefold.model import build_model, materialize
from fivefold.reliability.supervisor import Supervisor, shared_attempt_id
from fivefold.train.distributed import init_distributed, local_device
from fivefold.train.memory import measure_model_states
from fivefold.train.rendezvous import wait_for
from fivefold.train.setup import cap_threads, prepare_data_once, resolve_device, resolve_model_config
from fivefold.train.trainer import Trainer


@dataclass
class ServerResult:
    """What a server rank reports when the workers are done."""

    server: int
    clock_log: list[tuple[int, list[int]]]
    peak_bytes: dict[str, int]  # parameters, gradients, optimizer, buffers: measured at the fullest update


def run_server(config: JobConfig, mesh: Mesh, rank: int, device: torch.device, supervisor: Supervisor) -> ServerResult:
    """A server rank: its shards of the initial weights, then serve every worker's steps."""
    ps, workers = config.parameter_server, mesh.dims.world_size
    # not before rank 0 (a worker) has claimed the output folder: a fresh run removes an earlier run's heartbeats and
    # events there, and this rank's would go with them (a race that failed a run's start on 2026-11-26)
    wait_for("output-ready", supervisor.attempt_id, "waiting for rank 0 to claim the output folder")
    supervisor.start(role="server")
    data = prepare_data_once(config, workers + ps.servers, is_rank0=False, key=supervisor.attempt_id)
    model_config = resolve_model_config(config.model, data.tokenizer.vocab_size)
    torch.manual_seed(config.train.seed)
    model = materialize(build_model(model_config), device, seed=config.train.seed)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    layout = ServerLayout.balance(sizes, workers, ps.servers)
    index = rank - workers
    server = ParameterServer(model, layout, index, config.optim, config.train.steps, ps.sync, ps.staleness,
                             config.train.max_grad_norm, mesh.group("servers"))
    peak = {"parameters": 0, "gradients": 0, "optimizer": 0, "buffers": 0}

    def measure() -> None:
        states = measure_model_states(server)
        now = {"parameters": states.parameters, "gradients": states.gradients, "optimizer": states.optimizer,
               "buffers": sum(t.numel() * t.element_size() for t in server.receiving)}
        if sum(now.values()) > sum(peak.values()):
            peak.update(now)

    server.after_update = measure
    clock_log = server.serve()
    supervisor.finish()
    return ServerResult(index, clock_log, peak)


def run(config: JobConfig):
    """Start this rank's role: a TrainResult from trainer ranks, a ServerResult from parameter servers."""
    check_config(config)
    cap_threads(config.train.threads)
    device = resolve_device(config.train.device)
    env = init_distributed(device, collective_timeout(config))
    device = local_device(device, env)
    mesh = mesh_for(config, env.world_size, device.type)
    supervisor = Supervisor(config, config.train.output_dir, env.rank, env.world_size,
                            shared_attempt_id(env.world_size > 1))
    try:
        if env.rank >= mesh.dims.world_size:
            return run_server(config, mesh, env.rank, device, supervisor)
        return Trainer(config, mesh=mesh, supervisor=supervisor).fit()
    except BaseException as exc:
        supervisor.failed(exc)
        raise
