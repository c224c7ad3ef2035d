"""Roles of the ranks of a run, each with its own entry point.

    trainer   runs the training loop (train/trainer.py): every rank, except
    server    with parameter servers (parallel.dp_mode = ps) the last ps_servers ranks, which hold
              parameter shards and their optimizer and answer pushes and pulls until the workers'
              last step (parallel/parameter_server.py); they build the model only to take their
              shards of its initial weights

`run(config)` is what `fivefold train` and `python -m fivefold.train` call in every rank: it builds
the mesh (the groups of both roles, in the same order on every rank) and starts the rank's role.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.config import JobConfig
from fivefold.parallel.mesh import Mesh, build_mesh
from fivefold.parallel.parameter_server import ServerLayout, serve
from fivefold.train.distributed import init_distributed, local_device


@dataclass
class ServerResult:
    """What a server rank reports when the workers are done."""

    server: int
    clock_log: list[tuple[int, list[int]]]


def build_mesh_for(config: JobConfig, world_size: int, device: torch.device) -> Mesh:
    """The run's mesh: the parallel grid over every rank, or the workers' and servers' groups."""
    par = config.parallel
    if par.dp_mode == "ps":
        par.workers(world_size)  # enough ranks for workers and servers, or a clear error
        return Mesh.for_parameter_server(world_size, par.ps_servers)
    return build_mesh(par.dims(world_size), device.type)


def run_server(config: JobConfig, mesh: Mesh, rank: int, device: torch.device) -> ServerResult:
    """A server rank: its shards of the initial weights, then serve every worker's steps."""
    from fivefold.model import build_model, materialize
    from fivefold.train.trainer import prepare_data_once, resolve_model_config

    par, workers = config.parallel, mesh.dims.world_size
    data = prepare_data_once(config, workers + par.ps_servers, is_rank0=False)
    model_config = resolve_model_config(config.model, data.tokenizer.vocab_size)
    torch.manual_seed(config.train.seed)
    model = materialize(build_model(model_config), device, seed=config.train.seed)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    layout = ServerLayout.balance(sizes, workers, par.ps_servers)
    index = rank - workers
    clock_log = serve(model, layout, index, config.optim, config.train.steps, par.ps_sync, par.ps_staleness,
                      config.train.max_grad_norm, mesh.group("servers"))
    return ServerResult(index, clock_log)


def run(config: JobConfig):
    """Start this rank's role: a TrainResult from trainer ranks, a ServerResult from parameter servers."""
    from fivefold.train.trainer import Trainer, resolve_device

    device = resolve_device(config.train.device)
    env = init_distributed(device)
    device = local_device(device, env)
    mesh = build_mesh_for(config, env.world_size, device)
    if env.rank >= mesh.dims.world_size:
        return run_server(config, mesh, env.rank, device)
    return Trainer(config, mesh=mesh).fit()
