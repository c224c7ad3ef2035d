"""Parameter-server data parallelism (Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter Server").

The last S ranks are servers, the first W workers. Each parameter belongs to one server (largest
first to the least loaded, so shards are balanced); the server keeps it, its AdamW moments and
the learning-rate schedule. A worker computes the gradient of its batch, pushes each server its
parameters' gradients, and pulls the new values back, all over point-to-point messages
(`torch.distributed` send / recv on the default group: push tag 1, pull tag 2).

Consistency models (Ho et al. 2013 for SSP):
    bsp  bulk synchronous: a server waits for every worker's push of step t, sums them in worker
         order, clips by the global norm (the servers sum their squared norms) and steps once.
         With the loss normalised by the global token count this is exactly DDP's update.
    asp  asynchronous: a server applies each push as it arrives (one optimizer step per push, the
         pusher's gradient clipped by the pusher) and answers its pull at once: workers never
         wait for each other, and compute on parameters others have moved since.
    ssp  stale synchronous with bound s: as asp, but a worker that has finished c steps gets its
         pull answered only when the slowest worker has finished at least c - s: no worker runs
         more than s steps ahead. (ssp with s = 0 keeps workers in step but still applies pushes
         one by one.)
In asp and ssp a worker's gradient is the mean over its own tokens, and the learning rate of a
push is the schedule's at the pusher's step. Servers record every worker's clock at each answered
pull (`clock_log`), so tests can check the bound. After each update (gradients set, AdamW stepped,
before the gradients are dropped: the server's fullest moment) it calls `after_update`, if set, which
may read what it holds (`model_state_tensors`, `receiving`): the runtime's measure of a server's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import OptimConfig
from fivefold.errors import CheckpointError
from fivefold.optim import build_adamw, lr_at, set_lr
from fivefold.parallel.checkpoint_layout import PieceRanks
from fivefold.parallel.gradient_sync import GradientSync, GradNorm, clip_, clip_whole_, sum_of_squares, whole_state
from fivefold.plan.memory import ModelStateBytes
from fivefold.reliability.activity import phase

PUSH, PULL = 1, 2
SYNC_MODES = ("bsp", "asp", "ssp")


@dataclass(frozen=True)
class ServerLayout:
    """Workers are ranks 0 .. W-1, servers W .. W+S-1; owner[i] is the server index of parameter i."""

    workers: int
    servers: int
    owner: tuple[int, ...]

    @classmethod
    def balance(cls, sizes: list[int], workers: int, servers: int) -> "ServerLayout":
        load, owner = [0] * servers, [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            target = min(range(servers), key=lambda s: (load[s], s))
            owner[i] = target
            load[target] += sizes[i]
        return cls(workers, servers, tuple(owner))

    def server_rank(self, server: int) -> int:
        return self.workers + server

    def owned(self, server: int) -> list[int]:
        return [i for i, s in enumerate(self.owner) if s == server]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _unflat_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


class ParameterServer:
    """One server rank: holds its parameters and their optimizer, answers pushes and pulls."""

    def __init__(self, model: nn.Module, layout: ServerLayout, index: int, optim: OptimConfig, total_steps: int,
                 sync: str, staleness: int, max_grad_norm: float, server_group: dist.ProcessGroup | None):
        params = [p for p in model.parameters() if p.requires_grad]
        self.layout, self.index, self.optim_config = layout, index, optim
        self.total_steps, self.sync, self.staleness = total_steps, sync, staleness
        self.max_grad_norm, self.server_group = max_grad_norm, server_group
        self.params = [nn.Parameter(params[i].detach().clone()) for i in layout.owned(index)]
        self.numel = sum(p.numel() for p in self.params)
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        self.optimizer = build_adamw(decay, no_decay, optim) if self.params else None
        self.clocks = [0] * layout.workers  # pushes received from each worker
        self.clock_log: list[tuple[int, list[int]]] = []  # (worker answered, every clock then)
        self.receiving: list[torch.Tensor] = []  # the pushes' receive buffers and bsp's sum, while serving
        self.after_update: Callable[[], None] | None = None

    def model_state_tensors(self) -> tuple[list, list, list]:
        """(weights, gradients, AdamW states) held now; the gradients exist only during an update."""
        states = [t for state in (self.optimizer.state.values() if self.optimizer else []) for t in state.values()
                  if isinstance(t, torch.Tensor)]
        return self.params, [p.grad for p in self.params], states

    def _step(self, grad: torch.Tensor, step: int, clip: bool) -> None:
        if self.optimizer is None:
            return
        for p, g in zip(self.params, grad.split([p.numel() for p in self.params])):
            p.grad = g.view_as(p).clone()
        if clip and self.max_grad_norm > 0:
            squared = torch.tensor(sum_of_squares([grad]), dtype=torch.float64)
            if self.server_group is not None:
                dist.all_reduce(squared, group=self.server_group)
            clip_([p.grad for p in self.params], float(squared.sqrt()), self.max_grad_norm)
        set_lr(self.optimizer, lr_at(step, self.optim_config, self.total_steps))
        self.optimizer.step()
        if self.after_update is not None:
            self.after_update()
        self.optimizer.zero_grad(set_to_none=True)

    def _answer(self, worker: int) -> dist.Work:
        self.clock_log.append((worker, list(self.clocks)))
        return dist.isend(_flat([p.detach() for p in self.params]), worker, tag=PULL)

    def serve(self) -> list[tuple[int, list[int]]]:
        """Answer every push of every worker for `total_steps` steps; returns the clock log."""
        if self.sync == "bsp":
            self._serve_bulk_synchronous()
        else:
            self._serve_asynchronous()
        return self.clock_log

    def _serve_bulk_synchronous(self) -> None:
        buffers = [torch.empty(self.numel) for _ in range(self.layout.workers)]
        for step in range(self.total_steps):
            with phase(f"server: waiting for step {step + 1}'s pushes", comm=True):
                for work in [dist.irecv(b, w, tag=PUSH) for w, b in enumerate(buffers)]:
                    work.wait()
            total = buffers[0].clone()
            for b in buffers[1:]:
                total += b
            self.receiving = buffers + [total]
            self._step(total, step, clip=True)
            self.clocks = [step + 1] * self.layout.workers
            for work in [self._answer(w) for w in range(self.layout.workers)]:
                work.wait()

    def _serve_asynchronous(self) -> None:
        bound = self.staleness if self.sync == "ssp" else None
        buffer = torch.empty(self.numel)
        self.receiving = [buffer]
        waiting: list[int] = []  # workers whose pull is held back by the staleness bound
        sends: list[dist.Work] = []
        for _ in range(self.total_steps * self.layout.workers):
            with phase("server: waiting for a push", comm=True):
                worker = dist.recv(buffer, None, tag=PUSH)
            self._step(buffer, self.clocks[worker], clip=False)
            self.clocks[worker] += 1
            waiting.append(worker)
            slowest = min(self.clocks)
            ready = [w for w in waiting if bound is None or self.clocks[w] >= self.total_steps
                     or self.clocks[w] - slowest <= bound]
            for w in ready:
                waiting.remove(w)
                sends.append(self._answer(w))
        for work in sends:
            work.wait()


class ServerClient:
    """A worker's side: push gradients to their servers, pull the new parameters back.

    `bytes_pushed` and `bytes_pulled` count the messages of the last push_pull as sent and received.
    """

    def __init__(self, model: nn.Module, layout: ServerLayout):
        self.layout = layout
        params = [p for p in model.parameters() if p.requires_grad]
        self.shards = [[params[i] for i in layout.owned(s)] for s in range(layout.servers)]
        self.bytes_pushed = self.bytes_pulled = 0

    @torch.no_grad()
    def push_pull(self) -> None:
        """Send every server its parameters' gradients, then take their new values."""
        sends, outgoing = [], []
        for server, shard in enumerate(self.shards):
            grads = _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in shard])
            outgoing.append(grads)
            sends.append(dist.isend(grads, self.layout.server_rank(server), tag=PUSH))
        incoming = [torch.empty(sum(p.numel() for p in shard)) for shard in self.shards]
        receives = [dist.irecv(buf, self.layout.server_rank(s), tag=PULL) for s, buf in enumerate(incoming)]
        with phase("parameter-server push and pull", comm=True):
            for work in sends + receives:
                work.wait()
        self.bytes_pushed = sum(t.numel() * t.element_size() for t in outgoing)
        self.bytes_pulled = sum(t.numel() * t.element_size() for t in incoming)
        for shard, buf in zip(self.shards, incoming):
            _unflat_into(buf, [p.data for p in shard])


