"""Hand-written collective algorithms on torch.distributed point-to-point calls.

`all_reduce(tensor, algorithm)` sums a tensor over the ranks in place with one of ALL_REDUCE;
the other collectives are in ring.py, recursive.py, tree.py, alltoall.py and two_level.py.
Every algorithm sums (any floating or integer dtype; exact on integers) over an ordered rank
list (comm/p2p.py `Ranks`), the whole world by default.
"""

from __future__ import annotations

import os

import torch

from fivefold.comm.p2p import Ranks
from fivefold.comm.recursive import butterfly_all_reduce, halving_doubling_all_reduce, rabenseifner_all_reduce
from fivefold.comm.ring import ring_all_reduce
from fivefold.comm.tree import double_tree_all_reduce, tree_all_reduce
from fivefold.comm.two_level import hierarchical_all_reduce, torus_all_reduce
from fivefold.errors import ConfigError

ALL_REDUCE = {
    "ring": ring_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
    "rabenseifner": rabenseifner_all_reduce,
    "butterfly": butterfly_all_reduce,
    "tree": tree_all_reduce,
    "double_tree": double_tree_all_reduce,
    "hierarchical": None,  # needs a node size
    "torus": torus_all_reduce,
}


def default_node_size(ranks: Ranks) -> int:
    """How many of `ranks` share each node (global rank // LOCAL_WORLD_SIZE under torchrun).

    The whole list when the ranks are not laid out as equal consecutive runs per node (or when
    not launched by torchrun).
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if local < 1:
        return ranks.size
    nodes = [member // local for member in ranks.members]
    size = nodes.count(nodes[0])
    laid_out = [node for node in dict.fromkeys(nodes) for _ in range(size)]
    return size if nodes == laid_out else ranks.size


def all_reduce(tensor: torch.Tensor, algorithm: str, ranks: Ranks | None = None, node_size: int = 0) -> torch.Tensor:
    """Sum `tensor` (contiguous, any shape) over `ranks` in place with the named algorithm."""
    if algorithm not in ALL_REDUCE:
        raise ConfigError(f"gradient_comm.allreduce_algorithm = {algorithm!r} is not one of {', '.join(ALL_REDUCE)}")
    if not tensor.is_contiguous():
        raise ValueError("the hand-written collectives work in place on contiguous tensors")
    ranks = ranks or Ranks.world()
    flat = tensor.view(-1)
    if algorithm == "hierarchical":
        hierarchical_all_reduce(flat, ranks, node_size or default_node_size(ranks))
    else:
        ALL_REDUCE[algorithm](flat, ranks)
    return tensor
