"""Checkpoint layout as structured data: which flat group, which tensor-parallel piece, which state.

Every tensor a checkpoint stores is named by a `ShardKey` (a flat group of parallel/flat_groups.py
and, with tensor parallelism, the TP rank whose piece it is) and a kind:
    model/<piece>              weights of the group, flattened and concatenated, fp32
    optim/<piece>/exp_avg      AdamW first moment, same layout
    optim/<piece>/exp_avg_sq   AdamW second moment
    optim/<piece>/step         AdamW step count (a scalar)
where <piece> is `layers.3/decay`, or `tp1/layers.3/decay` for TP rank 1's piece when tp > 1. An
expert's group, `layers.3.feed_forward.experts.5/decay`, never carries a TP rank (tensor parallelism
leaves routed experts whole); with expert tensor parallelism it carries the ETP rank instead:
`etp1/layers.3.feed_forward.experts.5/decay`. `PieceRanks` picks the right one for each group.
Pipeline stages need no key of their own: groups are named by the modules they hold, which
keep their global names on whichever stage holds them, so any pp degree reads any other's keys.

`CheckpointLayout` is layout.json: for every piece, its parameters' names, local shapes and TP
(or ETP) split (`TPSpec`: split dimension, ranks holding distinct pieces, unpadded full size). From it
a reader can put every parameter back together (`consolidate`) and cut any other degree's piece
out of it (`tp_piece`), which is how a checkpoint resumes at a different tp or etp. This module is
the only place that writes or parses those names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivefold.errors import CheckpointError
from fivefold.parallel.flat_groups import GroupLayout, flat_group_layout, is_expert_group
from fivefold.parallel.tensor_parallel import TPSpec, tp_spec

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("model", *MOMENTS, "step")


@dataclass(frozen=True, order=True)
class ShardKey:
    """One flat group's piece: the group key and the rank whose piece it is (None when held whole):
    the tensor-parallel rank for a dense group, the expert-tensor-parallel rank for an expert's."""

    group: str
    tp_rank: int | None = None

    @property
    def name(self) -> str:
        if self.tp_rank is None:
            return self.group
        return f"{'etp' if is_expert_group(self.group) else 'tp'}{self.tp_rank}/{self.group}"

    @classmethod
    def parse(cls, name: str) -> "ShardKey":
        head, _, rest = name.partition("/")
        prefix = "etp" if head.startswith("etp") else "tp"
        if head.startswith(prefix) and head[len(prefix):].isdigit() and rest:
            return cls(rest, int(head[len(prefix):]))
        return cls(name)

    def tensor(self, kind: str) -> str:
        """The state-dict key of one kind of this piece's state."""
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint tensor kind {kind!r}; one of {KINDS}")
        return f"model/{self.name}" if kind == "model" else f"optim/{self.name}/{kind}"


@dataclass(frozen=True)
class PieceRanks:
    """Which piece of each group this rank holds: its TP rank for dense groups, its ETP rank for experts'
    (None: the groups are held whole)."""

    tp: int | None = None
    expert_tp: int | None = None

    def key(self, group: str) -> ShardKey:
        return ShardKey(group, self.expert_tp if is_expert_group(group) else self.tp)


