"""The training state as a torch.distributed.checkpoint (DCP) state dict, the same for every layout.

Weights and AdamW state are stored per flat group (parallel/flat_groups.py), unpadded, in fp32:
    model/<group>              weights, the group's parameters flattened and concatenated
    optim/<group>/exp_avg      AdamW first moment, same layout
    optim/<group>/exp_avg_sq   AdamW second moment
    optim/<group>/step         AdamW step count (a scalar)
Under ZeRO each rank contributes only its shard, as a DTensor sharded along dp_shard x cp (uneven
last shard allowed) and replicated along dp_replicate, and DCP writes the shards in parallel
with no gather; the fp32 masters are the weights. Without ZeRO every rank holds whole tensors
and DCP writes each once. On load DCP reads whatever each rank's tensors cover, which is what
makes resharding work: a checkpoint saved with ZeRO at dp_shard = 4 resumes at dp_shard = 2,
under DDP, or in one process, and a DDP checkpoint resumes under ZeRO.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fivefold.parallel.flat_groups import GroupLayout, flatten, flat_group_layout, unflatten
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.tensor_parallel import tp_spec
from fivefold.parallel.zero import ZeroDataParallel

MOMENTS = ("exp_avg", "exp_avg_sq")


def _step_tensor(value: float) -> torch.Tensor:
    # torch.optim.AdamW keeps a float32 CPU scalar per parameter unless capturable/fused
    return torch.tensor(float(value), dtype=torch.float32)


def _keys(group: str) -> dict[str, str]:
    """DCP keys of a group; `group` carries the tensor-parallel prefix (`tp1/layers.0/decay`) when tp > 1."""
    return {"model": f"model/{group}", **{m: f"optim/{group}/{m}" for m in MOMENTS}, "step": f"optim/{group}/step"}


@contextlib.contextmanager
def _single_process():
    """DCP warns on every single-process save/load; that is our intent, not a problem."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write_training_state(state: dict[str, torch.Tensor], folder: Path, distributed: bool,
                         group: dist.ProcessGroup | None = None) -> None:
    """Write this rank's part of the state into `folder` (collective over `group` when distributed)."""
    with _single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=not distributed, process_group=group)


def checkpoint_layout(model: nn.Module, prefix: str = "") -> dict[str, dict]:
    """group -> (names, shapes, tensor-parallel split of each), written beside the state.

    With tensor parallelism every TP rank has its own groups, keyed with its prefix (`tp1/`),
    and the splits say how to put the pieces back together (`read_consolidated_weights`).
    """
    params = dict(model.named_parameters())
    out = {}
    for group in flat_group_layout(model):
        specs = [tp_spec(params[name]) for name in group.names]
        out[prefix + group.key] = {**group.to_json(), "tp": [s.to_json() if s else None for s in specs]}
    return out


# ------------------------------------------------------------------ without ZeRO: whole tensors
def _whole_state(model: nn.Module, optimizer: torch.optim.Optimizer, prefix: str) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    out = {}
    for group in flat_group_layout(model):
        members = [params[name] for name in group.names]
        states = [optimizer.state.get(p, {}) for p in members]
        keys = _keys(prefix + group.key)
        out[keys["model"]] = flatten(members)
        for moment in MOMENTS:
            out[keys[moment]] = flatten([s.get(moment, torch.zeros_like(p)) for s, p in zip(states, members)])
        out[keys["step"]] = _step_tensor(max((float(s["step"]) for s in states if "step" in s), default=0.0))
    return out


@torch.no_grad()
def _load_whole(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, prefix: str) -> None:
    state = _whole_state(model, optimizer, prefix)  # buffers of the right shapes, filled in place by DCP
    with _single_process():
        dcp.load(state, checkpoint_id=str(folder / "state"), no_dist=True)
    params = dict(model.named_parameters())
    for group in flat_group_layout(model):
        keys = _keys(prefix + group.key)
        moments = {m: unflatten(group, state[keys[m]]) for m in MOMENTS}
        for name, value in unflatten(group, state[keys["model"]]).items():
            param = params[name]
            param.copy_(value)
            optimizer.state[param] = {"step": _step_tensor(state[keys["step"]]),
                                      **{m: moments[m][name].to(param.device, param.dtype).clone() for m in MOMENTS}}


