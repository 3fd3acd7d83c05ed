"""Reading a torch_dist checkpoint runs no code from its files.

What megatron-core's torch_dist format reads, and how it would read it at our torch version
(2.13) left alone:
- `.metadata` (torch.distributed.checkpoint's index): `pickle.load` in
  `FileSystemReader.read_metadata` -- a crafted file runs any code it names;
- the byte items of `*.distcp` (megatron's ShardedObjects): `torch.load(weights_only=False)` in
  `DefaultLoadPlanner.load_bytes` -- the same;
- the common state (`common.pt` up to megatron-core 0.16; a `common_state` byte item of the
  `.distcp` files from 0.19): `torch.load` with torch's default `weights_only=True` and
  megatron-core's list of safe classes -- data only, but a refused file ends in a traceback.

While `reading_data_only()` is active, `.metadata` is unpickled by an unpickler that builds
only the classes such an index is made of (torch.distributed.checkpoint's metadata and plan
records, `torch.Size`, dtypes, layouts and memory formats) and refuses any other name, and
byte items are loaded with `weights_only=True`. A refusal is a `CheckpointNotData` error,
which the loader reports as a corrupt checkpoint (passed over for an older one).
"""

from __future__ import annotations

import contextlib
import io
import pickle

import torch

ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType",
                                             "TensorWriteData", "LoadPlan", "ReadItem",
                                             "LoadItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class CheckpointNotData(Exception):
    """A checkpoint file asked for something other than data."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointNotData(f"the checkpoint index names {module}.{name}, which is not "
                                "checkpoint metadata")


def read_index(stream) -> object:
    """torch.distributed.checkpoint's `.metadata`, data only."""
    try:
        return _MetadataUnpickler(stream).load()
    except CheckpointNotData:
        raise
    except Exception as error:  # truncated or garbage: pickle raises many types
        raise CheckpointNotData(f"the checkpoint index is unreadable "
                                f"({type(error).__name__})") from None


@contextlib.contextmanager
def reading_data_only():
    """Within: torch_dist's index and byte items are read as data (see the module)."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    original_read, original_bytes = filesystem.FileSystemReader.read_metadata, \
        DefaultLoadPlanner.load_bytes

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_index(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointNotData(f"a byte item of the checkpoint is not data "
                                    f"({type(error).__name__})") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    filesystem.FileSystemReader.read_metadata = read_metadata
    DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        filesystem.FileSystemReader.read_metadata = original_read
        DefaultLoadPlanner.load_bytes = original_bytes


def read_common(directory) -> dict:
    """The checkpoint's common state (Megatron-LM's `args`, `iteration`, ... and ours), as
    data: `common.pt` where megatron-core writes one (0.16), else the `common_state` byte item
    that newer releases (0.19) keep inside the torch_dist files, through this module's
    readers."""
    from pathlib import Path

    legacy = Path(directory) / "common.pt"
    try:
        if legacy.is_file():
            return torch.load(legacy, map_location="cpu", weights_only=True)
        from megatron.core.dist_checkpointing import serialization

        with reading_data_only():
            return serialization.load_common_state_dict(str(directory))
    except CheckpointNotData:
        raise
    except BaseException as error:  # torch's CheckpointException is a BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointNotData(f"its common state is not data ({type(error).__name__})") \
            from None