@dataclass(frozen=True)
class PieceEntry:
    """The parameters of one piece: names, this piece's shapes, and how each is split over TP."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    specs: tuple[TPSpec | None, ...]

    def group(self, key: str) -> GroupLayout:
        return GroupLayout(key, 0, False, self.names, self.shapes)

    def to_json(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "tp": [s.to_json() if s else None for s in self.specs]}

    @classmethod
    def from_json(cls, entry: dict) -> "PieceEntry":
        specs = entry.get("tp") or [None] * len(entry["names"])
        return cls(tuple(entry["names"]), tuple(torch.Size(s) for s in entry["shapes"]),
                   tuple(TPSpec(s["dim"], tuple(s["ranks"]), s["size"]) if s else None for s in specs))


@dataclass(frozen=True)
class CheckpointLayout:
    """Every piece of a checkpoint (all TP ranks' and all pipeline stages' groups)."""

    pieces: dict[ShardKey, PieceEntry]

    @property
    def tp(self) -> int:
        """The tensor-parallel degree the dense groups were saved at."""
        ranks = {key.tp_rank for key in self.pieces if key.tp_rank is not None and not is_expert_group(key.group)}
        return max(len(ranks), 1)

    @property
    def etp(self) -> int:
        """The expert-tensor-parallel degree the experts were saved at."""
        ranks = {key.tp_rank for key in self.pieces if key.tp_rank is not None and is_expert_group(key.group)}
        return max(len(ranks), 1)

    def describe(self) -> str:
        units = sorted({key.group.split("/")[0] for key in self.pieces})
        return f"tp {self.tp}{f', etp {self.etp}' if self.etp > 1 else ''}, {len(units)} module groups"

    def merged(self, other: "CheckpointLayout") -> "CheckpointLayout":
        return CheckpointLayout({**self.pieces, **other.pieces})

    def full_shapes(self) -> dict[str, list[int]]:
        """Each parameter's full shape, tensor-parallel pieces put back together."""
        shapes = {}
        for entry in self.pieces.values():
            for name, shape, spec in zip(entry.names, entry.shapes, entry.specs):
                full = list(shape)
                if spec is not None and spec.dim is not None:
                    full[spec.dim] = spec.size
                shapes[name] = full
        return shapes

    def to_json(self) -> dict[str, dict]:
        return {key.name: entry.to_json() for key, entry in self.pieces.items()}

    @classmethod
    def from_json(cls, data: dict[str, dict]) -> "CheckpointLayout":
        try:
            return cls({ShardKey.parse(name): PieceEntry.from_json(entry) for name, entry in data.items()})
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"layout.json is malformed ({exc!r}): the checkpoint is damaged") from exc


def local_layout(model: nn.Module, ranks: PieceRanks = PieceRanks()) -> CheckpointLayout:
    """This rank's pieces: its flat groups, keyed with its TP (ETP) rank when tensor parallelism is on."""
    params = dict(model.named_parameters())
    pieces = {}
    for group in flat_group_layout(model):
        specs = tuple(tp_spec(params[name]) for name in group.names)
        pieces[ranks.key(group.key)] = PieceEntry(group.names, group.shapes, specs)
    return CheckpointLayout(pieces)


def consolidate(pieces_of: dict[str, dict[int | None, torch.Tensor]], specs: dict[str, TPSpec | None]) -> dict[str, torch.Tensor]:
    """Whole tensors from their TP pieces: name -> {tp rank: piece}; padding dropped."""
    out = {}
    for name, by_rank in pieces_of.items():
        spec = specs[name]
        if spec is None or spec.dim is None:
            out[name] = by_rank[min(by_rank, key=lambda r: -1 if r is None else r)].clone()
        else:
            whole = torch.cat([by_rank[r] for r in spec.ranks], dim=spec.dim)
            out[name] = whole.narrow(spec.dim, 0, spec.size).clone()
    return out


def tp_piece(full: torch.Tensor, spec: TPSpec | None, tp: int, tp_rank: int, shape: torch.Size) -> torch.Tensor:
    """The piece of a whole tensor that TP rank `tp_rank` of `tp` holds (zero padding where the split pads)."""
    if spec is None or spec.dim is None:
        return full.reshape(shape).clone()
    length = shape[spec.dim]
    piece = tp_rank // spec.replicas(tp)
    padded_shape = list(full.shape)
    padded_shape[spec.dim] = length * len(spec.ranks)
    padded = full.new_zeros(padded_shape)
    padded.narrow(spec.dim, 0, full.shape[spec.dim]).copy_(full)
    return padded.narrow(spec.dim, piece * length, length).clone()
