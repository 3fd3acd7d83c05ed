"""Write and check Megatron `.bin/.idx` files (megatron-core's IndexedDatasetBuilder)."""

from __future__ import annotations

import struct
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


_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# megatron's `indexed_dataset.DType` codes -> numpy dtypes
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> None:
    """Raise a UserError naming the file if the prefix is missing, truncated or corrupt.

    Checked by reading the .idx layout (megatron's `_IndexReader` format) rather than by
    opening an IndexedDataset: a failed IndexedDataset constructor prints a traceback from
    its `__del__` at exit, which is exactly what a user mistake must not show.
    """
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise UserError(f"{flag} {prefix}: {prefix}{suffix} does not exist "
                            "(give the prefix without .bin/.idx, or run prepare-data)")
    problem = _index_problem(Path(prefix + ".idx"), Path(prefix + ".bin"))
    if problem:
        raise UserError(f"{flag} {prefix}: {problem}; regenerate it with prepare-data")


def _index_problem(idx: Path, bin_path: Path) -> str | None:
    raw = idx.read_bytes()
    if len(raw) < _HEADER_BYTES or raw[:9] != _INDEX_MAGIC:
        return f"{idx.name} is not a Megatron index (bad header)"
    version = struct.unpack_from("<Q", raw, 9)[0]
    code = raw[17]
    sequences, documents = struct.unpack_from("<QQ", raw, 18)
    if version != 1 or code not in _DTYPES:
        return f"{idx.name} has an unknown version {version} or dtype code {code}"
    expected = _HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if len(raw) < expected:
        return f"{idx.name} is truncated ({len(raw)} bytes, expected {expected})"
    if sequences == 0:
        return f"{idx.name} holds no sequences"
    lengths = np.frombuffer(raw, dtype=np.int32, count=sequences, offset=_HEADER_BYTES)
    tokens_bytes = int(lengths.astype(np.int64).sum()) * np.dtype(_DTYPES[code]).itemsize
    if bin_path.stat().st_size != tokens_bytes:
        return (f"{bin_path.name} has {bin_path.stat().st_size} bytes but the index describes "
                f"{tokens_bytes}")
    return None


def dataset_fingerprint(prefix: str) -> str:
    """What identifies a dataset for a resume: its sequence and document counts and the
    size of its index (moving the files keeps it; another dataset changes it)."""
    idx = Path(prefix + ".idx")
    raw = idx.read_bytes()[:_HEADER_BYTES]
    sequences, documents = struct.unpack_from("<QQ", raw, 18)
    return f"{sequences} sequences, {documents} documents, {idx.stat().st_size} index bytes"


def check_token_range(prefix: str, vocab_size: int, flag: str = "--data-path",
                      sample_tokens: int = 1 << 22) -> None:
    """The tokenizer must cover the data: the largest token id in the first
    `sample_tokens` tokens must be below its vocabulary (a data file written by another
    tokenizer fails here instead of in an embedding lookup)."""
    raw = Path(prefix + ".idx").read_bytes()[:_HEADER_BYTES]
    tokens = np.fromfile(prefix + ".bin", dtype=_DTYPES[raw[17]], count=sample_tokens)
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise UserError(f"{flag} {prefix}: holds token id {int(tokens.max())}, beyond the "
                        f"tokenizer's vocabulary of {vocab_size}; use the tokenizer the data "
                        "was written with (--tokenizer-model)")
