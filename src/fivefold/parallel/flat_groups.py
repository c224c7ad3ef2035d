"""How parameters are packed into flat groups: one per (unit, weight-decay class).

A unit is one transformer block, or the rest of the model (embedding, final norm, head) as the
`root` unit. Root parameters are grouped by their top-level module as well (`tok_embeddings`,
`norm`, `output`), so that the groups, and with them the checkpoint keys, are the same whichever
pipeline stage holds those modules. Within a group, parameters are flattened and concatenated in
registration order.
ZeRO (parallel/zero.py) pads each group to a multiple of its shard count and splits it; the
checkpoint (train/train_state.py) stores weights and optimizer moments per group, unpadded, so
the same checkpoint loads at any shard count, any ZeRO stage, or without ZeRO. The layout is a
pure function of the model, never of the world size.

Each routed expert of a mixture-of-experts layer is a group of its own (`layers.3.feed_forward.experts.5/decay`),
still in its block's unit: an expert-parallel rank holds only some experts, and naming each by its
global index lets any expert-parallel degree read any other's checkpoint, as pipeline stages do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

@dataclass(frozen=True)
class GroupLayout:
    """One flat group: which parameters, in which order, at which offsets."""

    key: str  # e.g. "layers.3/decay", "norm/no_decay"
    unit: int  # index into units(model); len(units) for the root unit
    decay: bool
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @property
    def offsets(self) -> list[int]:
        out, total = [], 0
        for shape in self.shapes:
            out.append(total)
            total += shape.numel()
        return out

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)

    def to_json(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes]}


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Transformer blocks with their qualified names, in forward order."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return [(f"layers.{name}", block) for name, block in layers.items()]
    return [(f"layers.{i}", block) for i, block in enumerate(layers or [])]


def flat_group_layout(model: nn.Module) -> list[GroupLayout]:
    """The model's flat groups: blocks in forward order, then the root modules in registration order; decay first."""
    blocks = units(model)
    owner = {id(p): index for index, (_, block) in enumerate(blocks) for p in block.parameters()}
    root = len(blocks)
    members: dict[tuple[int, str, bool], list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            unit = owner.get(id(p), root)
            unit_name = blocks[unit][0] if unit < root else name.split(".")[0]
            if ".experts." in name:
                unit_name = expert_module_name(name)
            members.setdefault((unit, unit_name, p.ndim >= 2), []).append((name, p))
    layout = []
    module_order = {name: i for i, name in enumerate(dict.fromkeys(name for _, name, _ in members))}
    for (unit, unit_name, decay), params in sorted(members.items(),
                                                   key=lambda item: (item[0][0], module_order[item[0][1]], not item[0][2])):
        layout.append(GroupLayout(f"{unit_name}/{'decay' if decay else 'no_decay'}", unit, decay,
                                  tuple(n for n, _ in params), tuple(p.shape for _, p in params)))
    return layout


def expert_module_name(name: str) -> str:
    """`layers.3.feed_forward.experts.5` of `layers.3.feed_forward.experts.5.w1.weight`."""
    head, _, tail = name.partition(".experts.")
    return f"{head}.experts.{tail.split('.')[0]}"


def is_expert_group(key: str) -> bool:
    return ".experts." in key


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Concatenate tensors into one flat vector (a copy)."""
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors]) if tensors else torch.zeros(0, dtype=dtype)


def unflatten(group: GroupLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of a group's flat vector, one per parameter name."""
    return {name: flat[offset : offset + shape.numel()].view(shape)
            for name, shape, offset in zip(group.names, group.shapes, group.offsets)}
