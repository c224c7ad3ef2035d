"""The training loss of a (parallelized) model's output: plain logits, or the chunked fused head.

Both step functions (single stage and the pipeline's last stage) call the model, then this:

    out = model(inputs, positions=positions, project=loss.project)
    loss_sum = loss(out, labels)

With `train.loss_chunk_tokens = 0` the model returns logits and the loss is the folds' cross-entropy
(vocab-parallel under tensor parallelism; `cross_entropy_sum` otherwise, which `train.compile` compiles so
that the fp32 upcast and the log-softmax fuse into one pass and only the logits and a log-sum-exp per token
are kept for backward, torchtitan's compiled loss). With a chunk size the model stops before its output
projection and ops/linear_cross_entropy.py applies the head and the cross-entropy chunk by chunk,
never holding the full tokens x vocab logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fivefold.model.llama import Transformer
from fivefold.ops.linear_cross_entropy import linear_cross_entropy
from fivefold.parallel.tensor_parallel import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the token cross-entropies of (..., vocab) logits, in fp32; IGNORE_INDEX labels count nothing."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@dataclass(frozen=True)
class OutputLoss:
    """Summed token cross-entropy of the model's output (callable as loss(out, labels))."""

    logits_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> sum
    model: Transformer
    vocab_size: int
    tp_group: object = None
    chunk_tokens: int = 0
    dtype: torch.dtype | None = None  # the head's matmul dtype (train.dtype): the loss runs outside autocast

    @property
    def project(self) -> bool:
        """Whether the model should apply its output projection (False: the loss applies it)."""
        return self.chunk_tokens == 0

    def __call__(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.project:
            return self.logits_loss(out, labels)
        return linear_cross_entropy(out, self.model.head_weight, labels, self.chunk_tokens, self.vocab_size,
                                    self.tp_group, IGNORE_INDEX, self.dtype)
