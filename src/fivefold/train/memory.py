"""Measure the bytes of model states one rank really holds, the activations a block keeps for backward, and the
transient bytes a piece of code allocates (`LiveBytes`: a CPU has no allocator peak to read).

Storages are counted once each (views and aliases share one storage: ZeRO's flat buffers, an fp32
master that *is* the weight shard), in the order parameters, gradients, optimizer states: a
master that aliases the weights counts as parameters, as in the ZeRO paper's accounting.
Step counters (0-dim tensors) and per-step temporaries (the fp32 gradient copy handed to the
optimizer) are not model states and are left out.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fivefold.plan.memory import ModelStateBytes


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None or tensor.dim() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure_model_states(sync) -> ModelStateBytes:
    """(parameters, gradients, optimizer states) bytes held by this rank right after an optimizer step.

    The tensors come from the gradient sync (`GradientSync.model_state_tensors`); each storage is
    counted once, in that order.
    """
    seen: set[int] = set()
    params, grads, optimizer = sync.model_state_tensors()
    return ModelStateBytes(_unique_bytes(params, seen), _unique_bytes(grads, seen), _unique_bytes(optimizer, seen))


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes autograd keeps for backward while `fn()` runs, counted once per storage.

    Measured with `torch.autograd.graph.saved_tensors_hooks`: every tensor an autograd node (or a
    recomputation region, which saves its inputs) packs for backward is seen here. Tensors in
    `exclude` (the parameters) are not activations and are left out.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(kept.values())


def saved_bytes_and_weight_casts(fn: Callable[[], object], weights: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(bytes autograd keeps while `fn()` runs, of which bf16 casts of `weights`), each storage counted once.

    The weights' own storages are left out. A cast is recognised by its values, a bf16 tensor of the same shape
    (or transposed, as autocast may save it) and sum as one of the weights cast: what bf16 autocast keeps of fp32
    weights (plan/estimate.py `weight_copy_bytes`); a stack of one expert's weights (the grouped kernel's, an
    activation) has a shape of its own. Every saved tensor is held until `fn` returns, so a storage
    freed inside `fn` cannot hand its address to a later one and be counted once for two.
    """
    weights = list(weights)
    stored = {w.untyped_storage().data_ptr() for w in weights}
    casts = {(shape, w.to(torch.bfloat16).float().sum().item()) for w in weights if w.dim() >= 2
             for shape in (tuple(w.shape), tuple(reversed(w.shape)))}
    kept: dict[int, int] = {}
    copies: dict[int, int] = {}
    held: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor)
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in stored:
            kept[storage.data_ptr()] = storage.nbytes()
            if tensor.dtype == torch.bfloat16 and (tuple(tensor.shape), tensor.float().sum().item()) in casts:
                copies[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    held.clear()
    return sum(kept.values()), sum(copies.values())


class PeakSavedBytes:
    """Peak of the bytes autograd holds for backward at any moment while the context is open.

    Where `saved_activation_bytes` adds up everything one forward saves, this follows saved tensors
    over their life: a storage counts from the first time a node saves it until the last node
    holding it is freed (after its backward, or with its graph). This is the activation memory a
    pipeline schedule needs, which depends on how many micro-batches are in flight at once.
    Parameters in `exclude` are not counted, nor tensors for which `skip` says so (ZeRO-3's gathered
    weights, which matmuls save as views: `ZeroDataParallel.holds_gathered`; their storage is released
    after the forward and grown again for backward, so they are ZeRO-3's buffers, not activations).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), skip: Callable[[torch.Tensor], bool] | None = None):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._skip = skip
        self._holders: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._excluded or storage.nbytes() == 0 or (self._skip is not None and self._skip(tensor)):
            return tensor
        if self._holders.get(ptr, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._holders[ptr] = self._holders.get(ptr, 0) + 1
        return _Held(self, ptr, storage.nbytes(), tensor)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, ptr: int, nbytes: int) -> None:
        self._holders[ptr] -= 1
        if self._holders[ptr] == 0:
            del self._holders[ptr]
            self.live -= nbytes

    def __enter__(self) -> "PeakSavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor as autograd stores it under PeakSavedBytes; freeing it returns its bytes."""

    __slots__ = ("owner", "ptr", "nbytes", "tensor")

    def __init__(self, owner: PeakSavedBytes, ptr: int, nbytes: int, tensor: torch.Tensor):
        self.owner, self.ptr, self.nbytes, self.tensor = owner, ptr, nbytes, tensor

    def __del__(self) -> None:
        self.owner._release(self.ptr, self.nbytes)


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that operators create while the mode is on and that are alive at once.

    Every operator's outputs are noted by storage (a weak reference: a storage counts until it is freed, however
    many views share it); after each operator the storages still alive are summed, and `peak` keeps the most.
    A storage freed between two operators is seen gone at the next one, which is when the next allocation can
    reuse it. This measures what a CPU run cannot read from an allocator: the transient buffers of a piece of
    code (the MoE dispatch's rows in flight) beside what it leaves behind (`live()` at its end)."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def live(self) -> int:
        """Bytes of the storages created under the mode that are alive now."""
        for ptr in [ptr for ptr, (ref, _) in self._storages.items() if ref.expired()]:
            del self._storages[ptr]
        return sum(nbytes for _, nbytes in self._storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                known = self._storages.get(storage.data_ptr())
                if storage.nbytes() and (known is None or known[0].expired()):  # new, or an address used again
                    self._storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.live())
        return out
