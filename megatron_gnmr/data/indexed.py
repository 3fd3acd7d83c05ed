"""Write and check Megatron `.bin/.idx` files (megatron-core's IndexedDatasetBuilder)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from megatron_gnmr.errors import UserError


def write_indexed_dataset(token_documents: Iterable[list[int]], prefix: Path) -> int:
    """Write one document per item, each ending with EOD. Returns the token count.

    Written under a temporary name, then renamed: an interrupted run leaves no half file
    that a later run would take for a finished one.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    partial = prefix.with_name(prefix.name + ".partial")
    builder = IndexedDatasetBuilder(f"{partial}.bin", dtype=np.uint16)
    total = 0
    for ids in token_documents:
        if not ids:
            continue
        builder.add_document(np.asarray(ids, dtype=np.uint16), [len(ids)])
        total += len(ids)
    builder.finalize(f"{partial}.idx")
    for suffix in (".bin", ".idx"):
        Path(f"{partial}{suffix}").replace(f"{prefix}{suffix}")
    return total


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> None:
    """Raise a UserError naming the file if the prefix is missing or unreadable."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise UserError(f"{flag} {prefix}: {prefix}{suffix} does not exist "
                            "(give the prefix without .bin/.idx, or run prepare-data)")
    try:
        dataset = IndexedDataset(prefix, mmap=True)
        if len(dataset) == 0:
            raise ValueError("no documents")
        dataset[len(dataset) - 1]
    except Exception as error:  # megatron raises AssertionError/ValueError on corrupt files
        raise UserError(f"{flag} {prefix}: unreadable .bin/.idx ({type(error).__name__}: "
                        f"{error}); regenerate it with prepare-data") from None
