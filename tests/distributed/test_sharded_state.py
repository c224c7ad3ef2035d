"""ZeRO shards through torch.distributed.checkpoint with uneven and empty shards, resharded on load.

Groups of 5 and 3 elements over 4 shards leave the last shard short or empty (shard sizes
2, 2, 1, 0 and 1, 1, 1, 0); the state saved at 4 ranks must read back whole in one process
and land in the right slices at 3 ranks.
"""

import torch
from torch import nn

from distributed.spawn import run_distributed


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(5, 1, bias=False)})
        self.gain = nn.Parameter(torch.zeros(3))
        with torch.no_grad():
            self.layers["0"].weight.copy_(torch.arange(5.0).view(1, 5))
            self.gain.copy_(torch.tensor([10.0, 11.0, 12.0]))


def _zero(world_size, stage):
    from fivefold.config import OptimConfig
    from fivefold.parallel.mesh import ParallelDims, build_mesh
    from fivefold.optim import build_adamw
    from fivefold.parallel.gradient_sync import GradNorm
    from fivefold.parallel.zero import ZeroDataParallel, ZeroSync
    from fivefold.parallel.zero_groups import ZeroGroups

    mesh = build_mesh(ParallelDims(dp_shard=world_size, world_size=world_size), "cpu")
    zero = ZeroDataParallel(Odd(), ZeroGroups.over(mesh.group("dp_shard"), None, stage), stage)
    optimizer = build_adamw(zero.master_parameters(True), zero.master_parameters(False), OptimConfig())
    sync = ZeroSync(zero, optimizer, GradNorm(), mesh.device_mesh["dp_replicate", "dp_shard_cp"])
    return zero, optimizer, sync


def _save(rank, world_size, folder):
    from fivefold.parallel.checkpoint_layout import PieceRanks
    from fivefold.train.train_state import write_training_state

    zero, optimizer, sync = _zero(world_size, stage=3)
    for g in zero.groups:  # moments that identify their position: exp_avg = 100 + index
        lo, hi = zero.owned_range(g)
        state = optimizer.state[g.master]
        state["step"] = torch.tensor(7.0)
        state["exp_avg"] = torch.zeros_like(g.master)
        state["exp_avg"][: hi - lo] = 100 + torch.arange(lo, hi, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(g.master)
    write_training_state(sync.state_dict(PieceRanks()), folder, distributed=True)
    return [zero.owned_range(g) for g in zero.groups]


def _load(rank, world_size, folder):
    from fivefold.parallel.checkpoint_layout import PieceRanks
    from fivefold.reliability.manifest import Manifest
    from fivefold.train.train_state import restore_sync_state

    zero, optimizer, sync = _zero(world_size, stage=2)
    with torch.no_grad():
        for g in zero.groups:
            g.master.fill_(-1.0)
    restore_sync_state(Manifest.load(folder.parent), sync, PieceRanks())
    return [(g.layout.key, zero.owned_range(g), g.master.tolist(), optimizer.state[g.master]["exp_avg"].tolist(),
             float(optimizer.state[g.master]["step"])) for g in zero.groups], zero.model.layers["0"].weight.tolist()


def test_uneven_shards_save_at_4_and_load_at_3_and_whole(tmp_path):
    from fivefold.parallel.checkpoint_layout import CheckpointLayout
    from fivefold.reliability.manifest import Manifest, write_manifest
    from fivefold.train.train_state import read_consolidated_weights

    folder = tmp_path / "state"
    ranges = run_distributed(_save, 4, folder)
    write_manifest(tmp_path, {"format": 3})  # what the checkpoint writer adds: every file's hash
    assert [r[0] for r in ranges] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # layers.0/decay: the last shard is empty
    layout = {"layers.0/decay": {"names": ["layers.0.weight"], "shapes": [[1, 5]]},
              "gain/no_decay": {"names": ["gain"], "shapes": [[3]]}}
    whole = read_consolidated_weights(Manifest.load(tmp_path), CheckpointLayout.from_json(layout))
    assert whole["layers.0.weight"].tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0]]
    assert whole["gain"].tolist() == [10.0, 11.0, 12.0]

    results = run_distributed(_load, 3, folder)
    for groups, weight in results:
        assert weight == [[0.0, 1.0, 2.0, 3.0, 4.0]]  # masters published to the compute weights
        for key, (lo, hi), master, exp_avg, step in groups:
            values = list(range(5)) if key == "layers.0/decay" else [10, 11, 12]
            n = hi - lo
            assert master[:n] == [float(v) for v in values[lo:hi]] and all(x == 0 for x in master[n:])
            assert exp_avg[:n] == [100.0 + i for i in range(lo, hi)]
            assert step == 7.0