class ParameterServerSync(GradientSync):
    """The worker side as a GradientSync: the step is a push of the gradients and a pull of new weights.

    In bsp the servers clip by the global norm and the loss is token-weighted over all workers; in
    asp and ssp each worker's gradient is the mean over its own tokens (no loss group) and the worker
    clips it itself. Workers hold weights and gradients only: the optimizer lives on the servers.
    """

    kind = "ps"
    reports_wire_bytes = True
    can_skip = False  # the servers apply every push; a worker cannot take its step back

    def __init__(self, model: nn.Module, client: ServerClient, sync: str, workers_group: dist.ProcessGroup | None):
        asynchronous = sync != "bsp"
        super().__init__(model, GradNorm(), loss_group=None if asynchronous else workers_group)
        self.client, self.asynchronous, self.sync = client, asynchronous, sync
        self.optimizer = None
        self.reports_grad_norm = asynchronous  # in bsp the servers clip the summed gradient

    def _finish(self) -> None:
        """Nothing to reduce here: the servers sum the workers' pushes."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        if not self.asynchronous:
            return float("nan")  # the servers clip the summed gradient
        return clip_whole_(list(self.model.parameters()), max_norm)

    def step(self, lr: float) -> None:
        """Push, pull; the servers ran AdamW at their own schedule's learning rate."""
        self.client.push_pull()
        self.wire_bytes = self.client.bytes_pushed

    def after_step(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def describe(self) -> str:
        return f"parameter server ({self.sync}), {self.client.layout.servers} server(s), {self.client.layout.workers} workers"

    def expected_model_states(self, parameters: int) -> ModelStateBytes:
        return ModelStateBytes(4 * parameters, 4 * parameters, 0)  # AdamW lives on the servers

    def model_state_tensors(self) -> tuple[list, list, list]:
        params = list(self.model.parameters())
        return params, [p.grad for p in params], []

    def state_dict(self, ranks: PieceRanks, fresh: bool = False) -> dict[str, torch.Tensor]:
        return whole_state(self.model, None, ranks)  # weights; the servers' moments are not saved

    def load_state_dict(self, state: dict[str, torch.Tensor], ranks: PieceRanks) -> None:
        raise CheckpointError("resuming a parameter-server run is not supported: the servers' optimizer states are "
                              "not in checkpoints; resume with dp_mode = ddp or start a new train.output_dir")

    def load_pieces(self, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        self.load_state_dict({}, None)