# ---------------------------------------------------------------------- ZeRO: this rank's shards
def _sharded_state(zero: ZeroDataParallel, optimizer: torch.optim.Optimizer, mesh: Mesh, prefix: str,
                   fresh: bool = False) -> dict[str, torch.Tensor]:
    """DTensors over (dp_replicate, dp_shard x cp) wrapping this rank's unpadded shard of every group.

    With `fresh`, the local tensors are new zero buffers for DCP to load into.
    """
    device_mesh = mesh.device_mesh["dp_replicate", "dp_shard_cp"]  # ZeRO shards over dp_shard x cp
    out = {}
    for g in zero.groups:
        lo, hi = zero.owned_range(g)
        n = hi - lo
        state = optimizer.state.get(g.master, {})
        keys = _keys(prefix + g.layout.key)
        locals_ = {"model": g.master.detach()[:n]}
        for moment in MOMENTS:
            locals_[moment] = state[moment][:n] if moment in state else torch.zeros(n)
        for name, local in locals_.items():
            local = torch.zeros(n, dtype=torch.float32, device=zero.device) if fresh else local.to(zero.device)
            out[keys[name]] = DTensor.from_local(local, device_mesh, [Replicate(), Shard(0)], run_check=False,
                                                 shape=(g.numel,), stride=(1,))
        out[keys["step"]] = _step_tensor(0.0 if fresh else float(state.get("step", 0.0)))
    return out


@torch.no_grad()
def _load_sharded(folder: Path, zero: ZeroDataParallel, optimizer: torch.optim.Optimizer, mesh: Mesh,
                  prefix: str) -> None:
    state = _sharded_state(zero, optimizer, mesh, prefix, fresh=True)
    dcp.load(state, checkpoint_id=str(folder / "state"))
    for g in zero.groups:
        keys = _keys(prefix + g.layout.key)
        n = zero.owned_range(g)[1] - zero.owned_range(g)[0]

        def padded(key: str) -> torch.Tensor:
            out = torch.zeros_like(g.master)
            out[:n] = state[key].to_local()
            return out

        g.master.copy_(padded(keys["model"]))
        optimizer.state[g.master] = {"step": _step_tensor(state[keys["step"]]), **{m: padded(keys[m]) for m in MOMENTS}}
    zero.publish_masters()


# -------------------------------------------------------------------------------- public entry
def capture_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, zero: ZeroDataParallel | None,
                           mesh: Mesh | None, prefix: str = "") -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint state dict (every rank of a distributed run calls DCP with it)."""
    return _sharded_state(zero, optimizer, mesh, prefix) if zero is not None else _whole_state(model, optimizer, prefix)


def restore_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                           zero: ZeroDataParallel | None, mesh: Mesh | None, prefix: str = "") -> None:
    """Load weights and AdamW state saved under any data-parallel layout into this one (collective under ZeRO)."""
    if zero is not None:
        _load_sharded(folder, zero, optimizer, mesh, prefix)
    else:
        _load_whole(folder, model, optimizer, prefix)


def _tp_rank(key: str) -> tuple[int, str]:
    head, _, rest = key.partition("/")
    return (int(head[2:]), rest) if head.startswith("tp") and head[2:].isdigit() else (0, key)


def consolidated_shapes(layout: dict[str, dict]) -> dict[str, list[int]]:
    """Each parameter's full shape, tensor-parallel pieces put back together."""
    shapes = {}
    for key, entry in layout.items():
        for name, shape, spec in zip(entry["names"], entry["shapes"], entry.get("tp") or [None] * len(entry["names"])):
            full = list(shape)
            if spec and spec["dim"] is not None:
                full[spec["dim"]] = spec["size"]
            shapes[name] = full
    return shapes


def read_consolidated_weights(folder: Path, layout: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Every parameter whole, fp32, from a checkpoint saved under any layout; one process, no group."""
    reader = dcp.FileSystemReader(str(folder / "state"))
    stored = reader.read_metadata().state_dict_metadata
    flats = {f"model/{key}": torch.empty(stored[f"model/{key}"].size, dtype=torch.float32) for key in layout}
    with _single_process():
        dcp.load(flats, storage_reader=reader, no_dist=True)
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    specs: dict[str, dict | None] = {}
    for key, entry in layout.items():
        rank, local_key = _tp_rank(key)
        group = GroupLayout(local_key, 0, False, tuple(entry["names"]), tuple(torch.Size(s) for s in entry["shapes"]))
        for (name, tensor), spec in zip(unflatten(group, flats[f"model/{key}"]).items(),
                                        entry.get("tp") or [None] * len(entry["names"])):
            pieces.setdefault(name, {})[rank] = tensor
            specs[name] = spec
    out = {}
    for name, by_rank in pieces.items():
        spec = specs[name]
        if spec is None or spec["dim"] is None:
            out[name] = by_rank[min(by_rank)].clone()
        else:
            whole = torch.cat([by_rank[r] for r in spec["ranks"]], dim=spec["dim"])
            out[name] = whole.narrow(spec["dim"], 0, spec["size"]).clone()
    return out
