"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

DCP keeps its index, `.metadata`, as a pickle, and `pickle.load` runs whatever a crafted file
asks for. DCP has a second such path: an entry the index declares as bytes (not a tensor) is
handed to `torch.load(weights_only=False)`. fivefold saves only tensors, so it closes both:

    RestrictedUnpickler    admits the DCP metadata classes, torch.Size, dtypes and layouts, and
                           pathlib paths, nothing else (Python's "Restricting Globals" recipe);
                           any other global is refused, naming the file and the global
    check_metadata         every entry must be a tensor; every storage location must be a plain
                           file name of this folder listed in the manifest (no path traversal)
    TensorOnlyLoadPlanner  DCP's default planner with the bytes path refused
    VerifiedReader         DCP's file reader whose index goes through the two checks above and
                           which verifies each data file against the checkpoint's manifest
                           (reliability/manifest.py) before reading it, once per file

Tensor data itself is read by DCP with `torch.load(weights_only=True)`, which admits tensors only.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fivefold.errors import CheckpointError
from fivefold.reliability.manifest import Manifest

_METADATA_CLASSES = {
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", name): None for name in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,
    ("torch", "Size"): None,
    ("torch.serialization", "_get_layout"): None,
    ("pathlib", "PosixPath"): None,
    ("pathlib", "PurePosixPath"): None,
    ("pathlib", "WindowsPath"): None,
    ("pathlib", "PureWindowsPath"): None,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; refuses every other global (so no constructor or function of an attacker's choice runs)."""

    def __init__(self, data: bytes, source: str):
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.source} asks to load {module}.{name}, which a checkpoint index never holds: "
                              "refused (the file was crafted or damaged; nothing from it was run)")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.source} holds a persistent reference, which a checkpoint index never holds: refused")


def unpickle_metadata(data: bytes, source: str) -> Metadata:
    try:
        metadata = RestrictedUnpickler(data, source).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is a damaged checkpoint
        raise CheckpointError(f"{source} is not a readable checkpoint index ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{source} does not hold a checkpoint index (found {type(metadata).__name__})")
    return metadata


def check_metadata(metadata: Metadata, manifest: Manifest, state_dir: str, source: str) -> None:
    """Tensors only, stored in files of this folder that the manifest lists."""
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{source}: entry {fqn!r} is stored as {type(entry).__name__}; fivefold checkpoints hold "
                                  "tensors only, and other entries would be unpickled: refused")
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or pathlib.PurePosixPath(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{source}: entry {index.fqn!r} points outside its folder ({name!r}): refused")
        if f"{state_dir}/{name}" not in manifest.files:
            raise CheckpointError(f"{source}: entry {index.fqn!r} is stored in {name}, which the manifest does not list")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            raise CheckpointError(f"{source}: entry {index.fqn!r} has an invalid offset or length")


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that bytes entries (torch.load without weights_only) are refused."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is stored as pickled bytes; fivefold "
                              "checkpoints hold tensors only: refused")


class VerifiedReader(FileSystemReader):
    """A DCP reader for `folder/state_dir` whose every file is checked against `manifest` before use."""

    def __init__(self, manifest: Manifest, state_dir: str = "state"):
        super().__init__(str(Path(manifest.folder) / state_dir))
        self.manifest, self.state_dir = manifest, state_dir
        self._verified: set[str] = set()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        name = f"{self.state_dir}/.metadata"
        source = f"{self.manifest.label}: {name}"
        metadata = unpickle_metadata(self.manifest.read_bytes(name), source)
        check_metadata(metadata, self.manifest, self.state_dir, source)
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            name = f"{self.state_dir}/{self.storage_data[item.storage_index].relative_path}"
            if name not in self._verified:
                self.manifest.verify(name)
                self._verified.add(name)
        return super().read_data(plan, planner)
